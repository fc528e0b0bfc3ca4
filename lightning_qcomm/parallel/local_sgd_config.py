"""LocalSGDConfig: when Local SGD averages the replicas and what it averages, checked when it is made.

One class for ``LocalSGDStrategy`` (Trainer), ``LocalSGDFabricStrategy`` (Fabric) and ``LocalSGD`` (plain
torch). The period rule itself is ``parallel.sync_rules`` (``build_rule``); the averaging is
``comm.averaging.TensorAverager``.

Example::

    config = LocalSGDConfig(sync="constant", period=8, codec="uniform", bits=8)
    config.build_rule()     # ConstantRule(period=8)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_qcomm._checks import check_bool, check_float, check_int, check_str
from lightning_qcomm.codecs import Codec, get_codec
from lightning_qcomm.comm.nonfinite import check_policy
from lightning_qcomm.parallel.sync_rules import SYNC_RULE_NAMES, SyncRule, make_rule

FP32_BYTES = 4


@dataclass(frozen=True)
class LocalSGDConfig:
    """Settings of Local SGD / Local AdamW with a constant, post-local or QSR synchronization period.

    Attributes:
        sync: "qsr" | "constant" | "post_local" (case-insensitive).
        h_base: QSR minimum period (also the period during lr warmup), >= 1.
        alpha: QSR growth coefficient, > 0 (paper, ViT-B Local AdamW: 0.0175).
        power: QSR exponent (2 quadratic; 1 linear; 3 cubic), > 0.
        period: constant period, and the local-phase period of post_local, >= 1.
        switch_step: post_local only: optimizer step where local SGD starts (data-parallel before).
        warmup_steps: QSR only: H = h_base while step < warmup_steps (set it to the lr warmup length).
        average_buffers: also average floating buffers (BatchNorm running stats) at each sync.
        average_optimizer_state: also average floating optimizer-state tensors at each sync.
        codec: None (fp32 averaging) or a codec name for quantized parameter averaging.
        bits: codec width.
        bucket_size: codec block length (elements per scale block); None = codec default.
        quantize_delta: with a codec, quantize the change since the last average (else the values).
        comm_bucket_mb: size of the flat buckets handed to each all-reduce, in MiB of fp32.
        save_rank_optimizer_states: checkpoints made through a strategy gather every rank's (local, differing)
            optimizer state so a resume restores each rank's own.
        seed: base seed of the stochastic rounding of quantized averaging.
        nonfinite: a NaN/Inf gradient ``"skip"``-s the step (a local step on that rank only, still counted so
            every rank syncs on the same steps; a data-parallel step on every rank), ``"raise"``-s
            FloatingPointError, or ``"propagate"``-s.

    Example::

        cfg = LocalSGDConfig(sync="qsr", h_base=4, codec="uniform", bits=8)
        cfg.build_rule()     # the period rule; ValueError at construction for a bad field
    """

    sync: str = "qsr"
    h_base: int = 4
    alpha: float = 0.0175
    power: float = 2.0
    period: int = 8
    switch_step: int | None = None
    warmup_steps: int = 0
    average_buffers: bool = True
    average_optimizer_state: bool = False
    codec: str | None = None
    bits: int = 8
    bucket_size: int | None = None
    quantize_delta: bool = True
    comm_bucket_mb: float = 25.0
    save_rank_optimizer_states: bool = True
    seed: int = 0
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        own = type(self).__name__
        for name in ("average_buffers", "average_optimizer_state", "quantize_delta", "save_rank_optimizer_states"):
            check_bool(own, name, getattr(self, name))
        check_int(own, "period", self.period, minimum=1)
        check_int(own, "switch_step", self.switch_step, minimum=0, optional=True)
        check_int(own, "bits", self.bits, minimum=1)
        check_int(own, "bucket_size", self.bucket_size, minimum=1, optional=True)
        check_int(own, "seed", self.seed, minimum=0)
        check_str(own, "codec", self.codec, optional=True)
        check_float(own, "comm_bucket_mb", self.comm_bucket_mb, minimum=0.0, exclusive_minimum=True)
        check_policy(own, self.nonfinite)
        if not isinstance(self.sync, str) or self.sync.lower() not in SYNC_RULE_NAMES:
            raise ValueError(f"sync must be one of {SYNC_RULE_NAMES}, got {self.sync!r}")
        object.__setattr__(self, "sync", self.sync.lower())
        self.build_rule()  # validates h_base / alpha / power (qsr), period, switch_step (post_local), warmup_steps
        self.build_codec()

    def build_rule(self) -> SyncRule:
        """The period rule named by ``sync`` (``parallel.sync_rules``)."""
        return make_rule(
            self.sync,
            h_base=self.h_base,
            alpha=self.alpha,
            power=self.power,
            period=self.period,
            switch_step=self.switch_step,
            warmup_steps=self.warmup_steps,
        )

    def build_codec(self) -> Codec | None:
        """The codec of quantized parameter averaging (None: fp32)."""
        return None if self.codec is None else get_codec(self.codec, bits=self.bits, bucket_size=self.bucket_size)

    @property
    def bucket_numel(self) -> int:
        """Elements of fp32 per flat averaging bucket (``comm_bucket_mb`` MiB)."""
        return max(1, int(self.comm_bucket_mb * 1024 * 1024 / FP32_BYTES))


__all__ = ["LocalSGDConfig"]
