"""Kernel launches per collective do not grow with the world size.

On a GPU every eager torch op is a kernel launch; an all-reduce that encodes and decodes chunk by chunk
costs O(N) launches per bucket and the CPU cannot run ahead of the device. Here every aten op dispatched
during one collective is counted (``TorchDispatchMode``) on torch's ``fake`` process group (one process,
any world size, no data moved) at N = 2, 4 and 8, with the same logical tensor size at every N. Rows stay
below the fused CPU path's threshold, so the torch ops counted are those a CUDA tensor would launch.

Criterion, fixed before measuring: the count at N = 8 is at most 10% above the count at N = 2 (the
chunk-by-chunk code is at several times that).
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
from _sync_guard import OPENED_OPS, run_opened
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.collectives import quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter

WORLDS = (2, 4, 8)
D = 24_581  # odd; a chunk is not a multiple of the bucket, of 8 or of N
CODECS = {
    "uniform8": dict(name="uniform", bits=8, bucket_size=512),
    "qsgd4": dict(name="qsgd", bits=4, bucket_size=512),
    "nuqsgd4": dict(name="nuqsgd", bits=4, bucket_size=512),
    "fp8_e4m3": dict(name="fp8_e4m3", bits=8, bucket_size=512),
    "uniform4_nearest": dict(name="uniform", bits=4, bucket_size=128, stochastic=False),
}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qcomm" and func.overloadpacket.__name__ in OPENED_OPS:
            return run_opened(self, func, args, kwargs)  # the rows ops: count the ops their kernel runs
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _fake_world(world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


@pytest.fixture
def fake_worlds():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _count(fn) -> int:
    fn()  # warm caches (codec copies, LUTs): count a steady-state call
    with OpCounter() as counter:
        fn()
    return counter.total


def _assert_flat(counts: dict[int, int], what: str) -> None:
    assert counts[8] <= 1.1 * counts[2], f"{what}: aten ops per call grow with the world size: {counts}"


@pytest.mark.parametrize("name", sorted(CODECS))
def test_all_reduce_ops_do_not_grow_with_world_size(fake_worlds, name):
    codec = get_codec(**CODECS[name])
    counts = {}
    for world in WORLDS:
        _fake_world(world)
        x = torch.randn(D, generator=torch.Generator().manual_seed(world))
        ef = torch.zeros(D)
        counts[world] = _count(
            partial(quantized_all_reduce, x, codec, op="avg", error_feedback=ef, seed=3, check=False)
        )
    _assert_flat(counts, f"quantized_all_reduce[{name}]")


@pytest.mark.parametrize("name", ["uniform8", "qsgd4"])
def test_reduce_scatter_and_all_gather_ops_do_not_grow_with_world_size(fake_worlds, name):
    codec = get_codec(**CODECS[name])
    rs, ag = {}, {}
    for world in WORLDS:
        _fake_world(world)
        s = -(-D // world)  # the same logical tensor split N ways
        inp = torch.randn(world * s)
        rs[world] = _count(partial(quantized_reduce_scatter, torch.empty(s), inp, codec, seed=1, check=False))
        ag[world] = _count(partial(quantized_all_gather, torch.empty(world * s), inp[:s], codec, seed=1, check=False))
    _assert_flat(rs, f"quantized_reduce_scatter[{name}]")
    _assert_flat(ag, f"quantized_all_gather[{name}]")


def test_qsdp_row_codec_encode_and_gather_decode_ops_do_not_grow_with_world_size():
    """QSDP's wire rows: N rows of one layout with a segment that is not a multiple of the bucket (per-row
    seeds) and a raw segment; encode all rows (reduce-scatter side) and decode all rows (all-gather side)."""
    codec = get_codec("uniform", bits=8, bucket_size=256)
    enc, dec = {}, {}
    for world in WORLDS:
        s = -(-D // world)
        rc = RowCodec([Segment(s - 37, True), Segment(37, False)], codec)
        rows = torch.randn(world, s)
        wire = rc.encode(rows, seed=5)
        out = torch.empty(world, s)
        enc[world] = _count(partial(rc.encode, rows, seed=5))
        dec[world] = _count(partial(rc.decode, wire, out))
    _assert_flat(enc, "RowCodec.encode")
    _assert_flat(dec, "RowCodec.decode")


def test_codec_calls_per_all_reduce_do_not_grow_with_world_size(fake_worlds, monkeypatch):
    """The same at the codec's public API: Codec.encode / Codec.decode calls per all-reduce."""
    codec = get_codec("fp8_e4m3", bits=8, bucket_size=512)
    calls = Counter()
    for method in ("encode", "decode"):
        original = getattr(type(codec), method)

        def counted(self, *a, _original=original, _method=method, **k):
            calls[_method] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(type(codec), method, counted)
    per_world = {}
    for world in WORLDS:
        _fake_world(world)
        x = torch.randn(D)
        calls.clear()
        quantized_all_reduce(x, codec, op="avg", seed=1, check=False)
        per_world[world] = sum(calls.values())
    _assert_flat(per_world, "codec calls per quantized_all_reduce")


@pytest.mark.parametrize("tail", [0, 4], ids=["whole-pieces", "short-last-piece"])
@pytest.mark.parametrize("block", [None, 64], ids=["scale-per-chunk", "scale-per-block"])
def test_onebit_all_reduce_ops_do_not_grow_with_the_number_of_pieces(fake_worlds, monkeypatch, tail, block):
    """The 1-bit all-reduce's accelerator form (``collectives.sign_collective``, forced on CPU tensors, the codec layer in its
    accelerator form, the fused CPU kernels off) dispatches the same aten ops for a bucket cut into 2 pieces as
    into 8: one batch per group of equal pieces. The per-piece reference grows with the pieces (shown alongside,
    the reason for the batched form)."""
    from lightning_qcomm.codecs import cpu_fused, scaling
    from lightning_qcomm.collectives import onebit_all_reduce, onebit_pieces, sign_collective

    monkeypatch.setattr(scaling, "_HOST_BRANCHES", False)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    world, m8 = 4, 256
    d = 8 * world * m8 + tail
    _fake_world(world)
    counts = {}
    for path in ("batched", "reference"):
        monkeypatch.setattr(sign_collective, "PATH", path)
        for pieces in (2, 8):
            m = m8 * 8 // pieces
            assert len(onebit_pieces(d, world, m)) == pieces + (tail > 0)
            x, ew, es = torch.randn(d), torch.zeros(d), torch.zeros(-(-d // world))
            counts[path, pieces] = _count(
                partial(onebit_all_reduce, x, ew, es, check=False, piece_numel=m, block_numel=block)
            )
    assert counts["batched", 8] == counts["batched", 2], counts
    assert counts["reference", 8] > 1.5 * counts["reference", 2], counts
