"""Hierarchical all-reduce: exact inside a node, compressed only across nodes (collectives layer; docs/design.md,
"Topology").

With M nodes of L ranks and c = ceil(d / L): (1) an fp32 reduce-scatter inside the node gives local rank l its
node's exact sum s_l of chunk l; (2) ``quantized_all_reduce(s_l, codec, group=inter, op="sum")`` among the M ranks
of local index l (precision preserving; error feedback keeps this rank's residual of its shard); (3) an fp32
all-gather inside the node, divided by M·L for ``op="avg"``. Each compressed byte crosses the slow links once; the
result is identical on every rank; ``codec=None`` equals a flat fp32 all-reduce up to the order of the additions.
``hierarchical_onebit_all_reduce`` runs the same three steps around ``onebit_all_reduce`` (the node means averaged
1-bit across nodes). ``ParamShards`` lays several tensors out so each rank's shard holds a fixed piece of every
tensor (per-parameter residuals whatever the bucket). Ledger: steps 1 and 3 under ``f"{tag}@intra"``, step 2 under
``f"{tag}@inter"``.

Example::

    groups = node_groups(Topology(world_size=4, node_size=2))
    hierarchical_all_reduce(grad, get_codec("uniform", bits=8), groups, op="avg")
    c = shard_numel(momentum.numel(), 2)
    hierarchical_onebit_all_reduce(momentum, torch.zeros(c), torch.zeros(onebit_server_error_numel(c, groups.inter)), groups)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.collectives.quantized import quantized_all_reduce
from lightning_qcomm.collectives.sign_collective import onebit_all_reduce
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.topology import NodeGroups
from lightning_qcomm.comm.transport import _reduce_scatter_single

FP32_BYTES = 4
SEED_INTER = 4  # folded into the caller's seed, with the local index (no correlated rounding across shards)


def shard_numel(numel: int, node_size: int) -> int:
    """c = ceil(numel / node_size): the elements of the shard each rank reduces across nodes."""
    return -(-numel // node_size)


def _intra_reduce_scatter(x: torch.Tensor, groups: NodeGroups, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: (the zero-padded L*c fp32 buffer, this rank's c-element shard of its node's exact sum)."""
    node = groups.topology.node_size
    d = x.numel()
    c = shard_numel(d, node)
    full = torch.zeros(node * c, dtype=torch.float32, device=x.device)
    full[:d] = x.detach().reshape(-1)
    shard = torch.empty(c, dtype=torch.float32, device=x.device)
    if node > 1:
        _reduce_scatter_single(shard, full, dist.ReduceOp.SUM, groups.intra)
        get_ledger().record("reduce_scatter", node * c * FP32_BYTES, node * c * FP32_BYTES, node, tag=f"{tag}@intra")
    else:
        shard.copy_(full)
    return full, shard


def _intra_all_gather(full: torch.Tensor, shard: torch.Tensor, groups: NodeGroups, tag: str) -> torch.Tensor:
    """Step 3: every shard of the node into ``full`` (returned)."""
    node, c = groups.topology.node_size, shard.numel()
    if node > 1:
        dist.all_gather_into_tensor(full, shard, group=groups.intra)
        get_ledger().record(
            "all_gather", node * c * FP32_BYTES, node * c * FP32_BYTES, node, c * FP32_BYTES, f"{tag}@intra"
        )
    else:
        full.copy_(shard)
    return full


def local_index(groups: NodeGroups) -> int:
    """This rank's index inside its node (its shard)."""
    return dist.get_rank(groups.intra) if groups.topology.node_size > 1 else 0


