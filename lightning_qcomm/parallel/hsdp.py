"""QSDP over HSDP: shard inside a node, replicate across nodes, quantize only what crosses (entry-point layer).

On ``M`` nodes of ``L`` ranks (``comm.topology``), each FSDP group is sharded with FSDP2 over the node's ``L``
ranks (``mesh["intra"]``): weight all-gathers and gradient reduce-scatters stay on the fast links,
unquantized by default (``QSDPConfig.intra_node_bits=None``; a width quantizes them too, with QSDP's own
comms). The ``M`` replicas of each shard then average their reduce-scattered gradient over the ``inter`` group
(one rank per node) with the precision-preserving compressed all-reduce (``collectives.quantized_all_reduce``:
decode, fp32 sum, requantize), from FSDP2's all-reduce hook, which runs on the reduce-scatter output before
FSDP2's post-divide. So g_shard ← (1/M) Σ_nodes D(Q(Σ_intra g / L)): the global mean gradient up to the two
roundings, identical on the ``M`` replicas, so their optimizer shards stay equal. Each compressed byte crosses
the slow links once. Seeds fold in (seed, step, FSDP group, local rank) and, inside the all-reduce, the
replica's rank, so no two replicas or shards round alike. A group whose shard has fewer than
``min_quant_numel`` elements all-reduces in fp32 (its bytes are negligible; its norms and biases stay exact).
Checkpoints record the layout (``mesh_topology``); resuming on another one reshards the weights and optimizer
state and is said once (``another_topology_message``; docs/design.md, "Another topology on resume").

Example::

    groups = node_groups(Topology(world_size=4, node_size=2))
    qsdp = apply_qsdp(model, groups.mesh, QSDPConfig(grad_bits=8, hsdp=True))   # 2-D mesh ("inter", "intra")
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState
from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.collectives import quantized_all_reduce
from lightning_qcomm.comm.comm_worker import CommWorker

SEED_INTER = 4  # beside adapters.fsdp2.comms's SEED_WEIGHTS / SEED_GRADS / SEED_MASTER
HSDP_DIMS = ("inter", "intra")


class InterNodeGradAverage:
    """FSDP2 all-reduce hook of one FSDP group: its reduce-scattered gradient shard, averaged across nodes.

    ``codec`` None averages in fp32 (one ``dist.all_reduce``), as FSDP2's own HSDP does; the ledger records
    either under ``grads@inter``. A mapping ``{width: codec}`` (``grad_bits="auto"``) takes, at each call, the codec
    of the width ``state.trial`` gives the current step.

    With a ``worker`` (and ``worker_group``: the same ranks as ``inter``, used by nothing else) the average of a
    call that only FSDP2's views read afterwards (``adapters.fsdp2.deferred.deferrable``) runs on the worker while the
    rest of backward computes: the hook snapshots ``reduce_output`` into an fp32 buffer and returns, and the
    deferred flush at the end of backward writes the average into it and replays FSDP2's post-divide. Same
    seed, same ranks in the same order: bit-identical to the inline call. ``deferred_calls`` counts them.
    """

    def __init__(
        self,
        codec: Codec | None | Mapping[int, Codec | None],
        inter: dist.ProcessGroup,
        state: QSDPCommState,
        group_id: int,
        min_quant_numel: int,
        worker: CommWorker | None = None,
        worker_group: dist.ProcessGroup | None = None,
        deferrable: Callable[[torch.Tensor], bool] | None = None,
        post_divide: Callable[[torch.dtype], float | None] | None = None,
    ) -> None:
        self.codec, self.inter, self.state, self.group_id = codec, inter, state, group_id
        self.min_quant_numel = min_quant_numel
        self.local_rank = 0  # set by install_inter_node_average: the rank inside the node (the shard index)
        self.worker, self.worker_group = worker, worker_group
        self._deferrable, self._post_divide = deferrable, post_divide
        self.deferred_calls = 0

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.state.deferred.settle_stale()  # a backward that raised left its deferred calls unwritten
        if dist.get_world_size(self.inter) == 1:
            return
        codec = None if reduce_output.numel() < self.min_quant_numel else self._codec_now()
        seed = derive_seed(self.state.seed, SEED_INTER, self.state.step, self.group_id, self.local_rank)
        average = functools.partial(quantized_all_reduce, op="avg", seed=seed, tag="grads@inter", check=False)
        if self._defer(reduce_output):
            total = reduce_output.clone()  # FSDP2 post-divides reduce_output in place right after this call
            job = functools.partial(average, total, codec, group=self.worker_group)
            self.state.deferred.add(
                self.worker.submit(job), reduce_output, total, self._post_divide(reduce_output.dtype)
            )
            self.deferred_calls += 1
            return
        average(reduce_output, codec, group=self.inter)

    def _codec_now(self) -> Codec | None:
        if isinstance(self.codec, Mapping):
            return self.codec[self.state.trial.width(self.state.step)]
        return self.codec

    def _defer(self, reduce_output: torch.Tensor) -> bool:
        # fp32 only: the copy back is then exact, as the inline call's in-place result is
        return (
            self.worker is not None
            and self._deferrable is not None
            and reduce_output.dtype == torch.float32
            and reduce_output.is_contiguous()
            and self._deferrable(reduce_output)
        )


def check_hsdp_mesh(mesh, owner: str) -> None:
    """A 2-D mesh named ("inter", "intra") (``comm.topology.node_groups(...).mesh``)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", None) != 2 or names != HSDP_DIMS:
        raise ValueError(
            f"{owner}: hsdp=True needs a 2-D DeviceMesh with dims {HSDP_DIMS} (comm.topology.node_groups), got {mesh!r}"
        )


