"""``quant_ddp_hook``: the quantized gradient all-reduce as a DDP comm hook, no Lightning needed (entry-point layer;
docs/design.md, "QuantDDP").

It returns the ``(state, hook)`` pair DDP's ``register_comm_hook`` takes (a plain ``DistributedDataParallel``, or
Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, which registers hooks on CUDA only; hence
``QuantDDPStrategy``). The hook's seeds and warm-up read ``state.step``: pass ``optimizer=`` to advance it (and
apply the non-finite policy) from the optimizer's step hooks, else call ``state.next_step()`` after every step.
Per-rank checkpoints (``select_rank_state``): each rank's state goes to its side file (``parallel.rank_files``);
another world size or topology keeps the step and resets the residuals. ``QuantDDPConfig(hierarchical=True)``:
intra-/inter-node groups made here (collectively) unless ``node_groups`` is given; one node runs flat, warned
once. Details: docs/design.md, "Module notes".

Example::

    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state, hook = quant_ddp_hook(QuantDDPConfig(codec="uniform", bits=8), ddp, optimizer=optimizer)
    ddp.register_comm_hook(state, hook)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig, warn_if_not_contractive
from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState, quant_ddp_comm_hook
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.topology import NodeGroups, Topology, hierarchical_topology, node_groups
from lightning_qcomm.parallel.step_hooks import attach_step_hooks

log = logging.getLogger(__name__)


def trainable_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each trainable parameter of ``module`` (a DDP wrapper is looked through) and its name, in definition
    order: the hook's checkpoint keys and canonical order."""
    module = module.module if isinstance(module, DistributedDataParallel) else module
    return {p: n for n, p in module.named_parameters() if p.requires_grad}


def quant_ddp_hook(
    config: QuantDDPConfig,
    module: nn.Module,
    *,
    optimizer: Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    background: BackgroundComm | None = None,
    loss_scale: Callable[[], torch.Tensor | None] | None = None,
    owner: str = "quant_ddp_hook",
    node_groups: NodeGroups | None = None,
    devices_per_node: int | None = None,
) -> tuple[QuantDDPHookState, Callable]:
    """The ``(state, hook)`` pair for ``DistributedDataParallel.register_comm_hook`` (see the module docstring).

    Args:
        config: ``QuantDDPConfig``.
        module: the model DDP wraps, or the DDP module itself (its parameter names key the checkpointed state).
        optimizer: if given, its step hooks advance ``state.step`` and apply ``config.nonfinite``.
        process_group: DDP's process group (None: the default group).
        background: the background thread and group of overlapped CPU buckets, reused across calls (default:
            made here when ``config.overlap_comm``, the parameters are on CPU and there are several ranks).
            Making it is collective: every rank calls this function in the same order.
        loss_scale: returns the loss scale the gradients in DDP's buckets carry (a GradScaler's ``_scale``), or
            None; error-feedback residuals are kept unscaled.
        owner: the name warnings and logs use.
        node_groups: with ``config.hierarchical``, the intra-/inter-node groups to use (made here if None,
            collectively; see ``hierarchical_groups``).
        devices_per_node: the launcher's ranks per node, when ``config.node_size`` is None.

    Example::

        state, hook = quant_ddp_hook(QuantDDPConfig(codec="uniform", bits=8), ddp_model, optimizer=optimizer)
        ddp_model.register_comm_hook(state, hook)
    """
    if not isinstance(config, QuantDDPConfig):
        raise TypeError(f"{owner}(config={config!r}) must be a QuantDDPConfig")
    warn_if_not_contractive(config, owner)
    names = trainable_names(module)
    on_cpu = all(p.device.type == "cpu" for p in names)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    group, worker = process_group, None
    if config.overlap_comm and on_cpu and distributed:
        background = BackgroundComm("lightning_qcomm-quant_ddp") if background is None else background
        worker, group = background.acquire(process_group)
    if config.hierarchical and node_groups is None:
        config, node_groups = hierarchical_groups(config, owner, process_group, devices_per_node)
    if not config.hierarchical:
        node_groups = None
    state = QuantDDPHookState(
        config, names, process_group=group, worker=worker, loss_scale=loss_scale, node_groups=node_groups
    )
    if optimizer is not None:
        guard = NonFiniteGuard(config.nonfinite, owner)
        attach_step_hooks(
            optimizer, before=lambda opt: guard.apply(opt, state.step), after=lambda opt: state.next_step()
        )
    log.debug("%s: quant_ddp_comm_hook state for %d parameters with %s", owner, len(names), config)
    return state, quant_ddp_comm_hook


