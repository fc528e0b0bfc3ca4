"""``onebit_adam_ddp``: 1-bit Adam on a ``DistributedDataParallel`` model, no Lightning needed (entry-point layer;
docs/design.md, "1-bit Adam").

``OneBitAdam`` is a plain torch optimizer; in data-parallel training it needs three things around it:

1. the momentum all-reduce on DDP's process group (``OneBitAdam.set_process_group``);
2. during the warm-up the averaged gradient: ``adapters.onebit.sync.onebit_adam_grad_hook`` on a DDP model
   without a comm hook (an fp32 average in the ``CommLedger``); a model with one keeps it;
3. once the variance is frozen, no gradient all-reduce: DDP's gradient sync is switched off before the next
   forward (``OneBitAdamDDP.switch_if_frozen``, run from the optimizer's step post-hook).

``hierarchical=True``: exact inside a node, 1-bit across nodes. The optimizer's ``state_dict`` is the same on every
rank; its 1-bit error buffers are not (``rank_state_dict`` per rank). ``OneBitAdamCallback`` (Trainer) calls the
same object; under Fabric pass what ``fabric.setup`` returned.

Example::

    ddp = DistributedDataParallel(model)
    optimizer = OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=100)
    onebit_adam_ddp(ddp, optimizer)          # AdamW for 100 steps, then 1-bit momentum only
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_qcomm.adapters.onebit.sync import OneBitGradHookState, onebit_adam_grad_hook
from lightning_qcomm.comm.topology import NodeGroups, hierarchical_topology, node_groups
from lightning_qcomm.optim.onebit_adam import OneBitAdam
from lightning_qcomm.parallel.step_hooks import attach_step_hooks

log = logging.getLogger(__name__)


def _unwrap_ddp(model: nn.Module) -> nn.Module:
    """The DDP module behind Fabric's wrapper (``_forward_module``), or ``model`` itself."""
    return getattr(model, "_forward_module", model)


class OneBitAdamDDP:
    """Ties a ``OneBitAdam`` to a DDP model (see the module docstring).

    Args:
        ddp: the ``DistributedDataParallel`` model (a Fabric-wrapped one is unwrapped).
        optimizer: the ``OneBitAdam`` training it (a Lightning / Fabric wrapper is unwrapped).
        register_hooks: switch from the optimizer's step post-hook (the callback calls ``switch_if_frozen``).
        node_groups: average the momentum hierarchically over these groups (``comm.topology.node_groups``, over
            the default group, which must be DDP's); None: flat over DDP's process group.

    Example::

        onebit = OneBitAdamDDP(ddp_model, optimizer, register_hooks=False)   # the caller switches
        loss.backward(); optimizer.step()
        onebit.switch_if_frozen()     # after the freeze: DDP's gradient all-reduce off, momentum 1-bit
    """

    def __init__(
        self, ddp: nn.Module, optimizer: OneBitAdam, register_hooks: bool = True, node_groups: NodeGroups | None = None
    ) -> None:
        ddp = _unwrap_ddp(ddp)
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"onebit_adam_ddp(ddp={type(ddp).__name__}) must be a DistributedDataParallel model")
        if not isinstance(optimizer, OneBitAdam):
            raise TypeError(f"onebit_adam_ddp(optimizer={type(optimizer).__name__}) must be a OneBitAdam")
        self.ddp = ddp
        self.optimizer = optimizer
        self.switched = False
        self.node_groups = node_groups
        if node_groups is not None and dist.get_world_size(ddp.process_group) != node_groups.topology.world_size:
            raise ValueError(
                f"onebit_adam_ddp(hierarchical=True): DDP's process group has {dist.get_world_size(ddp.process_group)} "
                f"ranks, the node layout {node_groups.topology.world_size}; allowed: DDP over the whole world"
            )
        optimizer.set_process_group(ddp.process_group if node_groups is None else node_groups)
        self.existing_hook = ddp._get_ddp_logging_data().get("comm_hook") or None
        if self.existing_hook:
            self.hook_state = None  # warm-up gradients go through the model's own hook
        else:
            self.hook_state = OneBitGradHookState(ddp.process_group)
            ddp.register_comm_hook(self.hook_state, onebit_adam_grad_hook)
        self._hooks = attach_step_hooks(optimizer, after=lambda o: self.switch_if_frozen()) if register_hooks else []

    def switch_if_frozen(self) -> bool:
        """Once the variance is frozen: stop the gradient all-reduce (before the next forward). Returns whether
        it switched now."""
        if self.switched or not self.optimizer.frozen:
            return False
        self.switched = True
        if self.hook_state is not None:
            self.hook_state.compressing = True
        self.ddp.require_backward_grad_sync = False
        rank_zero_info(
            f"1-bit Adam: variance frozen after {self.optimizer.frozen_at} optimizer steps; gradient all-reduce "
            "off, momentum all-reduced in 1 bit"
        )
        return True

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def onebit_adam_ddp(
    ddp: nn.Module,
    optimizer: OneBitAdam,
    hierarchical: bool = False,
    node_size: int | None = None,
    timeout: timedelta | None = None,
) -> OneBitAdamDDP:
    """Prepare ``ddp`` for ``optimizer`` and switch its gradient all-reduce off once the variance freezes.

    ``hierarchical``: the compressed momentum average only across nodes (module doc); ``node_size`` ranks per
    node (None: ``LOCAL_WORLD_SIZE``); the groups are made here, collectively, with ``timeout`` (None: the
    default group's).

    Example::

        onebit = onebit_adam_ddp(ddp_model, OneBitAdam(ddp_model.parameters(), freeze_step=100))
    """
    groups = None
    if hierarchical:
        topo = hierarchical_topology("onebit_adam_ddp", dist.get_world_size(), node_size)
        groups = None if topo is None else node_groups(topo, timeout=timeout)
    elif node_size is not None:
        rank_zero_warn(f"onebit_adam_ddp(node_size={node_size}, hierarchical=False): node_size has no effect")
    return OneBitAdamDDP(ddp, optimizer, node_groups=groups)


__all__ = ["OneBitAdamDDP", "onebit_adam_ddp"]