def hierarchical_all_reduce(
    x: torch.Tensor,
    codec: Codec | None,
    groups: NodeGroups,
    op: str = "avg",
    error_feedback: torch.Tensor | None = None,
    seed: int = 0,
    tag: str = "grads",
    check: bool = True,
) -> torch.Tensor:
    """In place (also returned); see the module doc. ``error_feedback``: this rank's residual of its shard,
    ``shard_numel(x.numel(), node_size)`` elements (fp32).

    Example::

        hierarchical_all_reduce(bucket, get_codec("nuqsgd", bits=4), node_groups(Topology(4, 2)), op="avg")
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"hierarchical_all_reduce(op={op!r}) is not allowed; allowed: sum, avg")
    topo = groups.topology
    c = shard_numel(x.numel(), topo.node_size)
    if error_feedback is not None and error_feedback.numel() != c:
        raise ValueError(f"hierarchical_all_reduce: error_feedback has {error_feedback.numel()} elements, expected {c}")
    full, shard = _intra_reduce_scatter(x, groups, tag)
    if topo.num_nodes > 1:
        quantized_all_reduce(
            shard,
            codec,
            group=groups.inter,
            op="sum",
            error_feedback=error_feedback,
            seed=derive_seed(seed, SEED_INTER, local_index(groups)),
            tag=f"{tag}@inter",
            check=check,
        )
    _intra_all_gather(full, shard, groups, tag)
    if op == "avg":
        full.div_(topo.world_size)
    x.copy_(full[: x.numel()].view(x.shape))
    return x


def hierarchical_onebit_all_reduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    groups: NodeGroups,
    tag: str = "momentum",
    check: bool = True,
    piece_numel: int | None = None,
    block_numel: int | None = None,
) -> torch.Tensor:
    """1-bit Adam's average over all ranks, compressed only across nodes (module doc), in place on flat ``x``.

    x <- all-gather_node( onebit_avg_nodes( (1/L) Σ_node x [shard l] ) ): identical on every rank. The errors
    belong to this rank's shard: ``worker_error`` c = ``shard_numel(x.numel(), L)`` elements, ``server_error``
    ``onebit_server_error_numel(c, groups.inter)``. One node (M = 1): the exact fp32 average, errors untouched.
    ``block_numel``: elements per 1-bit scale across nodes (``onebit_all_reduce``; None: one per chunk).

    Example::

        c = shard_numel(m.numel(), 2)
        hierarchical_onebit_all_reduce(m, torch.zeros(c), torch.zeros(onebit_server_error_numel(c, g.inter)), g)
    """
    topo = groups.topology
    c = shard_numel(x.numel(), topo.node_size)
    if worker_error.numel() != c:
        raise ValueError(
            f"hierarchical_onebit_all_reduce: worker_error has {worker_error.numel()} elements, expected {c}"
        )
    full, shard = _intra_reduce_scatter(x, groups, tag)
    shard.div_(topo.node_size)  # the node mean: onebit_all_reduce averages these over the M nodes
    if topo.num_nodes > 1:
        kw = {} if piece_numel is None else {"piece_numel": piece_numel}
        onebit_all_reduce(
            shard,
            worker_error,
            server_error,
            group=groups.inter,
            tag=f"{tag}@inter",
            check=check,
            block_numel=block_numel,
            **kw,
        )
    _intra_all_gather(full, shard, groups, tag)
    x.copy_(full[: x.numel()].view(x.shape))
    return x


class ParamShards:
    """Param-aligned shards of a flat vector of tensors (numels n_p) over the L ranks of a node.

    Tensor p is cut into L chunks of k_p = ceil(n_p / L) elements (its last chunk zero-padded); the shard of
    local rank l is concat_p chunk_l(p), c = Σ_p k_p elements. ``to_rows`` lays the vector out as L rows of c
    (row l = shard l), so ``hierarchical_all_reduce``'s contiguous reduce-scatter hands rank l exactly its
    shard; ``from_rows`` undoes it. Rank l's piece of tensor p does not depend on the other tensors of the
    vector, so a residual of the shard is kept per tensor (``chunks``) across re-bucketing.

    Example::

        shards = ParamShards([5, 3], node_size=2)     # chunks (3, 2), shard_numel 5
        rows = shards.to_rows(torch.arange(8.0))      # [0, 1, 2, 5, 6 | 3, 4, 0, 7, 0]
    """

    def __init__(self, numels: tuple[int, ...] | list[int], node_size: int) -> None:
        self.numels = tuple(int(n) for n in numels)
        self.node_size = int(node_size)
        self.chunks = tuple(shard_numel(n, self.node_size) for n in self.numels)
        self.shard_numel = sum(self.chunks)

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The L*c row layout of ``flat`` (Σ n_p elements; a new tensor)."""
        node, cols, pos = self.node_size, [], 0
        for n, k in zip(self.numels, self.chunks):
            piece = flat[pos : pos + n]
            pos += n
            cols.append((F.pad(piece, (0, node * k - n)) if node * k != n else piece).view(node, k))
        if not cols:
            return flat.new_zeros(0)
        return torch.cat(cols, dim=1).reshape(-1)

    def from_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the row layout ``rows`` back into the flat ``out`` (returned)."""
        pos = 0
        for piece, n in zip(rows.view(self.node_size, self.shard_numel).split(self.chunks, dim=1), self.numels):
            out[pos : pos + n].copy_(piece.reshape(-1)[:n])
            pos += n
        return out

    def add_to_shard(self, flat: torch.Tensor, index: int, values: torch.Tensor) -> torch.Tensor:
        """``flat`` += ``values`` placed as shard ``index`` (``shard_numel`` elements, e.g. that rank's residual),
        in place and returned: ``from_rows(to_rows(flat) + values in row index)`` without the row copies (padding
        elements have no place in ``flat`` and are dropped).

        Example::

            ParamShards([5, 3], node_size=2).add_to_shard(torch.zeros(8), 1, torch.ones(5))  # [0, 0, 0, 1, 1, 0, 0, 1]
        """
        pos = col = 0
        for n, k in zip(self.numels, self.chunks):
            lo, hi = min(index * k, n), min((index + 1) * k, n)
            flat[pos + lo : pos + hi].add_(values[col : col + hi - lo])
            pos, col = pos + n, col + k
        return flat


__all__ = [
    "ParamShards",
    "hierarchical_all_reduce",
    "hierarchical_onebit_all_reduce",
    "local_index",
    "shard_numel",
]