def install_inter_node_average(
    modules: list[torch.nn.Module],
    codec: Codec | None | Mapping[int, Codec | None],
    mesh,
    state: QSDPCommState,
    min_quant_numel: int,
    worker: CommWorker | None = None,
    worker_group: dist.ProcessGroup | None = None,
) -> list[InterNodeGradAverage]:
    """Set an ``InterNodeGradAverage`` as the all-reduce hook of every FSDP group in ``modules`` (group-id
    order, as ``adapters.fsdp2.install.install_qsdp_comms`` or ``fsdp_groups`` return them); with ``worker`` and
    ``worker_group`` (a copy of the mesh's ``inter`` group) the averages overlap the rest of backward."""
    from lightning_qcomm.adapters.fsdp2.deferred import deferrable
    from lightning_qcomm.adapters.fsdp2.shim import post_divide_factor

    inter = mesh.get_group("inter")
    local = mesh.get_local_rank("intra")
    if worker_group is not None and dist.get_process_group_ranks(worker_group) != dist.get_process_group_ranks(inter):
        raise ValueError(
            f"install_inter_node_average: worker_group spans ranks {dist.get_process_group_ranks(worker_group)}, "
            f"the mesh's inter group {dist.get_process_group_ranks(inter)}"
        )
    hooks = []
    for gid, module in enumerate(modules):
        overlap = {}
        if worker is not None and worker_group is not None:
            overlap = {
                "worker": worker,
                "worker_group": worker_group,
                "deferrable": deferrable(module, in_all_reduce_hook=True),
                "post_divide": functools.partial(post_divide_factor, module),
            }
        hook = InterNodeGradAverage(codec, inter, state, gid, min_quant_numel, **overlap)
        hook.local_rank = local
        module.set_all_reduce_hook(hook)
        hooks.append(hook)
    return hooks


def hsdp_mesh(config, node_size: int | None, devices_per_node: int | None, owner: str, timeout=None):
    """(config, mesh) for a strategy asked for ``hsdp``: the 2-D ("inter", "intra") mesh of this job's nodes
    (``node_size`` if given, else the launcher's devices per node, else ``LOCAL_WORLD_SIZE``), its groups made
    with ``timeout``. On one node, or one rank per node, there is nothing to replicate across: one warning and
    flat QSDP (config with ``hsdp=False``, mesh None). Collective."""
    import dataclasses

    from lightning_qcomm.comm.topology import hierarchical_topology, node_groups

    topo = hierarchical_topology(
        owner,
        dist.get_world_size(),
        node_size,
        devices_per_node,
        setting="hsdp=True",
        fallback="no second level; training as flat QSDP over all ranks",
    )
    if topo is None:
        return dataclasses.replace(config, hsdp=False, intra_node_bits=None), None
    return config, node_groups(topo, timeout=timeout).mesh


def mesh_topology(mesh) -> list[int] | None:
    """``[num_nodes, node_size]`` of an HSDP mesh ("inter", "intra"), as checkpoints record it; None for flat QSDP
    (a 1-D mesh, or none).

    Example::

        mesh_topology(node_groups(Topology(world_size=4, node_size=2)).mesh)   # [2, 2]
    """
    if mesh is None or getattr(mesh, "ndim", 1) != 2:
        return None
    return [int(mesh.size(0)), int(mesh.size(1))]


def _layout_name(world_size: int, topology: list[int] | None) -> str:
    return (
        f"flat QSDP over {world_size} ranks"
        if topology is None
        else f"{topology[0]} nodes x {topology[1]} ranks (HSDP)"
    )


def another_topology_message(
    owner: str, saved: Mapping[str, Any], world_size: int, topology: list[int] | None
) -> str | None:
    """What to warn when a QSDP checkpoint entry ``saved`` (``{"world_size", "topology", ...}``) is resumed on
    another layout (docs/design.md, "Another topology on resume"); None on the same one, or for an entry that
    does not record its layout (written before it did).

    QSDP keeps no per-rank state besides its shards: the weights and the optimizer state are loaded onto this
    run's shards (a sharded checkpoint is resharded by ``torch.distributed.checkpoint``), and the RNG step is
    the same on every rank. So nothing is reset; the warning says that the run goes on from other seeds (they
    fold in the rank inside the node and across nodes), i.e. not bit for bit as on the saved layout.

    Example::

        another_topology_message("QSDPStrategy", {"world_size": 4, "topology": [2, 2]}, 2, None)
        # "QSDPStrategy: the checkpoint was written on 2 nodes x 2 ranks (HSDP), this run is flat QSDP over 2 ..."
    """
    if "world_size" not in saved:
        return None
    was = (int(saved["world_size"]), None if saved.get("topology") is None else list(saved["topology"]))
    if was == (world_size, topology):
        return None
    before, now = _layout_name(*was), _layout_name(world_size, topology)
    return (
        f"{owner}: the checkpoint was written on {before}, this run is {now}: the weights and optimizer state are "
        "loaded onto this run's shards and the RNG step is kept (QSDP holds no per-rank state to reset); the "
        f"rounding seeds fold in the ranks, so training does not continue bit for bit as it would on {before}"
    )


def fsdp_groups(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP modules under ``root`` that own parameters, in ``root.modules()`` order (the group ids)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_qcomm.adapters.fsdp2.comms import fsdp_param_shards

    return [m for m in root.modules() if isinstance(m, FSDPModule) and fsdp_param_shards(m)]


__all__ = [
    "HSDP_DIMS",
    "InterNodeGradAverage",
    "another_topology_message",
    "check_hsdp_mesh",
    "fsdp_groups",
    "hsdp_mesh",
    "install_inter_node_average",
    "mesh_topology",
]
