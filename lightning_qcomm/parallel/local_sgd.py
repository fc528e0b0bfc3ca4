"""``LocalSGD``: Local SGD / Local AdamW on a plain torch model, no Lightning needed (entry-point layer;
docs/design.md, "Local SGD and QSR").

Each rank trains its own replica (no DDP, no per-step gradient all-reduce) and the replicas are averaged every H
optimizer steps, H from a rule of ``parallel.sync_rules``, through ``collectives.averaging.TensorAverager``. Per
step: ``begin_step()`` (opens a round, H from the largest lr, capped so training ends on a sync),
``prepare_gradients(optimizer)`` (the data-parallel average of post_local's early steps, then the non-finite
policy), the optimizer step, ``end_step()`` (counts; averages after H steps). Given an optimizer these run from
its step hooks. ``sync()`` averages replicas that moved (before evaluating or saving). ``scope="inter_node"``,
``outer_optimizer="nesterov"`` (DiLoCo) and ``overlap=True`` (``parallel.local_sgd_overlap``): docs/design.md,
"Local SGD across nodes" and "Module notes". ``LocalSGDStrategy`` and ``LocalSGDFabricStrategy`` drive this object.

Example::

    local_sgd = LocalSGD(model, optimizer, LocalSGDConfig(sync="constant", period=8), total_steps=1000)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        optimizer.step()           # every 8th step also averages the replicas
        optimizer.zero_grad()
    local_sgd.sync()               # average before evaluating / saving
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_qcomm.collectives.averaging import TensorAverager
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.topology import NodeGroups, node_groups
from lightning_qcomm.parallel.local_sgd_config import LocalSGDConfig, inter_node_topology
from lightning_qcomm.parallel.local_sgd_overlap import AveragingLane, OverlappedAverage
from lightning_qcomm.parallel.outer_optim import build_outer_optimizer
from lightning_qcomm.parallel.step_hooks import attach_step_hooks
from lightning_qcomm.parallel.sync_rules import QSRRule, SyncSchedule, check_optimizers_have_lr, tell_qsr_period

log = logging.getLogger(__name__)


def broadcast_module_states(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Parameters and buffers of ``module`` from rank 0 to every rank (a no-op without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.utils import _sync_module_states

    group = dist.distributed_c10d._get_default_group() if group is None else group
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))  # what DDP would not broadcast either
    _sync_module_states(module, group, 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=ignore)


class LocalSGD:
    """Local SGD averager of one model (see the module docstring).

    Args:
        model: the replica of this rank.
        optimizer: one optimizer or several (each ``step()`` counts as an optimizer step); None when the caller
            drives ``begin_step`` / ``prepare_gradients`` / ``end_step`` itself (the strategies do).
        config: ``LocalSGDConfig``.
        total_steps: training length in optimizer steps (the last round is cut to end on it); None: no cap.
        process_group: the ranks that average (None: the world).
        register_hooks: run the per-step work from the optimizers' step hooks.
        broadcast: broadcast parameters and buffers from rank 0 now.
        nonfinite: the non-finite policy's guard (a strategy keeps one, and its count, across fits); default a
            new one for ``config.nonfinite``.
        owner: the name warnings and logs use.
        node_groups: ``scope="inter_node"``'s groups (a strategy makes them once); default: made here (collective)
            from ``config.node_size`` / ``devices_per_node`` / ``LOCAL_WORLD_SIZE``.
        devices_per_node: the launcher's ranks per node, for ``scope="inter_node"`` without ``node_size``.
        lane: ``overlap=True``'s worker and groups (a strategy makes them once); default: made here (collective).

    Example::

        local_sgd = LocalSGD(model, optimizer, LocalSGDConfig(sync="qsr", h_base=4), total_steps=1000)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()        # syncs the replicas whenever the rule says so
            optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer | Sequence[Optimizer] | None,
        config: LocalSGDConfig | None = None,
        *,
        total_steps: int | float | None = None,
        process_group: dist.ProcessGroup | None = None,
        register_hooks: bool = True,
        broadcast: bool = True,
        nonfinite: NonFiniteGuard | None = None,
        owner: str = "LocalSGD",
        node_groups: NodeGroups | None = None,
        devices_per_node: int | None = None,
        lane: AveragingLane | None = None,
    ) -> None:
        config = LocalSGDConfig() if config is None else config
        if not isinstance(config, LocalSGDConfig):
            raise TypeError(f"{owner}(config={config!r}) must be a LocalSGDConfig")
        self.config = config
        self.owner = owner
        self.rule = config.build_rule()
        optimizers = [] if optimizer is None else [optimizer] if isinstance(optimizer, Optimizer) else list(optimizer)
        self.optimizers = [getattr(opt, "optimizer", opt) for opt in optimizers]
        if self.rule.needs_lr and optimizer is not None:
            check_optimizers_have_lr(self.optimizers, config.sync)
        if broadcast:
            broadcast_module_states(model, process_group)
        self.group = process_group
        self.node_groups = (
            self._resolve_node_groups(node_groups, devices_per_node) if config.scope != "global" else None
        )
        self._own_lane = config.overlap and lane is None
        self.lane = (AveragingLane(self.group, self.node_groups) if lane is None else lane) if config.overlap else None
        params = [p for p in model.parameters() if p.requires_grad]
        self.param_averager = self._averager(
            params, "param_average", config.build_codec(), seed=config.seed, lane=self.lane
        )
        self.overlap = None if self.lane is None else OverlappedAverage(self.param_averager, self.lane.worker)
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.buffer_averager = self._averager(buffers, "buffers") if config.average_buffers and buffers else None
        self.outer = build_outer_optimizer(config.outer_optimizer, params, config.outer_lr, config.outer_momentum)
        self.schedule = SyncSchedule(self.rule, total_steps=total_steps)
        self._qsr_told = False  # the QSR period at the first lr it reads was said (sync_rules.tell_qsr_period)
        self.nonfinite = NonFiniteGuard(config.nonfinite, owner) if nonfinite is None else nonfinite
        self.num_averages = 0  # every average (scheduled or forced): seeds of quantized rounds
        self.num_forced_syncs = 0
        self.dirty = False  # replicas moved since the last average
        self._checked_layouts: set[str] = set()  # averagers rebuilt per use: check their layout once
        self._hooks = []
        if register_hooks:
            for opt in self.optimizers:
                self._hooks += attach_step_hooks(opt, before=self._before_hook, after=lambda o: self.end_step())

    def _resolve_node_groups(self, groups: NodeGroups | None, devices_per_node: int | None) -> NodeGroups | None:
        if self.group is not None:
            raise ValueError(f"{self.owner}(scope='inter_node') averages over the world: process_group must be None")
        if groups is not None:
            return groups
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{self.owner}(scope='inter_node') needs an initialised torch.distributed")
        topo = inter_node_topology(self.owner, dist.get_world_size(), self.config.node_size, devices_per_node)
        return None if topo is None else node_groups(topo)

    def _averager(
        self,
        tensors: list[torch.Tensor],
        tag: str,
        codec: Any = None,
        seed: int = 0,
        intra: bool = False,
        lane: AveragingLane | None = None,
    ) -> TensorAverager:
        """Over the world (hierarchically across nodes, or over ``process_group``), or over the node (``intra``);
        over ``lane``'s groups when given."""
        numel, delta = self.config.bucket_numel, self.config.quantize_delta
        group, groups = (self.group, self.node_groups) if lane is None else (lane.group, lane.node_groups)
        if groups is None:
            return TensorAverager(tensors, codec, group=group, bucket_numel=numel, seed=seed, tag=tag, delta=delta)
        if intra:
            return TensorAverager(tensors, None, group=groups.intra, bucket_numel=numel, tag=f"{tag}@intra")
        return TensorAverager(tensors, codec, node_groups=groups, bucket_numel=numel, seed=seed, tag=tag, delta=delta)

    @property
    def topology(self) -> tuple[int, int] | None:
        """(nodes, ranks per node) of ``scope="inter_node"``; None for the global form."""
        return (
            None
            if self.node_groups is None
            else (self.node_groups.topology.num_nodes, self.node_groups.topology.node_size)
        )

    # ------------------------------------------------------------------ read-only state
    @property
    def sync_period(self) -> int | None:
        """H of the current round (None between a sync and the next optimizer step)."""
        return self.schedule.h

    @property
    def num_syncs(self) -> int:
        """Scheduled synchronizations so far (data-parallel steps of post_local included)."""
        return self.schedule.num_syncs

    @property
    def last_sync_step(self) -> int:
        return self.schedule.last_sync_step

    # ------------------------------------------------------------------ the step
    def _current_lr(self) -> float:
        return max(float(g["lr"]) for opt in self.optimizers for g in opt.param_groups)

    def begin_step(self) -> bool:
        """Before an optimizer step: open a round if none is (H from the lr this step uses). Returns whether this
        step is data-parallel (its gradients must be averaged before the update)."""
        sched = self.schedule
        if sched.h is None and self.rule.needs_lr:
            lr = self._current_lr()
            sched.begin_step(lr)
            if isinstance(self.rule, QSRRule):
                self._qsr_told = tell_qsr_period(self.owner, self.rule, sched, lr, self._qsr_told)
        else:
            sched.begin_step(None)
        return sched.round_data_parallel

    def prepare_gradients(self, optimizer: Optimizer, check_finite: bool = True) -> bool:
        """After backward, before ``optimizer``'s step: average its gradients in a data-parallel step, then apply
        the non-finite policy (``check_finite=False``: not, e.g. under a GradScaler, which skips such steps
        itself). False when the step was skipped (its gradients set to None)."""
        data_parallel = self.schedule.round_data_parallel
        if data_parallel or self.node_groups is not None:
            opt = getattr(optimizer, "optimizer", optimizer)
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if grads:  # a local step across nodes: the node's mean (its ranks stay identical)
                averager = self._averager(grads, "grads", intra=not data_parallel)
                averager.average(self.num_averages, check=self._first_use("grads" if data_parallel else "grads@intra"))
        # a local step's gradient is this rank's (node's) own: a bad one skips this rank's (node's) step only (the
        # schedule still counts it, so every rank syncs on the same steps); a data-parallel step's is the same
        # everywhere
        local = "on this node's ranks (a local step)" if self.node_groups is not None else "on this rank (a local step)"
        self.nonfinite.scope = "on every rank" if data_parallel else local
        return self.nonfinite.apply(optimizer, self.schedule.step) if check_finite else True

    def end_step(self) -> bool:
        """After an optimizer step: count it; average when the round is complete. Returns whether it averaged."""
        data_parallel = self.schedule.round_data_parallel
        if not self.schedule.end_step():
            self.dirty = True
            return False
        if data_parallel:
            # the parameters are already identical (same averaged gradients): only buffers need averaging, and
            # the quantization anchor moves to the common parameters
            self._average(params=False)
            self.param_averager.reset_anchor()
            if self.outer is not None:
                self.outer.restart()  # no pseudo-gradient: the common parameters are the global ones
        elif not self._overlapped_round():
            self._average(params=True)
            if self.outer is not None:
                self.outer.step()  # DiLoCo: the parameters become the new global ones
                self.param_averager.reset_anchor()
        return True

    def _overlapped_round(self) -> bool:
        """``overlap=True``: apply the previous round's average, start this round's in the background and average
        buffers (and optimizer state) inline. False when this sync must be exact: no overlap, or the last one."""
        if self.overlap is None:
            return False
        self.overlap.finish(self.outer)
        total = self.schedule.total_steps
        if total is not None and self.schedule.step >= total:
            return False
        self.overlap.launch(self.num_averages)
        self._average(params=False, states=True)
        self.dirty = True  # the replicas differ by the round in flight
        return True

    def _before_hook(self, optimizer: Optimizer) -> None:
        self.begin_step()
        self.prepare_gradients(optimizer)

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

    def _average(self, params: bool = True, states: bool | None = None) -> None:
        """Average parameters (``params``), floating buffers and optionally optimizer state (``states``, default
        with the parameters) over ranks."""
        if params:
            self.param_averager.average(self.num_averages)
        if self.buffer_averager is not None:
            self.buffer_averager.average(self.num_averages)
        if (params if states is None else states) and self.config.average_optimizer_state:
            states = self._optimizer_state_tensors()  # rebuilt every time: load_state_dict replaces the tensors
            if states:
                averager = self._averager(states, "param_average")
                averager.average(self.num_averages, check=self._first_use("optimizer_state"))
        self.num_averages += 1
        self.dirty = False

    def _first_use(self, kind: str) -> bool:
        first = kind not in self._checked_layouts
        self._checked_layouts.add(kind)
        return first

    def sync(self) -> bool:
        """Average the replicas now if they moved since the last average (outside the schedule, which it does
        not change; counted in ``num_forced_syncs``); with ``overlap=True`` the average in flight is applied first.
        Collective. Returns whether it averaged."""
        if self.overlap is not None:
            self.overlap.finish(self.outer)
        if not self.dirty:
            return False
        self._average(params=True)
        self.num_forced_syncs += 1
        return True

    # ------------------------------------------------------------------ state
    def optimizer_states_differ(self, world_size: int) -> bool:
        """Whether each rank's optimizer state is its own, and checkpoints should keep every rank's
        (``save_rank_optimizer_states``, unless optimizer states are averaged)."""
        return (
            self.config.save_rank_optimizer_states
            and not self.config.average_optimizer_state
            and world_size > 1
            and dist.is_available()
            and dist.is_initialized()
        )

    def state_dict(self) -> dict[str, Any]:
        """The schedule and counters, and DiLoCo's outer state (all the same on every rank); optimizer states are
        the optimizers' own. With ``overlap=True`` call ``sync()`` first (RuntimeError while an average is in flight)."""
        if self.overlap is not None and self.overlap.pending:
            raise RuntimeError(f"{self.owner}.state_dict(): an average is in flight (overlap=True); call sync() first")
        state = {
            "sync": self.config.sync,
            "schedule": self.schedule.state_dict(),
            "num_averages": self.num_averages,
            "num_forced_syncs": self.num_forced_syncs,
        }
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; call after the model's weights are loaded (they become the common anchor of
        quantized averaging)."""
        self.schedule.load_state_dict(state["schedule"])
        self.num_averages = int(state.get("num_averages", 0))
        self.num_forced_syncs = int(state.get("num_forced_syncs", 0))
        self.dirty = False
        if self.overlap is not None:
            self.overlap.discard()  # the loaded weights replace what it averaged
        self.param_averager.reset_anchor()
        if self.outer is not None:
            if state.get("outer") is not None:
                self.outer.load_state_dict(state["outer"])
            else:
                self.outer.restart()
                log.warning(
                    "%s(outer_optimizer='nesterov'): the checkpoint has no outer state; the global parameters "
                    "restart from the loaded weights, the outer momentum from zero",
                    self.owner,
                )

    def close(self) -> None:
        """Remove the optimizer step hooks; with ``overlap=True`` wait for the average in flight (not applied: call
        ``sync()`` before to keep it) and stop this object's own worker."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.overlap is not None:
            self.overlap.discard()
        if self._own_lane and self.lane is not None:
            self.lane.close()


__all__ = [
    "LocalSGD",
    "broadcast_module_states",
]
