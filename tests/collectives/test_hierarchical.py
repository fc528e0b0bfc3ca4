"""Two-level topology and the hierarchical all-reduce on 4 real gloo ranks as 2 nodes x 2 ranks.

Checks: the intra/inter groups and the 2-D mesh; codec=None equals a flat fp32 all-reduce to fp32 rounding;
8-bit results are identical on all ranks and within the two quantizations' bound; error feedback's
telescoping identity; and the bytes each rank hands to torch.distributed for ranks on the other node match
the formulas, 1/node_size of a flat compressed all-reduce's. The same for the hierarchical 1-bit average
(1-bit Adam's momentum): bit-identical to the exact node mean 1-bit-averaged over the inter group.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, run_checks, spawn, write_rank_result

from lightning_qcomm.codecs import get_codec
from lightning_qcomm.collectives.hierarchical import hierarchical_all_reduce, shard_numel
from lightning_qcomm.collectives.quantized import all_reduce_pieces, quantized_all_reduce
from lightning_qcomm.comm.topology import Topology, node_groups, resolve_node_size

WORLD, NODE = 4, 2
D = 10_001  # not a multiple of anything


def _inputs(step: int) -> list[torch.Tensor]:
    return [torch.randn(D, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(WORLD)]


class _OffNodeBytes:
    """Wraps torch.distributed's payload calls: bytes this rank hands over for ranks of another node
    (equal splits: all_to_all and reduce_scatter send 1/n of the input to each peer, all_gather all of it)."""

    def __init__(self, topo: Topology) -> None:
        self.topo, self.rank, self.bytes, self.saved = topo, dist.get_rank(), 0, {}

    def _off(self, group) -> int:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        return sum(1 for r in ranks if self.topo.node_of(r) != self.topo.node_of(self.rank)), len(ranks)

    def __enter__(self):
        def wrap(name, per_peer):
            fn = getattr(dist, name)
            self.saved[name] = fn

            def counted(*args, **kwargs):
                group = kwargs.get("group")
                off, n = self._off(group)
                self.bytes += off * per_peer(args, n)
                return fn(*args, **kwargs)

            setattr(dist, name, counted)

        def nbytes(t):
            return t.numel() * t.element_size()

        wrap("all_to_all_single", lambda a, n: nbytes(a[1]) // n)
        for name in ("all_gather_into_tensor", "all_gather_single"):  # torch >= 2.13 has the *_single names
            if hasattr(dist, name):
                wrap(name, lambda a, n: nbytes(a[1]))
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            if hasattr(dist, name):
                wrap(name, lambda a, n: nbytes(a[1]) // n)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def check_topology(rank, groups):
    topo = groups.topology
    assert (topo.num_nodes, topo.node_size) == (2, 2)
    assert dist.get_process_group_ranks(groups.intra) == topo.intra_ranks(topo.node_of(rank))
    assert dist.get_process_group_ranks(groups.inter) == topo.inter_ranks(topo.local_of(rank))
    assert groups.mesh.mesh_dim_names == ("inter", "intra")
    assert dist.get_process_group_ranks(groups.mesh.get_group("intra")) == topo.intra_ranks(topo.node_of(rank))


def check_fp32_equals_flat(rank, groups):
    xs = _inputs(0)
    out = hierarchical_all_reduce(xs[rank].clone(), None, groups, op="avg")
    flat = xs[rank].clone()
    dist.all_reduce(flat)
    flat /= WORLD
    # both are fp32 sums of the same 4 numbers in another order: a few ulps of the largest partial sum
    bound = 4 * 2**-24 * sum(x.abs() for x in xs) / WORLD
    assert bool(((out - flat).abs() <= bound).all()), float((out - flat).abs().max())


def check_8bit_identical_and_bounded(rank, groups):
    xs = _inputs(1)
    codec = get_codec("uniform", 8, 64)
    out = hierarchical_all_reduce(xs[rank].clone(), codec, groups, op="sum", seed=7)
    both = [torch.empty_like(out) for _ in range(WORLD)]
    dist.all_gather(both, out)
    assert all(torch.equal(both[0], b) for b in both), "ranks hold different results"
    # |error| <= sum over nodes of one step of the node sum's bucket + one step of the total's bucket,
    # each step <= range / 255 of its bucket: bounded with the global ranges here
    exact = sum(xs)
    node_sums = [xs[0] + xs[1], xs[2] + xs[3]]
    steps = sum(float(s.max() - s.min()) / 255 for s in node_sums) + float(exact.max() - exact.min()) / 255
    assert float((out - exact).abs().max()) <= steps * (1 + 1e-5)


def check_error_feedback_identity(rank, groups):
    codec = get_codec("uniform", 2, 64, stochastic=False)
    c = shard_numel(D, NODE)
    e = torch.zeros(c)
    sum_in = torch.zeros(D, dtype=torch.float64)
    sum_out = torch.zeros(D, dtype=torch.float64)
    for t in range(20):
        xs = _inputs(10 + t)
        sum_in += sum(x.double() for x in xs)
        sum_out += hierarchical_all_reduce(xs[rank].clone(), codec, groups, op="sum", error_feedback=e).double()
    # sum_t out_t = sum_t sum_r x_r,t - E, E = the residuals of each shard summed over the nodes
    residual = torch.zeros(NODE * c, dtype=torch.float64)
    gathered = [torch.empty_like(e) for _ in range(WORLD)]
    dist.all_gather(gathered, e)
    topo = groups.topology
    for r, er in enumerate(gathered):
        local = topo.local_of(r)
        residual[local * c : (local + 1) * c] += er.double()
    identity = (sum_out - sum_in + residual[:D]).abs().max()
    assert float(identity) <= 1e-3 * float(sum_in.abs().max()), float(identity)


def check_inter_node_bytes(rank, groups):
    topo = groups.topology
    codec = get_codec("uniform", 8, 64)
    n_nodes, n = topo.num_nodes, topo.world_size
    x = _inputs(2)[rank]
    with _OffNodeBytes(topo) as hier:
        hierarchical_all_reduce(x.clone(), codec, groups, check=False)
    with _OffNodeBytes(topo) as flat:
        quantized_all_reduce(x.clone(), codec, op="avg", check=False)
    c = shard_numel(D, topo.node_size)

    def two_phase(numel, size, off_peers):  # per piece: all_to_all of size chunks, all_gather of one chunk
        return sum(2 * off_peers * codec.nbytes(-(-ln // size)) for _, ln in all_reduce_pieces(numel, size, codec))

    assert hier.bytes == two_phase(c, n_nodes, n_nodes - 1), (hier.bytes, two_phase(c, n_nodes, n_nodes - 1))
    assert flat.bytes == two_phase(D, n, n - topo.node_size), (flat.bytes, two_phase(D, n, n - topo.node_size))
    ratio = hier.bytes / flat.bytes
    assert abs(ratio - 1 / topo.node_size) < 0.02, ratio


def check_onebit_equals_reference(rank, groups):
    """hierarchical_onebit_all_reduce = the exact node mean of this rank's shard, onebit_all_reduce'd over the inter
    group with this rank's errors, all-gathered in the node: bit for bit, over two steps (errors carried)."""
    from lightning_qcomm.collectives import onebit_all_reduce, onebit_server_error_numel
    from lightning_qcomm.collectives.hierarchical import hierarchical_onebit_all_reduce

    topo = groups.topology
    c = shard_numel(D, NODE)
    we, se = torch.zeros(c), torch.zeros(onebit_server_error_numel(c, groups.inter))
    we_ref, se_ref = we.clone(), se.clone()
    for step in range(2):
        xs = _inputs(20 + step)
        out = hierarchical_onebit_all_reduce(xs[rank].clone(), we, se, groups)
        a, b = topo.intra_ranks(topo.node_of(rank))
        mean = torch.zeros(NODE * c)
        mean[:D] = (xs[a] + xs[b]) / NODE
        local = topo.local_of(rank)
        shard = mean[local * c : (local + 1) * c].clone()
        onebit_all_reduce(shard, we_ref, se_ref, group=groups.inter)
        ref = torch.empty(NODE * c)
        dist.all_gather_into_tensor(ref, shard, group=groups.intra)
        assert torch.equal(out, ref[:D]), float((out - ref[:D]).abs().max())
        assert torch.equal(we, we_ref) and torch.equal(se, se_ref)
    every = [torch.empty_like(out) for _ in range(WORLD)]
    dist.all_gather(every, out)
    assert all(torch.equal(every[0], o) for o in every), "ranks hold different results"


