"""Hierarchical all-reduce: exact inside a node, compressed only across nodes (comm layer).

With M nodes of L ranks (``comm.topology``), a flat tensor x of d elements on every rank, c = ceil(d / L):

1. intra-node reduce-scatter, fp32, SUM: the rank with local index l gets its node's exact sum of chunk l,
   s_l = Σ_{ranks of the node} x[l·c : (l+1)·c]  (zero-padded);
2. inter-node: ``quantized_all_reduce(s_l, codec, group=inter, op="sum")`` among the M ranks with local index
   l (one per node), precision preserving: S_l = Σ_nodes D(Q(s_l)) summed in fp32, requantized, identical on
   those M ranks; error feedback, if given, keeps this rank's residual of its c-element shard;
3. intra-node all-gather of the L fp32 shards: x ← concat_l S_l [:d], divided by M·L for ``op="avg"``.

So each compressed byte crosses the slow links once: per node, the inter-node wire bytes are 1/L of a flat
compressed all-reduce's (whose all-to-all sends (N − L)/(N − 1) of its chunks off the node). The result is
identical on every rank. ``codec=None`` makes step 2 a plain fp32 all-reduce: the result then equals a flat
fp32 all-reduce up to the order of the fp32 additions.

Ledger: steps 1 and 3 are recorded under ``f"{tag}@intra"``, step 2 under ``f"{tag}@inter"``.

Example::

    groups = node_groups(Topology(world_size=4, node_size=2))
    hierarchical_all_reduce(grad, get_codec("uniform", bits=8), groups, op="avg")
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.quantized import quantized_all_reduce
from lightning_qcomm.comm.topology import NodeGroups
from lightning_qcomm.comm.transport import _reduce_scatter_single

FP32_BYTES = 4
SEED_INTER = 4  # folded into the caller's seed, with the local index (no correlated rounding across shards)


def shard_numel(numel: int, node_size: int) -> int:
    """c = ceil(numel / node_size): the elements of the shard each rank reduces across nodes."""
    return -(-numel // node_size)


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
    ``shard_numel(x.numel(), node_size)`` elements (fp32)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"hierarchical_all_reduce(op={op!r}) is not allowed; allowed: sum, avg")
    topo = groups.topology
    node, world = topo.node_size, topo.world_size
    d = x.numel()
    c = shard_numel(d, node)
    if error_feedback is not None and error_feedback.numel() != c:
        raise ValueError(f"hierarchical_all_reduce: error_feedback has {error_feedback.numel()} elements, expected {c}")
    ledger = get_ledger()
    full = torch.zeros(node * c, dtype=torch.float32, device=x.device)
    full[:d] = x.detach().reshape(-1)
    shard = torch.empty(c, dtype=torch.float32, device=x.device)
    if node > 1:
        _reduce_scatter_single(shard, full, dist.ReduceOp.SUM, groups.intra)
        ledger.record("reduce_scatter", node * c * FP32_BYTES, node * c * FP32_BYTES, node, tag=f"{tag}@intra")
    else:
        shard.copy_(full)
    if topo.num_nodes > 1:
        local = dist.get_rank(groups.intra) if node > 1 else 0
        quantized_all_reduce(
            shard,
            codec,
            group=groups.inter,
            op="sum",
            error_feedback=error_feedback,
            seed=derive_seed(seed, SEED_INTER, local),
            tag=f"{tag}@inter",
            check=check,
        )
    if node > 1:
        dist.all_gather_into_tensor(full, shard, group=groups.intra)
        ledger.record("all_gather", node * c * FP32_BYTES, node * c * FP32_BYTES, node, c * FP32_BYTES, f"{tag}@intra")
    else:
        full.copy_(shard)
    if op == "avg":
        full.div_(world)
    x.copy_(full[:d].view(x.shape))
    return x


__all__ = ["hierarchical_all_reduce", "shard_numel"]
