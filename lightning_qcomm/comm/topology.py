"""Ranks per node, and the process groups of a two-level (inter-node × intra-node) layout (comm layer).

Global ranks are node-major, as Lightning's launchers, torchrun and SLURM number them: rank
``r = node · node_size + local``. The *intra* group of a rank is its node (``node_size`` ranks, fast links);
its *inter* group holds the ranks with the same local index on every node (``num_nodes`` ranks, one per
node: the slow links). A hierarchical collective reduces inside the node first, so each buffer crosses the
slow links once, 1/node_size of it from each rank of the node.

``node_size`` comes from the launcher (Lightning: devices per node; torchrun: ``LOCAL_WORLD_SIZE``) or is
given; it must divide the world. The groups are created once, collectively (every rank of the world calls
``node_groups`` in the same order), with the caller's timeout (``torch.distributed.new_group`` would give
them torch's 30-minute default), and also returned as a 2-D ``DeviceMesh`` named ("inter", "intra") for
FSDP2's HSDP (replicate across nodes, shard within one).

Example::

    topo = Topology(world_size=4, node_size=2)        # 2 nodes x 2 ranks
    topo.intra_ranks(node=1), topo.inter_ranks(local=0)  # [2, 3], [0, 2]
    groups = node_groups(topo, timeout=timedelta(minutes=5))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_qcomm._checks import check_int


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks as ``num_nodes`` nodes of ``node_size`` ranks, node-major."""

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        check_int("Topology", "world_size", self.world_size, minimum=1)
        check_int("Topology", "node_size", self.node_size, minimum=1)
        if self.world_size % self.node_size:
            raise ValueError(
                f"Topology(node_size={self.node_size}) does not divide world_size={self.world_size}; allowed: a "
                f"divisor of {self.world_size} ({', '.join(str(d) for d in divisors(self.world_size))})"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def hierarchical(self) -> bool:
        """Whether there is anything to be hierarchical about: several nodes of several ranks."""
        return self.num_nodes > 1 and self.node_size > 1

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def local_of(self, rank: int) -> int:
        return rank % self.node_size

    def intra_ranks(self, node: int) -> list[int]:
        return list(range(node * self.node_size, (node + 1) * self.node_size))

    def inter_ranks(self, local: int) -> list[int]:
        return list(range(local, self.world_size, self.node_size))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_node_size(
    world_size: int,
    node_size: int | None = None,
    devices_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Ranks per node: ``node_size`` if given, else the launcher's devices per node, else ``LOCAL_WORLD_SIZE``
    (torchrun), else the whole world (one node)."""
    if node_size is not None:
        return Topology(world_size, check_int("Topology", "node_size", node_size, minimum=1)).node_size
    if devices_per_node is not None and devices_per_node > 0 and world_size % devices_per_node == 0:
        return devices_per_node
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) > 0 and world_size % int(local) == 0:
        return int(local)
    return world_size


FLAT_FALLBACK = (
    "there is no intra-node level to keep exact and no inter-node level to compress alone; "
    "running the flat (non-hierarchical) collectives"
)


def hierarchical_topology(
    owner: str,
    world_size: int,
    node_size: int | None = None,
    devices_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
    *,
    setting: str = "hierarchical=True",
    fallback: str = FLAT_FALLBACK,
) -> Topology | None:
    """The topology a two-level ``setting`` of ``owner`` runs on, or None for the flat path.

    ``node_size`` that does not divide ``world_size``: ValueError naming ``owner``, the value and the allowed
    divisors. One node, or one rank per node: nothing is hierarchical, so the flat collective runs, said once
    (``rank_zero_warn``, ending with ``fallback``: what runs instead), never silently.

    Example::

        hierarchical_topology("QuantDDPStrategy", 8, devices_per_node=4)   # Topology(world_size=8, node_size=4)
        hierarchical_topology("QuantDDPStrategy", 8, node_size=8)          # None, warned: one node
    """
    from lightning_utilities.core.rank_zero import rank_zero_warn

    try:
        topo = Topology(world_size, resolve_node_size(world_size, node_size, devices_per_node, env))
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("Topology(", f"{owner}(", 1)) from None
    if not topo.hierarchical:
        rank_zero_warn(
            f"{owner}({setting}): {world_size} rank(s) as {topo.num_nodes} node(s) of {topo.node_size}: {fallback}"
        )
        return None
    return topo


@dataclass
class NodeGroups:
    """This rank's intra-node and inter-node process groups, and the 2-D mesh made of them."""

    topology: Topology
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims ("inter", "intra")


def node_groups(
    topology: Topology, timeout: timedelta | None = None, backend: str | None = None, device_type: str = "cpu"
) -> NodeGroups:
    """Create the intra- and inter-node groups of ``topology`` over the default group (collective).

    ``timeout`` None inherits the default group's (see ``comm_worker.group_timeout``). On gloo the default group
    (and with it these) is destroyed at exit (``process_group.destroy_gloo_group_at_exit``).
    """
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_qcomm.comm.comm_worker import group_timeout
    from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("node_groups needs an initialised torch.distributed default group")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"node_groups: the topology has world_size={topology.world_size}, torch.distributed has "
            f"{dist.get_world_size()}"
        )
    timeout = timeout if timeout is not None else group_timeout(None)
    backend = backend or dist.get_backend()
    destroy_gloo_group_at_exit()  # groups of ours alive at exit can abort the process in teardown
    kw = {"timeout": timeout, "backend": backend}
    intra, _ = dist.new_subgroups_by_enumeration([topology.intra_ranks(n) for n in range(topology.num_nodes)], **kw)
    inter, _ = dist.new_subgroups_by_enumeration([topology.inter_ranks(j) for j in range(topology.node_size)], **kw)
    grid = torch.arange(topology.world_size).view(topology.num_nodes, topology.node_size)
    mesh = DeviceMesh.from_group([inter, intra], device_type, mesh=grid, mesh_dim_names=("inter", "intra"))
    return NodeGroups(topology, intra, inter, mesh)


__all__ = ["NodeGroups", "Topology", "divisors", "hierarchical_topology", "node_groups", "resolve_node_size"]