def check_onebit_inter_node_bytes(rank, groups):
    from lightning_qcomm.collectives import onebit_all_reduce, onebit_pieces, onebit_server_error_numel
    from lightning_qcomm.collectives.hierarchical import hierarchical_onebit_all_reduce

    topo = groups.topology
    n_nodes, n = topo.num_nodes, topo.world_size
    x = _inputs(4)[rank]
    c = shard_numel(D, topo.node_size)
    with _OffNodeBytes(topo) as hier:
        hierarchical_onebit_all_reduce(
            x.clone(), torch.zeros(c), torch.zeros(onebit_server_error_numel(c, groups.inter)), groups, check=False
        )
    with _OffNodeBytes(topo) as flat:
        onebit_all_reduce(x.clone(), torch.zeros(D), torch.zeros(onebit_server_error_numel(D)), check=False)

    sign = get_codec("sign1", bits=1, bucket_size=None)  # one scale per chunk: ceil(chunk / 8) + 4 bytes

    def two_phase(numel, size, off_peers):  # per piece: one chunk to each off-node peer, twice
        return sum(2 * off_peers * sign.nbytes(-(-ln // size)) for _, ln in onebit_pieces(numel, size))

    assert hier.bytes == two_phase(c, n_nodes, n_nodes - 1), (hier.bytes, two_phase(c, n_nodes, n_nodes - 1))
    assert flat.bytes == two_phase(D, n, n - topo.node_size), (flat.bytes, two_phase(D, n, n - topo.node_size))
    assert abs(hier.bytes / flat.bytes - 1 / topo.node_size) < 0.02, hier.bytes / flat.bytes


CHECKS = [check_topology, check_fp32_equals_flat, check_8bit_identical_and_bounded, check_error_feedback_identity,
          check_inter_node_bytes, check_onebit_equals_reference, check_onebit_inter_node_bytes]  # fmt: skip


def _worker(rank: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    groups = node_groups(Topology(WORLD, NODE), timeout=datetime.timedelta(seconds=60))
    write_rank_result(outdir, rank, run_checks(CHECKS, rank, groups))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hier"))
    spawn(_worker, free_port(), out, nprocs=WORLD)
    return rank_results(out, WORLD)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_four_ranks_as_two_nodes(results, name):
    bad = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] != "ok"]
    assert not bad, "\n".join(bad)


def test_topology_arithmetic_and_bad_node_size():
    topo = Topology(8, 4)
    assert (topo.num_nodes, topo.intra_ranks(1), topo.inter_ranks(3)) == (2, [4, 5, 6, 7], [3, 7])
    assert Topology(4, 4).hierarchical is False and Topology(4, 1).hierarchical is False and topo.hierarchical
    with pytest.raises(ValueError, match="node_size=3.*allowed: a divisor of 8"):
        Topology(8, 3)
    with pytest.raises(TypeError, match="node_size"):
        Topology(8, 2.0)
    assert resolve_node_size(8, devices_per_node=2) == 2
    assert resolve_node_size(8, env={"LOCAL_WORLD_SIZE": "4"}) == 4
    assert resolve_node_size(8, env={}) == 8
    with pytest.raises(ValueError, match="node_size=3"):
        resolve_node_size(8, node_size=3)
