"""LocalSGDFabricStrategy: Local SGD / QSR under Lightning Fabric (Lightning layer; docs/design.md, "Local SGD").

Fabric's ``DDPStrategy`` without the ``DistributedDataParallel`` wrapper (as ``LocalSGDStrategy``):
``fabric.setup`` broadcasts the parameters and buffers from rank 0 and makes a ``parallel.LocalSGD`` for
the model and its optimizers; every ``optimizer.step()`` through Fabric opens a round if needed (H from the
lr the step uses), averages the gradients in a data-parallel step (post_local before ``switch_step``),
applies the non-finite policy, steps, and averages the replicas when the round is complete.

``fabric.save`` first averages replicas that moved since the last average (so what is saved is the averaged
model), then stores the schedule in ``state["local_sgd"]``, and every rank writes its own optimizer state (they
differ between syncs; unless ``average_optimizer_state``) to its side file (``parallel.rank_files``);
``fabric.load`` gives each rank its own optimizer state back, so a run resumed mid-round continues as the
uninterrupted one. Call
``strategy.local_sgd.sync()`` before evaluating the model between syncs. ``total_steps`` caps the last round
so training ends on a sync (the Trainer reads it from ``estimated_stepping_batches``). Gradient
accumulation needs no ``fabric.no_backward_sync``: nothing is synchronised during backward. ``scope="inter_node"``
(``Fabric(num_nodes=..., devices=...)``; ranks per node from ``devices`` or ``node_size``): the node groups are
made once at the first ``setup_module`` with the strategy's timeout (docs/design.md, "Local SGD across nodes").

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=LocalSGDFabricStrategy(sync="constant", period=8))
    fabric.launch()                                     # or strategy="local_sgd" / "local_sgd_qsr"
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import check_int
from lightning_qcomm.comm.topology import NodeGroups, node_groups
from lightning_qcomm.fabric._base import QCommFabricStrategy, check_fabric_ddp_kwargs, check_one_module, config_from
from lightning_qcomm.parallel.local_sgd import LocalSGD, broadcast_module_states
from lightning_qcomm.parallel.local_sgd_config import LocalSGDConfig, config_fingerprint, inter_node_topology
from lightning_qcomm.parallel.local_sgd_overlap import AveragingLane
from lightning_qcomm.parallel.rank_files import this_rank_entries
from lightning_qcomm.strategies.presets import LOCAL_SGD_PRESETS


class _NothingToSync(_BackwardSyncControl):
    """``fabric.no_backward_sync`` is a no-op: Local SGD synchronises nothing during backward."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class LocalSGDFabricStrategy(QCommFabricStrategy, DDPStrategy):
    """Fabric strategy: Local SGD with a constant, post-local or QSR synchronization period.

    Args:
        config: a ``parallel.LocalSGDConfig``; or, instead, its fields as keyword arguments (``sync="qsr"``,
            the arguments of ``LocalSGDStrategy``, the Trainer's class).
        total_steps: training length in optimizer steps: the last round is cut to end on it (None: no cap).
        kwargs: the other keyword arguments go to Fabric's ``DDPStrategy`` (``start_method``, ``timeout``, ...).

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=LocalSGDFabricStrategy(sync="constant", period=8))
    """

    checkpoint_key = "local_sgd"
    presets = LOCAL_SGD_PRESETS

    def __init__(self, config: LocalSGDConfig | None = None, total_steps: int | None = None, **kwargs: Any) -> None:
        owner = type(self).__name__
        self.config, kwargs = config_from(owner, LocalSGDConfig, config, kwargs)
        self.total_steps = check_int(owner, "total_steps", total_steps, minimum=1, optional=True)
        check_fabric_ddp_kwargs(owner, kwargs)
        super().__init__(**kwargs)
        self._backward_sync_control = _NothingToSync()
        self.local_sgd: LocalSGD | None = None  # made by setup_module, again by each setup_optimizer
        self._module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        self._node_groups: NodeGroups | None = None  # scope="inter_node": made once (collective), at setup_module
        self._run_config = self.config  # the global form when there is no node level
        self._lane: AveragingLane | None = None  # overlap=True: its worker and groups, made once at setup_module

    @override
    def config_fingerprint(self) -> dict[str, Any]:
        node_size = self.config.node_size or self.num_processes  # checked against the world at setup_module
        return config_fingerprint(self.config, node_size if self.config.scope == "inter_node" else None)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """No DDP wrapper: every rank starts from rank 0's parameters and buffers."""
        check_one_module(type(self).__name__, self._module, module)  # one LocalSGD averages one model
        broadcast_module_states(module)
        self._module = module
        if self.config.scope == "inter_node" and self._node_groups is None:
            topo = inter_node_topology(type(self).__name__, self.world_size, self.config.node_size, self.num_processes)
            if topo is None:
                self._run_config = dataclasses.replace(self.config, scope="global", node_size=None)
            else:
                self._node_groups = node_groups(topo, timeout=self._timeout, device_type=self.root_device.type)
        if self.config.overlap and self._lane is None:
            self._lane = AveragingLane(None, self._node_groups)
        self._make_local_sgd()
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        self._make_local_sgd()  # the lr (QSR) and the optimizer state (average_optimizer_state) are read from them
        return optimizer

    def _make_local_sgd(self) -> None:
        if self._module is not None:
            self.local_sgd = LocalSGD(
                self._module,
                self._optimizers or None,
                self._run_config,
                total_steps=self.total_steps,
                register_hooks=False,  # driven from optimizer_step
                broadcast=False,
                owner=type(self).__name__,
                node_groups=self._node_groups,
                lane=self._lane,
            )

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.local_sgd is None:
            return super().optimizer_step(optimizer, **kwargs)
        self.local_sgd.begin_step()
        self.local_sgd.prepare_gradients(optimizer, check_finite=getattr(self.precision, "scaler", None) is None)
        out = super().optimizer_step(optimizer, **kwargs)
        self.local_sgd.end_step()
        return out

    @override
    def checkpoint_entry(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None, Any]:
        if self.local_sgd is None:
            return None, None
        self.local_sgd.sync()  # what is saved is the averaged model
        entry: dict[str, Any] = {**self.local_sgd.state_dict(), "world_size": self.world_size}
        own = None
        if self.local_sgd.optimizer_states_differ(self.world_size):  # this rank's own, for its side file
            own = {"optimizer_states": {k: v.state_dict() for k, v in state.items() if isinstance(v, Optimizer)}}
        return entry, own

    @override
    def restore_entry(self, entry: dict[str, Any] | None, state: dict[str, Any], own: Any = None) -> None:
        if entry is None:
            return
        world = entry.get("world_size")
        per_rank = entry.get("optimizer_states_per_rank") or {}  # a checkpoint of an earlier version
        keys = [k for k in per_rank if isinstance(state.get(k), Optimizer)]
        if keys:
            mine = this_rank_entries([per_rank[k] for k in keys], world, self.world_size, self.global_rank)
            for key, optimizer_state in zip(keys, mine or []):
                state[key].load_state_dict(optimizer_state)  # this rank's own, over rank 0's that Fabric loaded
        elif own is not None:
            for key, optimizer_state in own["optimizer_states"].items():
                if isinstance(state.get(key), Optimizer):
                    state[key].load_state_dict(optimizer_state)
        elif world is not None and world != self.world_size:
            this_rank_entries([], world, self.world_size, self.global_rank)  # logs: every rank keeps rank 0's
        if self.local_sgd is not None:
            self.local_sgd.load_state_dict(entry)  # after the weights: they become the common anchor

    @override
    def teardown(self) -> None:
        # an average still in flight (no sync() after the last step, or an error) is left to its daemon thread
        in_flight = self.local_sgd is not None and self.local_sgd.overlap is not None and self.local_sgd.overlap.pending
        if self._lane is not None and not in_flight:
            self._lane.close()
        super().teardown()


__all__ = ["LocalSGDFabricStrategy"]
