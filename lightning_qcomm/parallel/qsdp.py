"""``apply_qsdp``: QSDP on a plain torch module, no Lightning needed (entry-point layer; docs/design.md, "QSDP").

In order (torchtitan's ``apply_fsdp`` shape): refuse what QSDP cannot shard (FSDP1 modules, no parameters);
``fully_shard`` the groups of ``parallel.sharding.plan_fsdp_groups`` on the 1-D data-parallel ``mesh`` unless the
module is sharded already (its grouping is kept); check every trainable parameter is in a group; install the
quantized all-gather / reduce-scatter of ``adapters.fsdp2.comms`` on every ``FSDPModule`` (on CPU with
``overlap_comm``, on a background thread, each group prefetching the next). It returns a ``QSDPHandle``: the groups
and the RNG step training must advance once per optimizer step (``attach(optimizer)`` does it). ``"auto"`` widths
are chosen by timed trial steps (``comm.auto_trial``), the trial kept in ``comm_state``. ``QSDPStrategy`` and
``QSDPFabricStrategy`` call this function; theirs is only the Lightning glue. The run state a checkpoint keeps:
``parallel.qsdp_state``.

Example::

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    qsdp = apply_qsdp(model, mesh, QSDPConfig(bits=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)   # after apply_qsdp: the parameters are DTensors
    qsdp.attach(optimizer)                                       # advances the RNG step after every optimizer.step()
    for x, y in batches:
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(qsdp.state_dict(), "qsdp_rank0.pt")               # the RNG step, with the model and optimizer
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_qcomm.adapters.fsdp2.comms import (
    QSDPCommState,
    check_torch_fsdp_api,
    fsdp_param_shards,
    install_requires_grad_syncs,
    is_quantized_param,
)
from lightning_qcomm.adapters.fsdp2.install import QSDPCommConfig, install_qsdp_comms
from lightning_qcomm.adapters.fsdp2.master import project_master_weights
from lightning_qcomm.adapters.fsdp2.shim import fsdp_roots, require
from lightning_qcomm.comm.agree import max_over_ranks_each, max_over_ranks_tensor
from lightning_qcomm.comm.auto_trial import UNCOMPRESSED, WidthTrial, candidate_widths
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.consistency import check_same_config
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.parallel.hsdp import check_hsdp_mesh, fsdp_groups, install_inter_node_average, mesh_topology
from lightning_qcomm.parallel.qsdp_config import QSDPConfig
from lightning_qcomm.parallel.qsdp_state import load_run_state, run_state
from lightning_qcomm.parallel.sharding import plan_fsdp_groups
from lightning_qcomm.parallel.step_hooks import attach_step_hooks

log = logging.getLogger(__name__)


class QSDPHandle:
    """What ``apply_qsdp`` leaves behind: the FSDP groups with quantized comms and the state shared by them.

    Attributes:
        modules: the FSDP groups (``FSDPModule``) that own parameters, in group-id order (the seeds' order).
        comm_state: seed and RNG step read by every quantized collective (identical on all ranks).
        config: the ``QSDPConfig`` it runs with (``"auto"`` widths included: ``trial`` sets them per step).
        trial: with an ``"auto"`` width, the ``comm.auto_trial.WidthTrial`` (``comm_state.trial``), else None.
        nonfinite: the non-finite gradient policy (the ranks agree through one 8-byte all-reduce).

    Example::

        handle = apply_qsdp(model, mesh, QSDPConfig(bits=8)).attach(optimizer)
        torch.save(handle.state_dict(), "qsdp_rng.pt")   # the seeds' step counter, to resume
    """

    def __init__(
        self,
        modules: list[nn.Module],
        mesh: Any,
        config: QSDPConfig,
        comm_state: QSDPCommState,
        background: BackgroundComm | None,
        owner: str,
    ) -> None:
        self.modules = modules
        self.mesh = mesh
        self.config = config
        self.comm_state = comm_state
        self.background = background
        # the master projection's codec (quantize_master; refused with an "auto" weight width)
        self.weight_codec = None if config.auto_weights else config.build_weight_codec()
        if config.hsdp:
            self.weight_codec = config.build_intra_codecs()[0]
        self.nonfinite = NonFiniteGuard(config.nonfinite, owner, agree=self._all_ranks_finite)

    @property
    def trial(self) -> WidthTrial | None:
        return self.comm_state.trial

    @property
    def rng_step(self) -> int:
        """Optimizer steps counted so far (part of every codec seed)."""
        return self.comm_state.step

    def quantizes_any_param(self) -> bool:
        """Whether any parameter shard travels quantized (else the settings change nothing)."""
        shards = [p for m in self.modules for p in fsdp_param_shards(m)]
        return any(is_quantized_param(p, self.config.min_quant_numel) for p in shards)

    def after_step(self) -> None:
        """Call once after every optimizer step: project the master weights (``quantize_master``), then count
        the step, so the next step's codes use fresh random bits."""
        if self.config.quantize_master:
            project_master_weights(self.modules, self.weight_codec, self.comm_state, self.config.min_quant_numel)
        if self.trial is not None:
            self.trial.step_done(self.comm_state.step, self._agree)
        self.comm_state.step += 1

    def before_step(self, optimizer: Optimizer) -> bool:
        """Apply the non-finite policy to ``optimizer``'s gradient shards (after backward, before its step)."""
        self.comm_state.deferred.settle_stale()  # a backward that raised left its deferred calls unwritten
        return self.nonfinite.apply(optimizer, self.comm_state.step)

    def attach(self, optimizer: Optimizer) -> QSDPHandle:
        """Run ``before_step`` / ``after_step`` from ``optimizer``'s step pre- and post-hooks (torch's
        ``register_step_pre_hook`` / ``register_step_post_hook``), so the training loop calls nothing itself.
        Returns ``self``; ``detach()`` removes the hooks."""
        self.detach()
        self._hooks = attach_step_hooks(optimizer, before=self.before_step, after=lambda opt: self.after_step())
        return self

    def detach(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []

    def state_dict(self) -> dict[str, Any]:
        """What continuing training needs besides weights and optimizer (``parallel.qsdp_state.run_state``: the
        RNG step, the same on all ranks; the seed; the layout; with an ``"auto"`` width the trial's state)."""
        return run_state(self.comm_state, self.mesh.size(), mesh_topology(self.mesh))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict`` (``parallel.qsdp_state.load_run_state``: another layout or seed is warned)."""
        load_run_state("QSDPHandle", self.comm_state, state, self.mesh.size(), mesh_topology(self.mesh))

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: FSDP2's recovery (``FSDPModule.reset_iter_state``) on
        every root FSDP group, once the calls the failed backward deferred are written as inline calls would have
        been (``adapters.fsdp2.deferred``). Gradients it had already reduced stay; ``zero_grad`` drops them.

        Example::

            try:
                loss.backward()
            except torch.OutOfMemoryError:
                handle.reset_iter_state()
                optimizer.zero_grad()
        """
        require("reset_iter_state", "QSDPHandle")  # torch 2.13+
        self.comm_state.deferred.settle_stale()
        for root in fsdp_roots(self.modules):
            root.reset_iter_state()

    def close(self) -> None:
        """Stop the background all-gather thread (if any); a later all-gather restarts it."""
        self.comm_state.deferred.settle_stale()
        if self.background is not None:
            self.background.close()

    def _device(self) -> torch.device | None:
        return next((p.device for m in self.modules for p in m.parameters()), None)

    def _agree(self, seconds: list[float]) -> list[float]:
        group = None if self.config.hsdp else self.mesh.get_group()  # HSDP: the whole world
        return max_over_ranks_each(seconds, group, device=self._device())

    def _all_ranks_finite(self, flag: torch.Tensor) -> torch.Tensor:
        group = None if self.config.hsdp else self.mesh.get_group()  # HSDP: the whole world
        return max_over_ranks_tensor(flag, group, device=self._device())


def config_fingerprint(config: QSDPConfig) -> dict[str, Any]:
    """Everything that decides the FSDP groups and what their collectives send (compared across ranks: codecs
    with equal payload sizes would otherwise decode each other's bytes as garbage)."""

    def codec(auto: bool, name: str, build: Callable[[], Any]) -> Any:
        if auto:  # the width is chosen at setup: compare what it is chosen for
            return {"auto": name.lower(), "bucket_size": config.bucket_size}
        built = build()
        return None if built is None else built.config()

    layer_classes = config.layer_class_set
    return {
        "weight_codec": codec(config.auto_weights, config.weight_codec, config.build_weight_codec),
        "grad_codec": codec(config.auto_grads, config.grad_codec, config.build_grad_codec),
        "min_bits": config.min_bits,
        "min_quant_numel": config.min_quant_numel,
        "quantize_master": config.quantize_master,
        "seed": config.seed,
        "layer_classes": None if layer_classes is None else sorted(layer_classes),
        "min_wrap_numel": config.min_wrap_numel,
        "reshard_after_forward": config.reshard_after_forward,
        "overlap_comm": config.overlap_comm,
        "nonfinite": config.nonfinite,
        "hsdp": config.hsdp,
        "intra_node_bits": config.intra_node_bits,
    }


def apply_qsdp(
    module: nn.Module,
    mesh: Any,
    config: QSDPConfig | None = None,
    *,
    comm_state: QSDPCommState | None = None,
    background: BackgroundComm | None = None,
    owner: str = "apply_qsdp",
    check_ranks: bool = True,
) -> QSDPHandle:
    """Shard ``module`` with FSDP2 over the 1-D ``mesh`` and quantize its weight all-gathers and gradient
    reduce-scatters (see the module docstring). Collective: every rank calls it with the same settings.

    Args:
        module: the model; sharded in place (a module already sharded with ``fully_shard`` keeps its groups).
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks.
        config: ``QSDPConfig`` (default: 8-bit weights and gradients).
        comm_state: the seed / RNG-step state to use (a strategy keeps one across stages); default a new one at
            step 0 with ``config.seed``.
        background: the background thread and process group of overlapped CPU all-gathers, reused across calls
            (default: made here when ``overlap_comm`` and the mesh is on CPU).
        owner: the name error messages and logs use.
        check_ranks: compare ``config`` across ranks first (``comm.consistency``; a mismatch raises on every rank).

    Returns:
        a ``QSDPHandle``: ``attach(optimizer)`` after the optimizer is made (it must see the sharded parameters).

    Example::

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        handle = apply_qsdp(model, mesh, QSDPConfig(bits=8)).attach(optimizer)
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard

    config = QSDPConfig() if config is None else config
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"{owner}(config={config!r}) must be a QSDPConfig")
    if config.hsdp:
        check_hsdp_mesh(mesh, owner)
        shard_mesh = mesh["intra"]
    elif getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"{owner}: mesh must be a 1-D data-parallel DeviceMesh (or hsdp=True), got {mesh!r}")
    else:
        shard_mesh = mesh
    check_torch_fsdp_api()
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(f"{owner} supports FSDP2 (fully_shard) only; found FSDP1-wrapped modules")
    if not any(p.numel() > 0 for p in module.parameters()):
        raise ValueError(f"{owner}: the module {type(module).__name__} has no parameters to shard")
    if check_ranks:
        check_same_config(owner, config_fingerprint(config))
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        for m in plan_fsdp_groups(module, config.layer_class_set, config.min_wrap_numel):
            fully_shard(m, mesh=shard_mesh, reshard_after_forward=config.reshard_after_forward)
    else:
        # sharded before (by the user, or an earlier stage): keep it; a group left gathered by its last forward
        # (FSDP2 keeps the root's) goes back to its shards first
        for m in sharded:
            m.reshard()
    _check_all_sharded(module, owner)
    comm_state = QSDPCommState(seed=config.seed, step=0) if comm_state is None else comm_state
    if config.hsdp:
        codecs = config.build_intra_codecs()
    elif config.has_auto:
        codecs = auto_codecs(config, comm_state, shard_mesh.size(), owner)
    else:
        codecs = (config.build_weight_codec(), config.build_grad_codec())
    worker = worker_group = None
    if config.hsdp and codecs == (None, None):
        # inside a node FSDP2's own collectives; nothing of ours to install there
        modules = fsdp_groups(module)
        install_requires_grad_syncs(module)  # but toggle_optimizer's flags must still reach autograd
    else:
        if config.hsdp and config.overlap_comm:
            # a background group per node would need every rank of the world to create every node's group
            log.info("%s: with hsdp=True the quantized comms inside a node run inline (no overlap_comm)", owner)
        if config.overlap_comm and shard_mesh.device_type == "cpu" and not config.hsdp:
            background = BackgroundComm("lightning_qcomm-qsdp") if background is None else background
            worker, worker_group = background.acquire(shard_mesh.get_group())
        elif not config.hsdp:
            background = None
        # under HSDP the group is the node's: the ledger tags its traffic "@intra" (docs/design.md, "Byte accounting")
        comm_config = QSDPCommConfig(codecs[0], codecs[1], config.min_quant_numel, "@intra" if config.hsdp else "")
        modules = install_qsdp_comms(module, comm_config, comm_state, worker=worker, worker_group=worker_group)
    if config.hsdp:
        background, inter_worker, inter_group = _inter_node_lane(config, mesh, background, owner)
        # "auto": one codec per candidate width, the trial's width of each step picks one (agreed over the world)
        inter_codec = auto_codecs(config, comm_state, mesh.size(0), owner)[1] if config.auto_grads else None
        install_inter_node_average(
            modules,
            config.build_grad_codec() if inter_codec is None else inter_codec,
            mesh,
            comm_state,
            config.min_quant_numel,
            inter_worker,
            inter_group,
        )
    if worker is not None:
        chain_forward_prefetch(modules)
    return QSDPHandle(modules, mesh, config, comm_state, background, owner)


def _inter_node_lane(config: QSDPConfig, mesh: Any, background: BackgroundComm | None, owner: str):
    """(background, worker, group) of the averages across nodes under HSDP: with ``overlap_comm`` on CPU a worker
    and a copy of the mesh's ``inter`` group (``BackgroundComm.acquire_nodes``; collective), else inline."""
    import torch.distributed as dist

    from lightning_qcomm.comm.topology import Topology

    if not config.overlap_comm or mesh.device_type != "cpu":
        return background, None, None
    background = BackgroundComm("lightning_qcomm-qsdp") if background is None else background
    worker, lanes = background.acquire_nodes(Topology(mesh.size(0) * mesh.size(1), mesh.size(1)))
    # every member of one inter group compares the same two rank sets: a group runs all deferred or all inline
    if dist.get_process_group_ranks(lanes.inter) != dist.get_process_group_ranks(mesh.get_group("inter")):
        log.info("%s: the mesh's nodes are not consecutive ranks; the averages across nodes run inline", owner)
        return background, None, None
    return background, worker, lanes.inter


def new_trial(config: QSDPConfig, world_size: int, start: int, owner: str) -> WidthTrial:
    """The trial of ``config``'s ``"auto"`` widths from step ``start``: 32, 8 .. ``min_bits`` (one rank: 32 only)."""
    widths = candidate_widths(config.min_bits) if world_size > 1 else (UNCOMPRESSED,)
    return WidthTrial(widths, start=start, owner=f"{owner}(weight_bits/grad_bits='auto')")


def auto_codecs(config: QSDPConfig, comm_state: QSDPCommState, world_size: int, owner: str) -> tuple[Any, Any]:
    """The (weight, grad) codecs of a config with an ``"auto"`` width: ``{width: codec}`` for an ``"auto"``
    direction (one per candidate width, chosen per step by ``comm_state.trial``, made here at the first call:
    32, 8 .. ``min_bits``; on one rank only 32), the fixed codec for the other.

    Example::

        weights, grads = auto_codecs(QSDPConfig(bits="auto"), QSDPCommState(), 2, "apply_qsdp")   # {32: None, 8: ..., 4: ...}
    """
    if comm_state.trial is None:
        comm_state.trial = new_trial(config, world_size, comm_state.step, owner)
    comm_state.trial.restart_clock()  # a later stage or fit: its first step is not timed across the gap
    by_width = {b: config.resolve_auto(b, b) for b in comm_state.trial.candidates}
    weights = {b: c.build_weight_codec() for b, c in by_width.items()} if config.auto_weights else None
    grads = {b: c.build_grad_codec() for b, c in by_width.items()} if config.auto_grads else None
    return (
        config.build_weight_codec() if weights is None else weights,
        config.build_grad_codec() if grads is None else grads,
    )


def _check_all_sharded(root: nn.Module, owner: str) -> None:
    """Trainable parameters outside every FSDP group would never have their gradients synchronized."""
    from torch.distributed.tensor import DTensor

    loose = [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if loose:
        raise ValueError(
            f"{owner}: trainable parameters {loose[:8]}{' ...' if len(loose) > 8 else ''} are not sharded by "
            "fully_shard (shard also the module that holds them, e.g. the root)"
        )


def chain_forward_prefetch(fsdp_modules: list[nn.Module]) -> None:
    """Within each FSDP root's tree, in registration order (the root's group, then its layers), group i issues
    group i+1's all-gather before its own compute. Trees are not linked to each other: every FSDP root has its
    own communication context, set up in its own first forward. A wrong order would only prefetch early."""
    roots = [m for m in fsdp_modules if not any(o is not m and m in set(o.modules()) for o in fsdp_modules)]
    for root in roots:
        members = set(root.modules())
        tree = [m for m in fsdp_modules if m in members]
        for cur, nxt in zip(tree, tree[1:]):
            cur.set_modules_to_forward_prefetch([nxt])


__all__ = ["QSDPHandle", "apply_qsdp", "auto_codecs", "chain_forward_prefetch", "config_fingerprint", "new_trial"]
