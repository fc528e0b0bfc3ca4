"""QSDPConfig: what QSDP quantizes and how it groups a model, checked when it is made (entry-point layer).

``bits`` sets both widths; ``weight_bits`` / ``grad_bits`` override one each (default 8). A width of 32, or
codec ``"none"``, means unquantized (FSDP2's own collective, counted in the ledger). A width of
``"auto"`` is chosen by timed trial steps (``apply_qsdp``, ``comm.auto_trial``): 32 or 8 down to ``min_bits``, the
same on every rank; ``resolve_auto`` gives the config of one width. Codec names
are ``lightning_qcomm.codecs.CODEC_NAMES`` or ``"none"``. Every field is a typed primitive, so the same
settings come from Python, a YAML config or a registry preset, and ``QSDPStrategy`` (Trainer),
``QSDPFabricStrategy`` (Fabric) and ``apply_qsdp`` (plain torch) read them from this one class.

Example::

    config = QSDPConfig(weight_bits=8, grad_bits=4, layer_classes="Block")
    config.build_weight_codec()       # UniformCodec(bits=8, bucket_size=1024)
    QSDPConfig(bits="auto", min_bits=4).resolve_auto(32, 4)   # the config of one candidate width per direction
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_qcomm._checks import check_bool, check_int, check_str
from lightning_qcomm.codecs import Codec, check_codec_bits, codec_names, get_codec
from lightning_qcomm.comm.auto_trial import WIDTHS, candidate_widths
from lightning_qcomm.comm.nonfinite import check_policy

UNQUANTIZED_BITS = 32
DEFAULT_MIN_WRAP_NUMEL = 1_000_000
CODEC_CHOICES = codec_names(with_none=True)  # every registered codec, and "none" (unquantized)
AUTO = "auto"
AUTO_MIN_BITS = tuple(sorted(WIDTHS))  # 2, 4, 8: the narrowest width "auto" may choose
DEFAULT_MIN_BITS = 4
BitsArg = int | Literal["auto"] | None
"""A width argument: an int, ``"auto"`` (chosen by timed trial steps) or None (the default rule); LightningCLI parses YAML by it."""


def check_bits(owner: str, name: str, value: Any) -> int | str | None:
    """An int (not a bool), ``"auto"`` or None; the int's range is the codec's (checked when it is built)."""
    if value is None or value == AUTO or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    error = ValueError if isinstance(value, str) else TypeError
    raise error(f"{owner}({name}={value!r}) is not allowed; allowed: an int, 'auto' or None")


def check_auto_codec(owner: str, arg_codec: str, name: str, min_bits: int, bucket_size: int) -> None:
    """A codec that ``"auto"`` can use: one with every width from 8 down to ``min_bits``."""

    def usable(codec: str) -> bool:
        if codec == "none":
            return False
        try:
            for b in candidate_widths(min_bits)[1:]:
                get_codec(codec, bits=b, bucket_size=bucket_size)
        except (ValueError, TypeError):
            return False
        return True

    allowed = [c for c in CODEC_CHOICES if usable(c)]
    if not isinstance(name, str) or name.lower() not in allowed:
        raise ValueError(
            f"{owner}({arg_codec}={name!r}) cannot be used with an 'auto' width and min_bits={min_bits}: it needs a "
            f"codec with every width in {candidate_widths(min_bits)[1:]}; allowed: {', '.join(allowed)}"
        )


def check_width(owner: str, arg_bits: str, bits: int | str, arg_codec: str, name: str) -> None:
    """``bits`` (spelled ``arg_bits``, as the user passed it: ``bits`` sets both directions) against codec
    ``name``'s own widths, or 32 (unquantized); the codec name against ``CODEC_CHOICES``. An ``"auto"`` width is
    left to ``check_auto_codec`` (which names the codecs every candidate width has)."""
    if bits == AUTO:
        return
    if not isinstance(name, str) or name.lower() not in CODEC_CHOICES:
        raise ValueError(f"{owner}({arg_codec}={name!r}) is not supported; allowed: {', '.join(CODEC_CHOICES)}")
    if name.lower() == "none" or bits == UNQUANTIZED_BITS:
        return
    also = f", or {UNQUANTIZED_BITS} for unquantized" + (", or 'auto'" if arg_bits != "intra_node_bits" else "")
    check_codec_bits(owner, bits, name, bits_arg=arg_bits, codec_arg=arg_codec, also=also)


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
        weight_bits: bits of the weight all-gather codes (codec range, e.g. uniform 1..8; 32 = unquantized), or
            ``"auto"``; resolved at construction (``bits``, else 8).
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
            their own and each group prefetches the next one's weights in forward, and gradient reduce-scatters
            (with ``hsdp``: the averages across nodes) finish at the end of backward; bit-identical to inline.
        nonfinite: a step with a NaN/Inf gradient on any rank is ``"skip"``-ped on every rank (the ranks agree
            with one 8-byte all-reduce), ``"raise"``-s FloatingPointError, or ``"propagate"``-s.
        hsdp: shard inside a node and replicate across nodes (``parallel.hsdp``; needs the 2-D mesh of
            ``comm.topology.node_groups``): ``grad_bits`` / ``grad_codec`` then set the all-reduce across nodes
            (``"auto"``: its width chosen by the trial, as flat QSDP's).
        intra_node_bits: with ``hsdp``, the width of the all-gathers and reduce-scatters inside a node (None:
            unquantized, FSDP2's own; ``weight_codec`` / ``grad_codec`` name their codecs).
        min_bits: with a width of ``"auto"``, the narrowest it may choose (2, 4 or 8): the accuracy rule. The
            candidates are 32 (no compression) and 8 down to ``min_bits``; the direction's codec (``weight_codec``
            / ``grad_codec``) must have all of them. Not for the weights with ``hsdp`` or ``quantize_master``.

    Example::

        cfg = QSDPConfig(weight_bits=8, grad_bits=4)   # or QSDPConfig(bits=8) for both
        cfg = QSDPConfig(bits="auto", min_bits=4)      # both widths chosen by timed trial steps
    """

    bits: BitsArg = None
    weight_bits: BitsArg = None
    grad_bits: BitsArg = None
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
    min_bits: int = DEFAULT_MIN_BITS

    def __post_init__(self) -> None:
        own = type(self).__name__
        for name in ("bits", "weight_bits", "grad_bits"):
            check_bits(own, name, getattr(self, name))
        if not isinstance(self.min_bits, int) or isinstance(self.min_bits, bool) or self.min_bits not in AUTO_MIN_BITS:
            raise ValueError(
                f"{own}(min_bits={self.min_bits!r}) is not allowed; allowed: {', '.join(map(str, AUTO_MIN_BITS))}"
            )
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
        if self.hsdp and self.weight_bits == AUTO:
            raise ValueError(
                f"{own}(hsdp=True, weight_bits='auto') is not supported: under hsdp the weights travel only inside a "
                "node, at intra_node_bits; allowed: grad_bits='auto' (or bits='auto') for the average across nodes"
            )
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
        for direction in ("weight", "grad"):  # each width against its codec, named as the user passed it
            given = getattr(self, f"{direction}_bits")
            spelled = f"{direction}_bits" if given is not None or self.bits is None else "bits"
            width = default if given is None else given
            object.__setattr__(self, f"{direction}_bits", width)
            check_width(own, spelled, width, f"{direction}_codec", getattr(self, f"{direction}_codec"))
        if self.intra_node_bits is not None:
            for codec_arg in ("weight_codec", "grad_codec"):
                check_width(own, "intra_node_bits", self.intra_node_bits, codec_arg, getattr(self, codec_arg))
        self._check_auto(own)
        # raise for a width the codec does not have
        weight_codec = None if self.auto_weights else self.build_weight_codec()
        if not self.auto_grads:
            self.build_grad_codec()
        self.build_intra_codecs()
        if self.quantize_master and weight_codec is None:
            raise ValueError(
                f"{own}(quantize_master=True) needs a quantized weight codec (weight_bits < 32, codec not 'none')"
            )

    def _check_auto(self, own: str) -> None:
        if not self.has_auto:
            if self.min_bits != DEFAULT_MIN_BITS:
                rank_zero_warn(
                    f"{own}(min_bits={self.min_bits}) has no effect: it bounds the width weight_bits='auto' / "
                    "grad_bits='auto' choose, and neither is 'auto'"
                )
            return
        if self.auto_weights and self.quantize_master:
            raise ValueError(
                f"{own}(quantize_master=True, weight_bits='auto') is not supported: the projection needs a quantized "
                "weight codec, and 'auto' may choose 32; allowed: an int weight_bits < 32"
            )
        if self.auto_weights:
            check_auto_codec(own, "weight_codec", self.weight_codec, self.min_bits, self.bucket_size)
        if self.auto_grads:
            check_auto_codec(own, "grad_codec", self.grad_codec, self.min_bits, self.bucket_size)

    @property
    def auto_weights(self) -> bool:
        """Whether the weight width is chosen by the trial (``weight_bits="auto"``)."""
        return self.weight_bits == AUTO

    @property
    def auto_grads(self) -> bool:
        """Whether the gradient width is chosen by the trial (``grad_bits="auto"``)."""
        return self.grad_bits == AUTO

    @property
    def has_auto(self) -> bool:
        return self.auto_weights or self.auto_grads

    def resolve_auto(self, weight_bits: int | None, grad_bits: int | None) -> QSDPConfig:
        """This config with each ``"auto"`` width replaced by the one chosen (None: keep that direction as it is).
        The result has no ``"auto"`` left (a direction still ``"auto"`` raises ValueError) and ``min_bits``, which
        only bounds the choice, back at its default."""
        w = weight_bits if self.auto_weights and weight_bits is not None else self.weight_bits
        g = grad_bits if self.auto_grads and grad_bits is not None else self.grad_bits
        if AUTO in (w, g):
            raise ValueError(
                f"resolve_auto(weight_bits={weight_bits!r}, grad_bits={grad_bits!r}) leaves an 'auto' width"
            )
        return dataclasses.replace(self, bits=None, weight_bits=w, grad_bits=g, min_bits=DEFAULT_MIN_BITS)

    @property
    def layer_class_set(self) -> set[str] | None:
        """``layer_classes`` as a set of class names (None: the ``ModuleList`` / size policy)."""
        if self.layer_classes is None:
            return None
        return {c.strip() for c in self.layer_classes.split(",") if c.strip()}

    def _check_resolved(self, name: str) -> None:
        if getattr(self, name) == AUTO:
            raise ValueError(
                f"{name}='auto' has no single codec: apply_qsdp builds one per candidate width (auto_codecs) and the "
                "trial sets each step's; for one width use config.resolve_auto(weight_bits, grad_bits)"
            )

    def build_weight_codec(self) -> Codec | None:
        """The codec of the weight all-gather (None: unquantized); ValueError while ``weight_bits="auto"``."""
        self._check_resolved("weight_bits")
        return build_codec("weight_bits", self.weight_bits, "weight_codec", self.weight_codec, self.bucket_size)

    def build_grad_codec(self) -> Codec | None:
        """The codec of the gradient reduce-scatter (None: unquantized); with ``hsdp``, of the all-reduce across
        nodes. ValueError while ``grad_bits="auto"``."""
        self._check_resolved("grad_bits")
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


__all__ = [
    "AUTO",
    "AUTO_MIN_BITS",
    "CODEC_CHOICES",
    "DEFAULT_MIN_BITS",
    "DEFAULT_MIN_WRAP_NUMEL",
    "UNQUANTIZED_BITS",
    "BitsArg",
    "QSDPConfig",
    "build_codec",
    "check_bits",
    "check_width",
]
