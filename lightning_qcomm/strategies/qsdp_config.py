"""QSDPStrategy's argument handling: bit widths, codec choices, presets and registry names.

``bits`` sets both widths; ``weight_bits`` / ``grad_bits`` override one each (default 8). A width of 32, or
codec ``"none"``, means unquantized. Presets are the registry names ``Trainer(strategy=...)`` accepts.
``no_effect_message`` says when the settings change nothing (one device; nothing quantized).

Example::

    build_codec("grad_bits", 4, "grad_codec", "uniform", bucket_size=1024)   # UniformCodec(bits=4)
"""

from __future__ import annotations

from typing import Any

from lightning_qcomm.codecs import CODEC_NAMES, Codec, get_codec

UNQUANTIZED_BITS = 32
DEFAULT_MIN_WRAP_NUMEL = 1_000_000
CODEC_CHOICES = (*CODEC_NAMES, "none")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Lightning's own set for ModelParallelStrategy; "16-mixed" on CPU reaches the strategy as "bf16-mixed"
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")

# name -> (description, init kwargs)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qsdp": ("QSDP: FSDP2 with 8-bit quantized weights and gradients", {}),
    "qsdp_w8g8": ("QSDP: FSDP2 with 8-bit weight all-gather and 8-bit gradient reduce-scatter", {"bits": 8}),
    "qsdp_w4g4": ("QSDP: FSDP2 with 4-bit weight all-gather and 4-bit gradient reduce-scatter", {"bits": 4}),
}


def build_codec(arg_bits: str, bits: int, arg_codec: str, name: str, bucket_size: int) -> Codec | None:
    """The codec for one direction, or None when it travels unquantized."""
    if not isinstance(name, str) or name.lower() not in CODEC_CHOICES:
        raise ValueError(f"{arg_codec}={name!r} is not a known codec; allowed: {', '.join(CODEC_CHOICES)}")
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise TypeError(f"{arg_bits} must be an int, got {type(bits).__name__}")
    if name.lower() == "none" or bits == UNQUANTIZED_BITS:
        return None
    try:
        return get_codec(name.lower(), bits=bits, bucket_size=bucket_size)
    except ValueError as err:
        raise ValueError(
            f"{arg_bits}={bits} is not valid for {arg_codec}={name!r} ({err}); use {UNQUANTIZED_BITS} for unquantized"
        ) from None


def check_precision(precision: str) -> None:
    """Refuse, at setup, a Trainer precision QSDP does not support (fp16 AMP's GradScaler, 64-bit, ...)."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"QSDPStrategy does not support Trainer(precision={precision!r}); allowed: {', '.join(SUPPORTED_PRECISIONS)}"
        )


def resolve_bits(bits: int | None, specific: int | None, default: int = 8) -> int:
    if specific is not None:
        return specific
    return default if bits is None else bits


def register_presets(registry: Any, strategy_cls: type) -> None:
    """Register "qsdp", "qsdp_w8g8", "qsdp_w4g4" (skipping names already present, so it is idempotent)."""
    for name, (description, init_params) in PRESETS.items():
        if name not in registry:
            registry.register(name, strategy_cls, description=description, **init_params)


def no_effect_message(strategy: Any, quantizes_any_param: bool) -> str | None:
    """Why the strategy's compression settings change nothing for this run, or None when they do something."""
    name = type(strategy).__name__
    if strategy.world_size == 1:
        return (
            f"{name} runs on one device: nothing is communicated, so weight_bits={strategy.weight_bits} and "
            f"grad_bits={strategy.grad_bits} have no effect (FSDP2 over one rank only adds its bookkeeping)"
        )
    if strategy.weight_codec is None and strategy.grad_codec is None:
        return (
            f"{name}(weight_bits={strategy.weight_bits}, grad_bits={strategy.grad_bits}, weight_codec="
            f"{strategy.weight_codec_name!r}, grad_codec={strategy.grad_codec_name!r}) quantizes nothing: weights "
            "and gradients travel as FSDP2 sends them (32 bits / codec 'none' mean unquantized)"
        )
    if not quantizes_any_param:
        return (
            f"{name}(min_quant_numel={strategy.min_quant_numel}) quantizes nothing: every parameter of "
            f"{type(strategy.lightning_module).__name__} is 1-D or has fewer than {strategy.min_quant_numel} "
            "elements, so all travel unquantized; lower min_quant_numel to compress them"
        )
    return None
