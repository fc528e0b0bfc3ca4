"""LocalSGDStrategy: Local SGD / Local AdamW in Lightning, with the Quadratic Synchronization Rule.

Each rank trains its own replica and takes H optimizer steps between parameter averages; there is
no per-step gradient all-reduce. H comes from a rule in ``sync_rules`` ("qsr": H = max(h_base,
floor((alpha/lr)^power)), "constant", "post_local"). The averaging itself (flat buckets, optional
codec) is ``comm.averaging.TensorAverager``; this file is only the Lightning glue:

* **No DDP wrapper.** The module is not wrapped in ``DistributedDataParallel``: DDP would allocate
  gradient buckets, re-broadcast rank 0's buffers on every forward (fighting buffer averaging) and
  need ``no_sync`` around every forward/backward to stay silent. Instead the parameters and buffers
  are broadcast from rank 0 once at setup, and the strategy issues collectives only at syncs.
  Launching, process-group setup, samplers, ``barrier``/``broadcast``/``reduce`` come from
  ``DDPStrategy``.
* **Counting.** One optimizer step = one call of ``optimizer_step`` (so gradient accumulation
  micro-batches do not count, and with several optimizers every ``step()`` counts, like
  ``trainer.global_step``).
* **When H is chosen.** A round starts at the first optimizer step after a sync; H is evaluated
  then, before that step runs, from the lr that step will use -- i.e. right after the sync and the
  lr scheduler update, the order of the QSR reference code. The lr is the **maximum over all
  param groups of all optimizers** (the fastest-moving group sets the period: a group with lr/10,
  e.g. layer-wise decay, would otherwise be allowed 100x longer rounds than the head). During the
  first ``warmup_steps`` steps H = h_base. H is capped by ``trainer.estimated_stepping_batches -
  step`` so training ends on a sync.
* **Sync points outside the schedule.** Before validation, before a checkpoint is dumped (in
  ``lightning_module_state_dict``, which Lightning calls on every rank) and at the end of training,
  the replicas are averaged if they moved since the last average: what is evaluated and saved is
  the averaged model. These extra averages do not change the schedule (counted in
  ``num_forced_syncs``).
* **What is averaged.** Trainable parameters (optionally quantized with ``codec``/``bits``; the
  codec then compresses the change since the last average), floating buffers such as BatchNorm
  statistics (``average_buffers``, fp32), and optionally floating optimizer-state tensors of
  dimension >= 1 such as Adam's ``exp_avg``/``exp_avg_sq`` (``average_optimizer_state``, fp32).
* **post_local.** For steps < ``switch_step`` the rule gives H = 1 and the step is data-parallel:
  gradients are all-reduced (tag "grads") inside the optimizer closure, before clipping and the
  optimizer update, exactly like DDP; afterwards parameters are averaged every ``period`` steps.
* **Checkpoint.** ``checkpoint["local_sgd"]`` holds the schedule state (step, H, steps since sync,
  number of syncs, step of the last sync), the averaging round counter and -- unless optimizer
  states are averaged -- every rank's optimizer state (gathered to rank 0), which each rank reloads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_qcomm._checks import (
    START_METHODS,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_str,
    check_timeout,
)
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.comm.averaging import TensorAverager
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.strategies.sync_rules import SYNC_RULE_NAMES, QSRRule, SyncSchedule, make_rule

log = logging.getLogger(__name__)

# constructor arguments that decide when and what ranks communicate (compared across ranks at setup)
_SETTINGS = (
    "sync", "h_base", "alpha", "power", "period", "switch_step", "warmup_steps", "average_buffers",
    "average_optimizer_state", "codec", "bits", "bucket_size", "quantize_delta", "comm_bucket_mb",
    "save_rank_optimizer_states", "seed", "nonfinite",
)  # fmt: skip

CHECKPOINT_KEY = "local_sgd"

STRATEGY_NAMES = {
    "local_sgd": ("Local SGD: average parameters every `period` optimizer steps", {"sync": "constant"}),
    "local_sgd_qsr": ("Local SGD with the Quadratic Synchronization Rule (Gu et al. 2024)", {"sync": "qsr"}),
}


class LocalSGDStrategy(DDPStrategy):
    """Local SGD with a constant, post-local or QSR synchronization period (see module docstring).

    Args:
        sync: "qsr" | "constant" | "post_local".
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
        save_rank_optimizer_states: gather every rank's (local, differing) optimizer state into the
            checkpoint so a resume restores each rank's own.
        seed: base seed of the stochastic rounding of quantized averaging.
        nonfinite: a NaN/Inf gradient ``"skip"``-s the step (a local step on that rank only, still counted so
            every rank syncs on the same steps; a data-parallel step on every rank), ``"raise"``-s
            FloatingPointError, or ``"propagate"``-s (see ``strategies.nonfinite``).
    """

    strategy_name = "local_sgd"

    def __init__(
        self,
        sync: Literal["qsr", "constant", "post_local"] = "qsr",
        h_base: int = 4,
        alpha: float = 0.0175,
        power: float = 2.0,
        period: int = 8,
        switch_step: int | None = None,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        average_optimizer_state: bool = False,
        codec: str | None = None,
        bits: int = 8,
        bucket_size: int | None = None,
        quantize_delta: bool = True,
        comm_bucket_mb: float = 25.0,
        save_rank_optimizer_states: bool = True,
        seed: int = 0,
        nonfinite: str = "skip",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        settings = {k: v for k, v in locals().items() if k in _SETTINGS}  # the arguments as given
        own = "LocalSGDStrategy"
        for name in ("average_buffers", "average_optimizer_state", "quantize_delta", "save_rank_optimizer_states"):
            check_bool(own, name, settings[name])
        check_int(own, "period", period, minimum=1)
        check_int(own, "switch_step", switch_step, minimum=0, optional=True)
        check_int(own, "bits", bits, minimum=1)
        check_int(own, "bucket_size", bucket_size, minimum=1, optional=True)
        check_int(own, "seed", seed, minimum=0)
        check_str(own, "codec", codec, optional=True)
        check_float(own, "comm_bucket_mb", comm_bucket_mb, minimum=0.0, exclusive_minimum=True)
        check_choice(own, "start_method", start_method, START_METHODS)
        check_timeout(own, timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if not isinstance(sync, str) or sync.lower() not in SYNC_RULE_NAMES:
            raise ValueError(f"sync must be one of {SYNC_RULE_NAMES}, got {sync!r}")
        self.sync = sync.lower()
        # Validates h_base/alpha/power (qsr), period, switch_step (post_local), warmup_steps.
        self._rule = make_rule(
            self.sync,
            h_base=h_base,
            alpha=alpha,
            power=power,
            period=period,
            switch_step=switch_step,
            warmup_steps=warmup_steps,
        )
        self._codec = None if codec is None else get_codec(codec, bits=bits, bucket_size=bucket_size)
        self._settings = settings
        self.nonfinite = NonFiniteGuard(nonfinite, "LocalSGDStrategy")
        self.average_buffers = average_buffers
        self.average_optimizer_state = average_optimizer_state
        self.quantize_delta = quantize_delta
        self.save_rank_optimizer_states = save_rank_optimizer_states
        self.seed = seed
        self._bucket_numel = max(1, int(comm_bucket_mb * 1024 * 1024 / 4))

        self._schedule = SyncSchedule(self._rule)
        self._param_averager: TensorAverager | None = None
        self._buffer_averager: TensorAverager | None = None
        self._checked_layouts: set[str] = set()  # averagers rebuilt per use: check their layout once
        self._num_averages = 0  # every average (scheduled or forced): seeds of quantized rounds
        self._num_forced_syncs = 0
        self._dirty = False  # replicas moved since the last average
        self._loaded_state: dict[str, Any] | None = None
        self._gathered_optimizer_states: list[list[dict[str, Any]] | None] = []

    # ------------------------------------------------------------------ registry

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "local_sgd" (constant period) and "local_sgd_qsr"; names already present are left alone."""
        for name, (description, init_params) in STRATEGY_NAMES.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **init_params)

    # ------------------------------------------------------------------ public read-only state

    @property
    def sync_period(self) -> int | None:
        """H of the current round (None between a sync and the next optimizer step)."""
        return self._schedule.h

    @property
    def num_syncs(self) -> int:
        """Scheduled synchronizations so far (data-parallel steps of post_local included)."""
        return self._schedule.num_syncs

    @property
    def num_forced_syncs(self) -> int:
        """Extra averages before validation / checkpoint / end of training."""
        return self._num_forced_syncs

    @property
    def last_sync_step(self) -> int:
        return self._schedule.last_sync_step

    @property
    def schedule_state(self) -> dict[str, Any]:
        return self._schedule.state_dict()

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        check_same_config("LocalSGDStrategy", self.config_fingerprint(), timeout=presence_timeout(self._timeout))

    def config_fingerprint(self) -> dict[str, Any]:
        """The constructor's settings (compared across ranks at setup: a period or alpha that differs would
        make ranks sync on different steps and wait in each other's averages)."""
        return dict(self._settings)

    def configure_ddp(self) -> None:
        """No DDP wrapper: broadcast parameters and buffers from rank 0 once; no gradient hooks."""
        assert self.model is not None
        _sync_module_states(self.model)

    def setup(self, trainer: Any) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True is not supported by LocalSGDStrategy (it all-reduces statistics in every "
                "forward); use average_buffers=True to average BatchNorm statistics at each sync"
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        if self._rule.needs_lr:
            self._check_optimizers_have_lr()
        params = [p for p in module.parameters() if p.requires_grad]
        self._param_averager = TensorAverager(
            params,
            codec=self._codec,
            bucket_numel=self._bucket_numel,
            seed=self.seed,
            tag="param_average",
            delta=self.quantize_delta,
        )
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        self._buffer_averager = (
            TensorAverager(buffers, None, bucket_numel=self._bucket_numel, tag="buffers")
            if self.average_buffers and buffers
            else None
        )
        self._checked_layouts = set()
        self._schedule = SyncSchedule(self._rule)
        self._num_averages = 0
        self._num_forced_syncs = 0
        self._dirty = False
        if self._loaded_state is not None:
            self._schedule.load_state_dict(self._loaded_state["schedule"])
            self._num_averages = int(self._loaded_state.get("num_averages", 0))
            self._num_forced_syncs = int(self._loaded_state.get("num_forced_syncs", 0))
            self._loaded_state = None

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._schedule.total_steps = trainer.estimated_stepping_batches

    def _check_optimizers_have_lr(self) -> None:
        if not self.optimizers:
            raise ValueError(f"sync={self.sync!r} reads the learning rate of the optimizer, but there is no optimizer")
        for i, opt in enumerate(self.optimizers):
            for j, group in enumerate(opt.param_groups):
                lr = group.get("lr")
                try:
                    float(lr)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"sync={self.sync!r} sets H from the learning rate, but optimizer {i} "
                        f"({type(opt).__name__}) param_groups[{j}] has lr={lr!r}; it needs a numeric 'lr' "
                        f"(or use sync='constant')"
                    ) from None

    def _current_lr(self) -> float:
        """Maximum lr over all param groups of all optimizers (see module docstring)."""
        return max(float(g["lr"]) for opt in self.optimizers for g in opt.param_groups)

    # ------------------------------------------------------------------ the step

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run the optimizer step; close the round with an average when H steps are done."""
        if self._param_averager is None:  # not fitting (or not set up): plain step
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        sched = self._schedule
        if sched.h is None and self._rule.needs_lr:
            lr = self._current_lr()
            h = sched.begin_step(lr)
            if sched.step == 0 and isinstance(self._rule, QSRRule) and h > self._rule.h_base:
                rank_zero_warn(
                    f"LocalSGDStrategy(sync='qsr') starts with H={h} from lr={lr:g} at step 0 (warmup_steps="
                    f"{self._rule.warmup_steps}); if the lr schedule warms up from a small lr, set warmup_steps to "
                    f"its length so H stays at h_base={self._rule.h_base} meanwhile"
                )
        else:
            sched.begin_step(None)
        data_parallel = sched.round_data_parallel
        if data_parallel:
            closure = self._gradient_averaging_closure(optimizer, closure)
        # a local step's gradient is this rank's own: a bad one skips this rank's step only (the schedule still
        # counts it, so every rank syncs on the same steps); a data-parallel step's is the same everywhere
        self.nonfinite.scope = "on every rank" if data_parallel else "on this rank (a local step)"
        scaler = getattr(self.precision_plugin, "scaler", None)
        closure = self.nonfinite.wrap(closure, optimizer, sched.step, scaler=scaler)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if sched.end_step():
            if data_parallel:
                # Parameters are already identical (same averaged gradients): only buffers need averaging,
                # and the quantization anchor moves to the common parameters.
                self._average(params=False)
                self._param_averager.reset_anchor()
            else:
                self._average(params=True)
        else:
            self._dirty = True
        return out

    def _gradient_averaging_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

        def closure_with_grad_all_reduce() -> Any:
            out = closure()
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                averager = TensorAverager(grads, None, bucket_numel=self._bucket_numel, tag="grads")
                averager.average(self._num_averages, check=self._first_use("grads"))
            return out

        return closure_with_grad_all_reduce

    # ------------------------------------------------------------------ averaging

    def _optimizer_state_tensors(self) -> list[torch.Tensor]:
        out = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    for key in sorted(state):
                        v = state[key]
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1:
                            out.append(v)
        return out

    def _average(self, params: bool = True) -> None:
        """Average parameters (``params``), floating buffers and optionally optimizer state over ranks."""
        assert self._param_averager is not None
        if params:
            self._param_averager.average(self._num_averages)
        if self._buffer_averager is not None:
            self._buffer_averager.average(self._num_averages)
        if params and self.average_optimizer_state:
            # Rebuilt every time: optimizer.load_state_dict replaces the state tensors.
            states = self._optimizer_state_tensors()
            if states:
                averager = TensorAverager(states, None, bucket_numel=self._bucket_numel, tag="param_average")
                averager.average(self._num_averages, check=self._first_use("optimizer_state"))
        self._num_averages += 1
        self._dirty = False

    def _first_use(self, kind: str) -> bool:
        first = kind not in self._checked_layouts
        self._checked_layouts.add(kind)
        return first

    def _sync_if_dirty(self) -> None:
        if self._param_averager is None or not self._dirty:
            return
        self._average(params=True)
        self._num_forced_syncs += 1

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._sync_if_dirty()

    def on_train_end(self) -> None:
        self._sync_if_dirty()
        super().on_train_end()

    # ------------------------------------------------------------------ checkpointing

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Called on every rank first thing in ``dump_checkpoint``: average, then hand out the state."""
        self._gathered_optimizer_states = []
        self._sync_if_dirty()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state; rank 0 additionally collects every rank's (they differ)."""
        state = super().optimizer_state(optimizer)
        if (
            self._param_averager is not None
            and self.save_rank_optimizer_states
            and not self.average_optimizer_state
            and self.world_size > 1
            and dist.is_available()
            and dist.is_initialized()
        ):
            gathered: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
            dist.gather_object(state, gathered, dst=0)
            self._gathered_optimizer_states.append(gathered)
        return state

    def local_sgd_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "sync": self.sync,
            "schedule": self._schedule.state_dict(),
            "num_averages": self._num_averages,
            "num_forced_syncs": self._num_forced_syncs,
            "world_size": self.world_size,
        }
        if self._gathered_optimizer_states and all(g is not None for g in self._gathered_optimizer_states):
            state["optimizer_states_per_rank"] = self._gathered_optimizer_states
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._param_averager is not None:
            checkpoint[CHECKPOINT_KEY] = self.local_sgd_state_dict()
        self._gathered_optimizer_states = []
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            return checkpoint
        if state.get("sync") != self.sync:
            log.warning(
                "checkpoint was written with sync=%r, resuming with sync=%r: the schedule counters are reused",
                state.get("sync"),
                self.sync,
            )
        self._loaded_state = state
        per_rank = state.get("optimizer_states_per_rank")
        if per_rank and "optimizer_states" in checkpoint:
            if int(state.get("world_size", -1)) == self.world_size:
                checkpoint["optimizer_states"] = [ranks[self.global_rank] for ranks in per_rank]
            else:
                log.warning(
                    "checkpoint holds optimizer states of %s ranks, this run has %s: every rank loads rank 0's",
                    state.get("world_size"),
                    self.world_size,
                )
        return checkpoint


def register_local_sgd_strategies(registry: Any) -> None:
    """Register the lowercase names "local_sgd" and "local_sgd_qsr" in a Lightning ``StrategyRegistry``.

    Safe to call more than once (names already registered are skipped).
    """
    LocalSGDStrategy.register_strategies(registry)
