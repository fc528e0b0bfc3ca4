"""QSDPConfig: what QSDP quantizes and how it groups a model, checked when it is made (entry-point layer).

``bits`` sets both widths; ``weight_bits`` / ``grad_bits`` override one each (default 8). A width of 32, or
codec ``"none"``, means unquantized (the comm still runs through the adapter and the ledger). Codec names
are ``lightning_qcomm.codecs.CODEC_NAMES`` or ``"none"``. Every field is a typed primitive, so the same
settings come from Python, a YAML config or a registry preset, and ``QSDPStrategy`` (Trainer),
``QSDPFabricStrategy`` (Fabric) and ``apply_qsdp`` (plain torch) read them from this one class.

Example::

    config = QSDPConfig(weight_bits=8, grad_bits=4, layer_classes="Block")
    config.build_weight_codec()       # UniformCodec(bits=8, bucket_size=1024)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_qcomm._checks import check_bool, check_int, check_str
from lightning_qcomm.codecs import Codec, codec_names, get_codec
from lightning_qcomm.comm.nonfinite import check_policy

UNQUANTIZED_BITS = 32
DEFAULT_MIN_WRAP_NUMEL = 1_000_000
CODEC_CHOICES = codec_names(with_none=True)  # every registered codec, and "none" (unquantized)


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


@dataclass(frozen=True)
class QSDPConfig:
    """Settings of QSDP (FSDP2 with quantized weight all-gather and gradient reduce-scatter).

    Attributes:
        bits: sets both ``weight_bits`` and ``grad_bits`` when they are None (the one-argument form).
        weight_bits: bits of the weight all-gather codes (codec range, e.g. uniform 1..8; 32 = unquantized);
            resolved at construction (``bits``, else 8).
        grad_bits: bits of the gradient reduce-scatter codes (same rule).
        bucket_size: elements per scale bucket of both codecs.
        weight_codec / grad_codec: codec names (``CODEC_NAMES`` or ``"none"``); default min-max stochastic
            rounding (unbiased).
        min_quant_numel: parameters with fewer elements, and all 1-D parameters (norms, biases), travel raw.
        quantize_master: project the sharded fp32 master weights onto the weight codec's lattice after each
            optimizer step (the variant QSDP's convergence proof analyses); needs a quantized weight codec.
        seed: user seed folded with (step, FSDP group, rank) into every codec seed.
        layer_classes: comma-separated module class names to shard as separate FSDP groups; None picks every
            element of an ``nn.ModuleList`` that has parameters (``parallel.sharding`` has the whole policy).
        min_wrap_numel: size policy when neither ``layer_classes`` nor a ``ModuleList`` gives groups.
        reshard_after_forward: FSDP2's option for the groups QSDP creates; None is FSDP2's default.
        overlap_comm: on CPU (gloo), weight all-gathers run on a background thread over a process group of
            their own and each group prefetches the next one's weights in forward; bit-identical to inline.
        nonfinite: a step with a NaN/Inf gradient on any rank is ``"skip"``-ped on every rank (the ranks agree
            with one 8-byte all-reduce), ``"raise"``-s FloatingPointError, or ``"propagate"``-s.
        hsdp: shard inside a node and replicate across nodes (``parallel.hsdp``; needs the 2-D mesh of
            ``comm.topology.node_groups``): ``grad_bits`` / ``grad_codec`` then set the all-reduce across nodes.
        intra_node_bits: with ``hsdp``, the width of the all-gathers and reduce-scatters inside a node (None:
            unquantized, FSDP2's own; ``weight_codec`` / ``grad_codec`` name their codecs).

    Example::

        cfg = QSDPConfig(weight_bits=8, grad_bits=4)   # or QSDPConfig(bits=8) for both
    """

    bits: int | None = None
    weight_bits: int | None = None
    grad_bits: int | None = None
    bucket_size: int = 1024
    weight_codec: str = "uniform"
    grad_codec: str = "uniform"
    min_quant_numel: int = 1024
    quantize_master: bool = False
    seed: int = 0
    layer_classes: str | None = None
    min_wrap_numel: int = DEFAULT_MIN_WRAP_NUMEL
    reshard_after_forward: bool | None = None
    overlap_comm: bool = True
    nonfinite: str = "skip"
    hsdp: bool = False
    intra_node_bits: int | None = None

    def __post_init__(self) -> None:
        own = type(self).__name__
        for name in ("bits", "weight_bits", "grad_bits"):
            check_int(own, name, getattr(self, name), optional=True)
        check_int(own, "bucket_size", self.bucket_size, minimum=1)
        check_int(own, "min_quant_numel", self.min_quant_numel, minimum=0)
        check_bool(own, "quantize_master", self.quantize_master)
        check_int(own, "seed", self.seed, minimum=0)
        check_str(own, "layer_classes", self.layer_classes, optional=True)
        if self.layer_classes is not None and not self.layer_class_set:
            raise ValueError(f"{own}(layer_classes={self.layer_classes!r}) names no class")
        check_int(own, "min_wrap_numel", self.min_wrap_numel, minimum=0)
        if self.reshard_after_forward is not None:
            check_bool(own, "reshard_after_forward", self.reshard_after_forward)
        check_bool(own, "overlap_comm", self.overlap_comm)
        check_policy(own, self.nonfinite)
        check_bool(own, "hsdp", self.hsdp)
        check_int(own, "intra_node_bits", self.intra_node_bits, optional=True)
        if self.intra_node_bits is not None and not self.hsdp:
            raise ValueError(f"{own}(intra_node_bits={self.intra_node_bits}) needs hsdp=True")
        if self.hsdp and self.intra_node_bits is None:
            # weights are gathered inside the node by FSDP2 itself: an explicit weight setting does nothing
            for name, given in (
                ("weight_bits", self.weight_bits is not None),
                ("weight_codec", self.weight_codec != "uniform"),
            ):
                if given:
                    rank_zero_warn(
                        f"{own}(hsdp=True, {name}={getattr(self, name)!r}) has no effect: inside a node the weights "
                        "travel as FSDP2 gathers them; set intra_node_bits to quantize them there"
                    )
        if self.hsdp and self.quantize_master:
            raise ValueError(f"{own}(hsdp=True, quantize_master=True): the master projection is for flat QSDP only")
        default = 8 if self.bits is None else self.bits
        object.__setattr__(self, "weight_bits", default if self.weight_bits is None else self.weight_bits)
        object.__setattr__(self, "grad_bits", default if self.grad_bits is None else self.grad_bits)
        weight_codec = self.build_weight_codec()  # raises for a width the codec does not have
        self.build_grad_codec()
        self.build_intra_codecs()
        if self.quantize_master and weight_codec is None:
            raise ValueError(
                f"{own}(quantize_master=True) needs a quantized weight codec (weight_bits < 32, codec not 'none')"
            )

    @property
    def layer_class_set(self) -> set[str] | None:
        """``layer_classes`` as a set of class names (None: the ``ModuleList`` / size policy)."""
        if self.layer_classes is None:
            return None
        return {c.strip() for c in self.layer_classes.split(",") if c.strip()}

    def build_weight_codec(self) -> Codec | None:
        """The codec of the weight all-gather (None: unquantized)."""
        return build_codec("weight_bits", self.weight_bits, "weight_codec", self.weight_codec, self.bucket_size)

    def build_grad_codec(self) -> Codec | None:
        """The codec of the gradient reduce-scatter (None: unquantized); with ``hsdp``, of the all-reduce across
        nodes."""
        return build_codec("grad_bits", self.grad_bits, "grad_codec", self.grad_codec, self.bucket_size)

    def build_intra_codecs(self) -> tuple[Codec | None, Codec | None]:
        """With ``hsdp``: the (weight all-gather, gradient reduce-scatter) codecs inside a node."""
        if not self.hsdp or self.intra_node_bits is None:
            return None, None
        b = self.intra_node_bits
        return (
            build_codec("intra_node_bits", b, "weight_codec", self.weight_codec, self.bucket_size),
            build_codec("intra_node_bits", b, "grad_codec", self.grad_codec, self.bucket_size),
        )


__all__ = ["CODEC_CHOICES", "DEFAULT_MIN_WRAP_NUMEL", "UNQUANTIZED_BITS", "QSDPConfig", "build_codec"]
