"""What the QSDP strategies (Trainer and Fabric) check around ``apply_qsdp``: the precision, and settings that
change nothing for a run (said once, naming the setting; Lightning layer).

Example::

    check_precision("16-mixed")   # ValueError: fp16 AMP's GradScaler is not supported
    message = no_effect_message("QSDPStrategy", config, world_size=1, quantizes_any_param=True, module_name="GPT")
"""

from __future__ import annotations

from lightning_qcomm.parallel.qsdp_config import QSDPConfig

# Lightning's own set for ModelParallelStrategy; "16-mixed" on CPU reaches the strategy as "bf16-mixed"
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def check_precision(precision: str) -> None:
    """Refuse, at setup, a Trainer precision QSDP does not support (fp16 AMP's GradScaler, 64-bit, ...)."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"QSDPStrategy does not support Trainer(precision={precision!r}); allowed: {', '.join(SUPPORTED_PRECISIONS)}"
        )


def no_effect_message(
    owner: str, config: QSDPConfig, world_size: int, quantizes_any_param: bool, module_name: str
) -> str | None:
    """Why ``config`` changes nothing for this run, or None when it does something."""
    if world_size == 1:
        return (
            f"{owner} runs on one device: nothing is communicated, so weight_bits={config.weight_bits!r} and "
            f"grad_bits={config.grad_bits!r} have no effect (FSDP2 over one rank only adds its bookkeeping)"
        )
    # an "auto" width is chosen from measurements (and logged), no compression included
    if not config.has_auto and config.build_weight_codec() is None and config.build_grad_codec() is None:
        return (
            f"{owner}(weight_bits={config.weight_bits}, grad_bits={config.grad_bits}, weight_codec="
            f"{config.weight_codec!r}, grad_codec={config.grad_codec!r}) quantizes nothing: weights "
            "and gradients travel as FSDP2 sends them (32 bits / codec 'none' mean unquantized)"
        )
    if not quantizes_any_param:
        return (
            f"{owner}(min_quant_numel={config.min_quant_numel}) quantizes nothing: every parameter of "
            f"{module_name} is 1-D or has fewer than {config.min_quant_numel} "
            "elements, so all travel unquantized; lower min_quant_numel to compress them"
        )
    return None