def resolve_hierarchy(
    config: QuantDDPConfig, owner: str, world_size: int, devices_per_node: int | None = None
) -> tuple[QuantDDPConfig, Topology | None]:
    """(the config the hook runs with, its topology): ``config`` itself and its topology when hierarchical; made
    flat (``hierarchical=False``) when there is no hierarchy (warned once by ``hierarchical_topology``).
    ValueError for a ``node_size`` that does not divide ``world_size``.

    Example::

        config, topo = resolve_hierarchy(QuantDDPConfig(hierarchical=True), "QuantDDPStrategy", 4, devices_per_node=2)
        topo.num_nodes, config.hierarchical        # 2, True
    """
    if not config.hierarchical:
        return config, None
    topo = hierarchical_topology(owner, world_size, config.node_size, devices_per_node)
    if topo is None:
        return dataclasses.replace(config, hierarchical=False, node_size=None), None
    return config, topo


def topology_entry(topology: Topology | None) -> list[int] | None:
    """``[num_nodes, node_size]`` as checkpoints record it; None when flat."""
    return None if topology is None else [topology.num_nodes, topology.node_size]


def hierarchical_groups(
    config: QuantDDPConfig,
    owner: str,
    process_group: dist.ProcessGroup | None = None,
    devices_per_node: int | None = None,
    timeout: Any = None,
) -> tuple[QuantDDPConfig, NodeGroups | None]:
    """(the config the hook runs with, the intra-/inter-node groups of ``config.hierarchical`` or None for the flat
    path); collective: every rank calls it."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    if distributed and process_group is not None and dist.get_world_size(process_group) != world:
        raise ValueError(
            f"{owner}(hierarchical=True): DDP's process group has {dist.get_world_size(process_group)} of the "
            f"{world} ranks; allowed: the whole world (the node layout is over the default group)"
        )
    config, topo = resolve_hierarchy(config, owner, world, devices_per_node)
    return config, None if topo is None else node_groups(topo, timeout=timeout)


def checkpoint_entries(state: dict, world_size: int) -> tuple[dict, dict]:
    """(what the checkpoint itself keeps, what this rank's side file keeps) of this rank's hook ``state``."""
    return {"world_size": world_size, "step": int(state["step"]), "topology": state.get("topology")}, state


def select_rank_state(
    saved: dict | None,
    world_size: int,
    rank: int,
    global_step: int,
    owner: str,
    own: dict | None = None,
    topology: list[int] | None = None,
) -> dict:
    """This rank's hook state from the checkpoint's entry ``{"world_size", "step", "topology"}`` and this rank's
    side-file entry ``own`` (or an older checkpoint's ``{"world_size", "per_rank"}``; see the module docstring).

    No entry (a checkpoint written without the hook): the step counter resumes from ``global_step`` and the
    residuals start at zero (warned). Another world size, or another hierarchical ``topology`` (``[num_nodes,
    node_size]``, None when flat): the step is kept, the residuals reset (warned once).
    """
    if saved is None:
        rank_zero_warn(
            f"{owner}: the checkpoint has no 'quant_ddp' entry (not written by QuantDDPStrategy); the step counter "
            f"resumes from global_step={global_step} and error-feedback residuals start at zero"
        )
        return {"step": int(global_step), "error_feedback": {}}
    per_rank = saved.get("per_rank")
    saved_topology = saved.get("topology")
    if saved["world_size"] == world_size and saved_topology == topology:
        return own if per_rank is None else per_rank[rank]
    if saved["world_size"] == world_size:
        rank_zero_warn(
            f"{owner}: the checkpoint's error-feedback residuals belong to the topology {_topology_name(saved_topology)}"
            f", now {_topology_name(topology)}; the step counter is restored, the residuals reset to 0"
        )
        mine = own if per_rank is None else per_rank[rank]
        return {"step": int(mine["step"]), "error_feedback": {}, "bucket_layout": mine.get("bucket_layout", [])}
    rank_zero_warn(
        f"{owner}: the checkpoint was written by {saved['world_size']} ranks, now {world_size}; the step counter is "
        "restored, error-feedback residuals reset to 0"
    )
    step = saved["step"] if per_rank is None else per_rank[0]["step"]
    return {"step": int(step), "error_feedback": {}}


def _topology_name(topology: list[int] | None) -> str:
    return "flat" if topology is None else f"{topology[0]} nodes x {topology[1]} ranks (hierarchical)"


def config_fingerprint(
    config: QuantDDPConfig, ddp_kwargs: dict[str, Any], node_size: int | None = None
) -> dict[str, Any]:
    """Everything that decides what the hook's collectives send (compared across ranks at setup); ``node_size``:
    the ranks per node this rank resolved for ``hierarchical``."""
    ddp = {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for k, v in ddp_kwargs.items()}
    return {**asdict(config), "ddp_kwargs": ddp, "resolved_node_size": node_size}


__all__ = [
    "checkpoint_entries",
    "config_fingerprint",
    "hierarchical_groups",
    "resolve_hierarchy",
    "topology_entry",
    "quant_ddp_hook",
    "select_rank_state",
    "trainable_names",
]
