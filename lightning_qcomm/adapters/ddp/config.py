"""QuantDDPConfig: what the quantized DDP gradient all-reduce compresses and when, checked when it is made.

One class for every way in: ``QuantDDPStrategy`` (Trainer), ``QuantDDPFabricStrategy`` (Fabric) and
``quant_ddp_hook`` (plain ``DistributedDataParallel``) build it from the same typed primitives, and
``adapters.ddp.hooks.QuantDDPHookState`` reads it. Error feedback with a codec that is not contractive is
warned about by ``warn_if_not_contractive`` where it is put to use (it typically diverges, see
``relative_compression_error``).

Example::

    config = QuantDDPConfig(codec="nuqsgd", bits=4)
    config.build_codec()        # NUQSGDCodec(bits=4, bucket_size=512): the codec's default bucket
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_qcomm._checks import check_bool, check_int
from lightning_qcomm.codecs import Codec, check_codec_bits, codec_names, get_codec
from lightning_qcomm.comm.auto_trial import AUTO_CODEC, RECHECK_STEPS, TRIAL_STEPS, UNCOMPRESSED
from lightning_qcomm.comm.nonfinite import check_policy

DDP_CODECS = (*codec_names(family="quantizer", with_none=True), "auto")
"""Codec names the DDP hook accepts (the registry's quantizers); ``"none"`` is the uncompressed fp32 path
(through our ledger); ``"auto"`` times the first steps at "none" and uniform 8/4/2-bit and keeps the fastest
(``comm.auto_trial``)."""
AUTO_MIN_BITS = (2, 4, 8)

UNCOMPRESSED_BITS = 32


@dataclass(frozen=True)
class QuantDDPConfig:
    """Settings of the quantized DDP gradient all-reduce.

    Attributes:
        codec: one of ``DDP_CODECS`` (case-insensitive); ``"none"`` all-reduces in fp32 through lightning_qcomm
            (ledger-counted, numerically plain DDP).
        bits: code width; None means 8 (32 for ``"none"``, the only width it has). Allowed: uniform 1..8,
            qsgd/qsgdinf/nuqsgd 2..8, fp8_* 8. Resolved at construction.
        bucket_size: elements per codec scale block (not DDP's ``bucket_cap_mb``); None: the codec's default for
            its width (``codec_spec(codec).default_bucket(bits)``: 512, and 128 for qsgd at 4 bits or fewer, whose
            variance bound grows with the bucket).
        error_feedback: keep a per-rank residual buffer per bucket (checkpointed per rank).
        min_quant_numel: parameters with fewer elements travel uncompressed (biases, norms).
        start_step: optimizer steps of uncompressed warm-up before compression starts.
        seed: user seed folded with (step, bucket index, round) into the codec's random bits.
        overlap_comm: on CPU/gloo, run each bucket's collective on a background thread over a process group of
            its own, so it overlaps the rest of the backward pass; bit-identical to inline. CUDA runs inline.
        nonfinite: a step with a NaN/Inf gradient is ``"skip"``-ped (the averaged gradients are the same on every
            rank, so every rank decides alike), ``"raise"``-s FloatingPointError, or ``"propagate"``-s.
        hierarchical: reduce each bucket exactly (fp32) inside a node and compress only across nodes
            (``collectives.hierarchical``: intra reduce-scatter, compressed all-reduce of 1/node_size of the bucket
            across nodes, intra all-gather); error feedback then keeps this rank's residual of its shard. On one
            node, or one rank per node, the flat all-reduce runs (warned once). docs/design.md, "Topology".
        node_size: ranks per node for ``hierarchical``; None takes the launcher's (Lightning's devices per node,
            torchrun's ``LOCAL_WORLD_SIZE``). Must divide the world size (checked at setup).
        min_bits: with ``codec="auto"``, the narrowest width it may choose (2, 4 or 8): the accuracy rule. The
            hook times ``auto_trial_steps`` optimizer steps (after one untimed one) at each of 32 (no compression)
            and the uniform widths 8 .. ``min_bits``, from ``start_step`` on, and keeps the fastest
            (``comm.auto_trial``): the same on every rank, logged, checkpointed. With ``hierarchical`` it sets
            the width across nodes; its 32 bits are one flat fp32 all-reduce, as DDP's.
        auto_trial_steps: with ``codec="auto"``, timed steps per candidate width (their minimum counts).
        auto_recheck_steps: with ``codec="auto"``, steps at the choice before the trial runs again (0: never).

    Example::

        cfg = QuantDDPConfig(codec="nuqsgd", bits=4, error_feedback=True)
    """

    codec: str = "qsgd"
    bits: int | None = None
    bucket_size: int | None = None
    error_feedback: bool = False
    min_quant_numel: int = 1024
    start_step: int = 0
    seed: int = 0
    overlap_comm: bool = True
    nonfinite: str = "skip"
    hierarchical: bool = False
    node_size: int | None = None
    min_bits: int = 4
    auto_trial_steps: int = TRIAL_STEPS
    auto_recheck_steps: int = RECHECK_STEPS

    def __post_init__(self) -> None:
        own = type(self).__name__
        if not isinstance(self.codec, str) or self.codec.lower() not in DDP_CODECS:
            raise ValueError(f"{own}(codec={self.codec!r}) is not supported; allowed: {', '.join(DDP_CODECS)}")
        object.__setattr__(self, "codec", self.codec.lower())
        if not isinstance(self.min_bits, int) or isinstance(self.min_bits, bool):
            raise TypeError(f"{own}(min_bits={self.min_bits!r}) must be an int; allowed: 2, 4, 8")
        if self.min_bits not in AUTO_MIN_BITS:
            raise ValueError(f"{own}(min_bits={self.min_bits!r}) is not allowed; allowed: 2, 4, 8")
        check_int(own, "auto_trial_steps", self.auto_trial_steps, minimum=1)
        check_int(own, "auto_recheck_steps", self.auto_recheck_steps, minimum=0)
        auto = self.codec == "auto"
        if auto and self.bits is not None:
            raise ValueError(f"{own}(codec='auto', bits={self.bits}): 'auto' chooses the width; set min_bits")
        if self.bits is None and not auto:
            object.__setattr__(self, "bits", UNCOMPRESSED_BITS if self.codec == "none" else 8)
        if not auto:  # the codec's own widths first (nuqsgd: 2..8), not a generic bound
            also = "" if self.codec == "none" else ", or codec='none' for fp32"
            check_codec_bits(own, self.bits, self.codec, also=also)
        check_int(own, "bucket_size", self.bucket_size, minimum=1, optional=True)
        check_bool(own, "error_feedback", self.error_feedback)
        check_int(own, "min_quant_numel", self.min_quant_numel, minimum=0)
        check_int(own, "start_step", self.start_step, minimum=0)
        check_int(own, "seed", self.seed, minimum=0)
        check_bool(own, "overlap_comm", self.overlap_comm)
        check_policy(own, self.nonfinite)
        check_bool(own, "hierarchical", self.hierarchical)
        check_int(own, "node_size", self.node_size, minimum=1, optional=True)
        if auto:
            return  # the codec is built once the width is chosen
        try:
            self.build_codec()
        except (ValueError, TypeError) as err:
            raise type(err)(
                f"{own}(codec={self.codec!r}, bits={self.bits}, bucket_size={self.bucket_size}): {err}"
            ) from err

    def resolve_auto(self, bits: int) -> QuantDDPConfig:
        """This config with ``codec="auto"`` replaced by what it chose: ``"none"`` for 32 bits, else uniform."""
        import dataclasses

        codec = "none" if bits == UNCOMPRESSED else AUTO_CODEC
        return dataclasses.replace(self, codec=codec, bits=bits)

    def build_codec(self) -> Codec | None:
        """The codec object (None for ``"none"``); raises ValueError/TypeError on bad combinations."""
        if self.codec == "auto":
            raise ValueError(
                "codec='auto' has no single codec: the hook state builds one per candidate width "
                "(config.resolve_auto(bits).build_codec())"
            )
        if self.codec == "none":
            return None
        return get_codec(self.codec, bits=self.bits, bucket_size=self.bucket_size)


def warn_if_not_contractive(config: QuantDDPConfig, owner: str) -> None:
    """Warn (once per call, rank 0) when ``config`` asks for error feedback with a codec that is not contractive,
    or sets ``node_size`` without ``hierarchical`` (it has no effect then)."""
    if config.node_size is not None and not config.hierarchical:
        rank_zero_warn(
            f"{owner}(node_size={config.node_size}, hierarchical=False): node_size has no effect without "
            "hierarchical=True"
        )
    if config.codec == "auto":
        return  # uniform: contractive at every width
    defaults = QuantDDPConfig()
    for name in ("min_bits", "auto_trial_steps", "auto_recheck_steps"):
        if getattr(config, name) != getattr(defaults, name):
            rank_zero_warn(
                f"{owner}(codec={config.codec!r}, {name}={getattr(config, name)}): {name} has no "
                "effect without codec='auto'"
            )
    codec = config.build_codec()
    if not config.error_feedback or codec is None:
        return
    rho = relative_compression_error(codec)
    if rho >= 1.0:
        rank_zero_warn(
            f"{owner}(codec={config.codec!r}, bits={config.bits}, bucket_size={codec.bucket_size}, "
            f"error_feedback=True): this codec is not contractive (relative error ||Q(x)-x||^2/||x||^2 = "
            f"{rho:.2f} >= 1 on Gaussian data), and error feedback then typically diverges. Use more bits, a "
            "smaller bucket_size, codec='uniform' or 'qsgdinf', or error_feedback=False."
        )


def relative_compression_error(codec: Codec, numel: int = 4096, seed: int = 0) -> float:
    """rho = ||D(Q(x)) - x||^2 / ||x||^2 for a fixed standard-normal x of ``numel`` elements.

    Error feedback converges for contractive compressors, E||C(x) - x||^2 <= (1 - delta)||x||^2, i.e.
    rho < 1 (Stich et al. 2018; Karimireddy et al. 2019). Unbiased QSGD-type codecs at few bits are
    not: QSGD's bound is min(B/s^2, sqrt(B)/s) with s = 2^(b-1) - 1 levels (about 22 at 2 bits and
    B = 512). The residual then grows every step and training diverges.

    Example::

        relative_compression_error(get_codec("uniform", bits=2))   # < 1: error feedback is safe
    """
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    err = codec.roundtrip(x, seed=seed) - x
    return float(err.pow(2).sum() / x.pow(2).sum())


__all__ = ["DDP_CODECS", "QuantDDPConfig", "relative_compression_error", "warn_if_not_contractive"]
