"""LocalSGDConfig: when Local SGD averages the replicas and what it averages, checked when it is made.

One class for ``LocalSGDStrategy`` (Trainer), ``LocalSGDFabricStrategy`` (Fabric) and ``LocalSGD`` (plain
torch). The period rule itself is ``parallel.sync_rules`` (``build_rule``); the averaging is
``collectives.averaging.TensorAverager``; ``inter_node_topology`` resolves the nodes ``scope="inter_node"`` runs on.

Example::

    config = LocalSGDConfig(sync="constant", period=8, codec="uniform", bits=8)
    config.build_rule()     # ConstantRule(period=8)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_qcomm._checks import check_bool, check_choice, check_float, check_int, check_str
from lightning_qcomm.codecs import Codec, check_codec_bits, codec_names, get_codec
from lightning_qcomm.comm.nonfinite import check_policy
from lightning_qcomm.comm.topology import Topology, hierarchical_topology
from lightning_qcomm.parallel.sync_rules import SYNC_RULE_NAMES, SyncRule, make_rule

FP32_BYTES = 4
SCOPES = ("global", "inter_node")
OUTER_OPTIMIZERS = ("average", "nesterov")


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
        max_period: QSR only: the longest period the rule may give (None: no bound but the run's end). The rule
            gives H = (alpha / lr)^2, so at AdamW's learning rates the default alpha gives hundreds of steps (306 at
            1e-3); ``sync_rules.qsr_alpha_for(H, lr)`` is the alpha for a period H at a learning rate.
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
        scope: "global" (every rank trains its own replica, averaged over the world every H steps) | "inter_node"
            (data-parallel inside a node every step, fp32 gradient mean over the node; replicas of the nodes averaged
            every H steps, each buffer crossing the slow links once; docs/design.md "Local SGD across nodes").
        node_size: ranks per node for ``scope="inter_node"``; None: the launcher's (Lightning's devices per node,
            torchrun's ``LOCAL_WORLD_SIZE``). Must divide the world.
        outer_optimizer: "average" (the replicas become their mean) | "nesterov" (DiLoCo: the mean's
            pseudo-gradient Δ = θ_global − mean(θ_local) takes an outer Nesterov SGD step; ``parallel.outer_optim``).
        outer_lr: the outer step's learning rate (> 0; DiLoCo: 0.7).
        outer_momentum: the outer step's Nesterov momentum, in [0, 1) (DiLoCo: 0.9).
        overlap: a scheduled average runs in the background while the next round trains, and is applied at that
            round's end (x <- A + progress since the snapshot; one round stale, ``parallel.local_sgd_overlap``);
            the last scheduled sync and every ``sync()`` stay exact. Uses a thread and process groups of its own.
        nonfinite: a NaN/Inf gradient ``"skip"``-s the step (a local step on that rank only, still counted so
            every rank syncs on the same steps; a data-parallel step on every rank), ``"raise"``-s
            FloatingPointError, or ``"propagate"``-s.

    Example::

        cfg = LocalSGDConfig(sync="qsr", h_base=4, codec="uniform", bits=8)
        cfg.build_rule()     # the period rule; ValueError at construction for a bad field
        diloco = LocalSGDConfig(sync="qsr", scope="inter_node", outer_optimizer="nesterov", outer_lr=0.7)
        LocalSGDConfig(sync="constant", period=8, overlap=True)   # the average hidden behind the next round
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
    scope: str = "global"
    node_size: int | None = None
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    max_period: int | None = None

    def __post_init__(self) -> None:
        own = type(self).__name__
        bools = (
            "average_buffers",
            "average_optimizer_state",
            "quantize_delta",
            "save_rank_optimizer_states",
            "overlap",
        )
        for name in bools:
            check_bool(own, name, getattr(self, name))
        check_int(own, "period", self.period, minimum=1)
        check_int(own, "switch_step", self.switch_step, minimum=0, optional=True)
        check_str(own, "codec", self.codec, optional=True)
        if self.codec is not None:  # the codec's own widths (nuqsgd: 2..8)
            if self.codec.lower() not in codec_names():
                raise ValueError(
                    f"{own}(codec={self.codec!r}) is not supported; allowed: None, {', '.join(codec_names())}"
                )
            check_codec_bits(own, self.bits, self.codec)
        else:
            check_int(own, "bits", self.bits, minimum=1)
        check_int(own, "bucket_size", self.bucket_size, minimum=1, optional=True)
        check_int(own, "seed", self.seed, minimum=0)
        check_float(own, "comm_bucket_mb", self.comm_bucket_mb, minimum=0.0, exclusive_minimum=True)
        check_policy(own, self.nonfinite)
        if not isinstance(self.sync, str) or self.sync.lower() not in SYNC_RULE_NAMES:
            raise ValueError(f"{own}(sync={self.sync!r}) is not allowed; allowed: {', '.join(SYNC_RULE_NAMES)}")
        object.__setattr__(self, "sync", self.sync.lower())
        check_int(own, "h_base", self.h_base, minimum=1)
        check_float(own, "alpha", self.alpha, minimum=0.0, exclusive_minimum=True)
        check_float(own, "power", self.power, minimum=0.0, exclusive_minimum=True)
        check_int(own, "warmup_steps", self.warmup_steps, minimum=0)
        check_int(own, "max_period", self.max_period, minimum=self.h_base, optional=True)
        check_choice(own, "scope", self.scope, SCOPES)
        check_int(own, "node_size", self.node_size, minimum=1, optional=True)
        check_choice(own, "outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        check_float(own, "outer_lr", self.outer_lr, minimum=0.0, exclusive_minimum=True)
        check_float(own, "outer_momentum", self.outer_momentum, minimum=0.0)
        if self.outer_momentum >= 1.0:
            raise ValueError(f"{own}(outer_momentum={self.outer_momentum!r}) is not allowed; allowed: [0, 1)")
        if self.sync == "post_local" and self.switch_step is None:
            raise ValueError(
                f"{own}(sync='post_local', switch_step=None): switch_step, the step where local SGD starts, is "
                "required; allowed: an int >= 0"
            )
        self._warn_no_effect(own)
        self.build_rule()  # validates h_base / alpha / power (qsr), period, switch_step (post_local), warmup_steps
        self.build_codec()

    def _warn_no_effect(self, own: str) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        if self.outer_optimizer == "average":
            for name in ("outer_lr", "outer_momentum"):
                if getattr(self, name) != defaults[name]:
                    rank_zero_warn(
                        f"{own}({name}={getattr(self, name)!r}, outer_optimizer='average'): {name} has no effect "
                        "(it is the outer Nesterov step's; set outer_optimizer='nesterov')"
                    )
        if self.sync != "qsr" and self.max_period is not None:
            rank_zero_warn(
                f"{own}(max_period={self.max_period}, sync={self.sync!r}): max_period has no effect (it bounds the "
                "period of sync='qsr')"
            )
        if self.scope == "global" and self.node_size is not None:
            rank_zero_warn(
                f"{own}(node_size={self.node_size}, scope='global'): node_size has no effect (it lays the ranks out "
                "as nodes for scope='inter_node')"
            )

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
            max_period=self.max_period,
        )

    def build_codec(self) -> Codec | None:
        """The codec of quantized parameter averaging (None: fp32)."""
        return None if self.codec is None else get_codec(self.codec, bits=self.bits, bucket_size=self.bucket_size)

    @property
    def bucket_numel(self) -> int:
        """Elements of fp32 per flat averaging bucket (``comm_bucket_mb`` MiB)."""
        return max(1, int(self.comm_bucket_mb * 1024 * 1024 / FP32_BYTES))


def inter_node_topology(
    owner: str, world_size: int, node_size: int | None = None, devices_per_node: int | None = None
) -> Topology | None:
    """The topology ``scope="inter_node"`` runs on, or None (warned once) when there is one node or one rank per
    node, where it is the global form. ValueError naming ``owner`` for a ``node_size`` that does not divide the
    world.

    Example::

        inter_node_topology("LocalSGDStrategy", 8, devices_per_node=4)   # Topology(world_size=8, node_size=4)
        inter_node_topology("LocalSGDStrategy", 4, node_size=4)          # None, warned: one node
    """
    return hierarchical_topology(
        owner,
        world_size,
        node_size,
        devices_per_node,
        setting="scope='inter_node'",
        fallback="nothing to keep data-parallel inside a node and average across nodes; it runs the global form "
        "(every rank its own replica)",
    )


def config_fingerprint(config: LocalSGDConfig, node_size: int | None = None) -> dict[str, Any]:
    """The settings compared across ranks (a period or alpha that differs would make ranks sync on different
    steps and wait in each other's averages), with ``scope="inter_node"``'s resolved ranks per node."""
    return {**asdict(config), "resolved_node_size": node_size}


__all__ = ["OUTER_OPTIMIZERS", "SCOPES", "LocalSGDConfig", "config_fingerprint", "inter_node_topology"]
