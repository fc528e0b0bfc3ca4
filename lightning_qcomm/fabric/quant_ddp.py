"""QuantDDPFabricStrategy: DDP with the quantized gradient all-reduce under Lightning Fabric (Lightning layer).

Fabric's ``DDPStrategy`` whose ``setup_module`` registers ``parallel.quant_ddp_hook`` on the
``DistributedDataParallel`` it makes, on every device type (CPU/gloo too); every ``optimizer.step()``
through Fabric applies the non-finite policy, then advances the hook's step counter. ``fabric.save`` has every
rank write its hook state (step counter, error-feedback residuals, DDP's bucket layout) to its own side file
(``parallel.rank_files``; the checkpoint keeps ``state["quant_ddp"] = {"world_size": N, "step": step}``), and
``fabric.load`` gives each rank its own back (``parallel.quant_ddp.select_rank_state``), so a resumed run
continues bit for bit.

``hierarchical=True`` (docs/design.md, "Topology"): exact inside a node, compressed across nodes; ranks per node
are Fabric's devices per node unless ``node_size`` is given; the groups are made at the first ``setup_module``
and kept; one node runs flat (warned once); on another topology a resume resets the residuals (warned once).

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=QuantDDPFabricStrategy(codec="nuqsgd", bits=4))
    fabric.launch()                                     # or strategy="quant_ddp_nuqsgd4"
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig, warn_if_not_contractive
from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.topology import NodeGroups, Topology, node_groups
from lightning_qcomm.fabric._base import QCommFabricStrategy, check_fabric_ddp_kwargs, check_one_module, config_from
from lightning_qcomm.parallel.quant_ddp import (
    checkpoint_entries,
    config_fingerprint,
    quant_ddp_hook,
    resolve_hierarchy,
    select_rank_state,
    topology_entry,
)
from lightning_qcomm.strategies.presets import QUANT_DDP_PRESETS
from lightning_qcomm.strategies.quant_ddp import check_no_comm_hook_kwargs


class QuantDDPFabricStrategy(QCommFabricStrategy, DDPStrategy):
    """Fabric strategy: DDP whose gradient all-reduce is quantized (QSGD, QSGDinf, NUQSGD, uniform int-b, FP8).

    Args:
        config: a ``adapters.ddp.config.QuantDDPConfig``; or, instead, its fields as keyword arguments
            (``codec="nuqsgd", bits=4``, the arguments of ``QuantDDPStrategy``, the Trainer's class).
        kwargs: the other keyword arguments go to Fabric's ``DDPStrategy`` (``start_method``, ``timeout``, ...)
            and from there to ``DistributedDataParallel`` (``find_unused_parameters``, ``bucket_cap_mb``, ...).

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=QuantDDPFabricStrategy(codec="uniform", bits=8))
    """

    checkpoint_key = "quant_ddp"
    presets = QUANT_DDP_PRESETS

    def __init__(self, config: QuantDDPConfig | None = None, **kwargs: Any) -> None:
        owner = type(self).__name__
        self.config, kwargs = config_from(owner, QuantDDPConfig, config, kwargs)
        check_no_comm_hook_kwargs(owner, kwargs)
        check_fabric_ddp_kwargs(owner, kwargs)
        warn_if_not_contractive(self.config, owner)
        super().__init__(**kwargs)
        self.nonfinite = NonFiniteGuard(self.config.nonfinite, owner)  # averaged gradients: the same everywhere
        self.hook_state: QuantDDPHookState | None = None  # set by setup_module
        self._module: nn.Module | None = None  # the one model set up (check_one_module)
        self._pending_state: dict | None = None
        self._background = BackgroundComm("lightning_qcomm-quant_ddp", timeout=self._timeout)
        self._topology: Topology | None = None
        self._node_groups: NodeGroups | None = None  # made at the first setup_module (collective), then kept

    @override
    def config_fingerprint(self) -> dict[str, Any]:
        return config_fingerprint(self.config, self._ddp_kwargs)

    @override
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        check_one_module(type(self).__name__, self._module, module)  # one hook state, stepped by every optimizer
        self._module = module
        ddp = super().setup_module(module)
        owner = type(self).__name__
        config, self._topology = resolve_hierarchy(self.config, owner, self.world_size, self.num_processes)
        if self._topology is not None and (self._node_groups is None or self._node_groups.topology != self._topology):
            self._node_groups = node_groups(self._topology, timeout=self._timeout, device_type=self.root_device.type)
        state, hook = quant_ddp_hook(
            config,
            module,
            process_group=ddp.process_group,
            background=self._background,
            loss_scale=self._gradient_loss_scale,
            owner=owner,
            node_groups=self._node_groups if self._topology is not None else None,
        )
        if self._pending_state is not None:
            state.load_state_dict(self._pending_state)
            self._pending_state = None
        self.hook_state = state
        ddp.register_comm_hook(state, hook)
        return ddp

    def _gradient_loss_scale(self) -> torch.Tensor | None:
        """The scale of the gradients in DDP's buckets: the fp16 GradScaler's, or None without one."""
        scaler = getattr(self.precision, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        step = 0 if self.hook_state is None else self.hook_state.step
        if getattr(self.precision, "scaler", None) is None:  # a GradScaler skips non-finite steps itself
            self.nonfinite.apply(optimizer, step)
        out = super().optimizer_step(optimizer, **kwargs)
        if self.hook_state is not None:
            self.hook_state.next_step()
        return out

    @override
    def checkpoint_entry(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None, Any]:
        local = self.hook_state.state_dict() if self.hook_state is not None else self._pending_state
        return (None, None) if local is None else checkpoint_entries(local, self.world_size)

    @override
    def restore_entry(self, entry: dict[str, Any] | None, state: dict[str, Any], own: Any = None) -> None:
        mine = select_rank_state(
            entry,
            self.world_size,
            self.global_rank,
            global_step=0,
            owner=type(self).__name__,
            own=own,
            topology=topology_entry(self._topology),
        )
        if self.hook_state is not None:
            self.hook_state.load_state_dict(mine)
        else:
            self._pending_state = mine


__all__ = ["QuantDDPFabricStrategy"]
