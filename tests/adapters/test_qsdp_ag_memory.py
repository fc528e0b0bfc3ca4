"""Extra memory of one QSDP weight all-gather: the gathered wire rows live in the output's own bytes
(``adapters.fsdp2.comms``, ``adapters.fsdp2.gather_region``).

FSDP2's own all-gather needs nothing beside its output (the input is a view of the output's own row). QSDP's
encodes its row (P bytes), gathers the N rows (N P) into the last N P bytes of the output (N rows of U bytes,
U > P) and decodes them into the output: the rows that end at or before that region first, then the
k = N - base // U rows that overlap it (base: the region's start), each wire row copied out before a decode
could write over it. At most max(k P, P + E) at any moment (E: the encode's own temporaries beside its row,
measured on an encode alone; the fp32 copy of a segment for bf16 rows), instead of (N + 1) P with a separate
buffer. Only rows cut into pieces take the region: on CPU a row of more than ``transport.TRANSFER_PIECE_BYTES``
is gathered as concurrent pieces, stored piece-major (``PieceLayout``); rows gathered whole (CUDA) keep a
separate buffer so that their decode stays one launch.
Counted per storage (``benchmarks/tensor_memory``) on the fake process group at N = 2 and 4; a memory count,
not a timing. The decoded values equal those of a separate gather buffer, byte for byte (the ``equals_separate``
tests: ``gather_region`` on a stand-in decoder, and the adapter with its region refused).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lightning_qcomm.adapters.fsdp2 import gather_region  # noqa: E402
from lightning_qcomm.adapters.fsdp2.comms import ParamShard, QSDPCommState, QuantizedAllGather  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402
from lightning_qcomm.comm import transport  # noqa: E402

SLACK = 4096  # bytes: scalars, scales' views, the codec's small per-call tensors
ALIGN = 16  # the region's start: a multiple of 16 bytes (the decoders view fp32 scales in the wire bytes)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _gather(world: int, bits: int, dtype: torch.dtype, layout) -> tuple[int, int, int, int]:
    """(peak extra bytes of the second call, P, U, E): E the encode's own temporaries beside its P bytes (the
    codec's per-call scales, measured on an encode alone)."""
    from tensor_memory import TensorMemory

    params = [ParamShard(n, n, world * n, 2 if q else 1, True) for n, q in layout]
    s_numel = sum(n for n, _ in layout)
    ag = QuantizedAllGather(get_codec("uniform", bits=bits, bucket_size=1024), QSDPCommState(seed=1), 0, params, 1024)
    group = dist.group.WORLD
    rank = group.rank()
    row_bytes = ag._row_codec(s_numel, dtype, params, ag.codec).row_nbytes(dtype)
    with TensorMemory() as mem:
        out = torch.empty(world * s_numel, dtype=dtype)
        inp = out.view(world, s_numel)[rank]  # FSDP2's layout: the input is the output's own row
        inp.copy_(torch.randn(s_numel))
        ag(out, inp, group)  # warm: caches, first-use work
        start = mem.mark()
        ag(out, inp, group)
        extra = mem.peak_since(start)
        rc = ag._row_codec(s_numel, dtype, params, ag.codec)
        rc.encode(inp.view(1, -1), 5)
        start = mem.mark()
        rc.encode(inp.view(1, -1), 5)
        encode_extra = mem.peak_since(start) - row_bytes
    return extra, row_bytes, s_numel * out.element_size(), encode_extra


def _overlapping_rows(world: int, p: int, u: int) -> int:
    """k: the rows whose span [j U, (j + 1) U) reaches into the region [base, N U) of the gathered rows."""
    base = (world * u - world * p) // ALIGN * ALIGN
    return world - base // u


LAYOUT = ((300_000, True), (300_000, True), (4_096, False))  # rows of several 128 KiB pieces at 4 and 8 bits


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_holds_the_overlapping_wire_rows_only(fake_world, world: int, bits: int) -> None:
    fake_world(world)
    extra, p, u, e = _gather(world, bits, torch.float32, LAYOUT)
    assert p > 2 * (1 << 17)  # several pieces per row: the case that cut the rows
    k = _overlapping_rows(world, p, u)
    assert k < world and e < p // 8  # the bound below is tighter than a separate N-row buffer's (N + 1) P
    assert extra <= max(k * p, p + e) + SLACK, (extra / p, k, e, world, bits)


def test_region_over_several_rows(fake_world) -> None:
    """bf16 rows at 8 bits: the wire rows are half the output rows; the region covers several output rows."""
    fake_world(4)
    extra, p, u, e = _gather(4, 8, torch.bfloat16, LAYOUT)
    k = _overlapping_rows(4, p, u)
    assert k >= 3
    assert extra <= max(k * p, p + e) + SLACK, (extra / p, k, e)


def test_unpieced_rows_keep_a_separate_buffer_and_one_decode(fake_world, monkeypatch) -> None:
    """Rows gathered whole (as on CUDA) decode in one call for all N rows, which needs their wire outside the
    output: a separate buffer, (N + 1) P at most, and the output's region unused."""
    monkeypatch.setattr(transport, "TRANSFER_PIECE_BYTES", 1 << 30)
    monkeypatch.setattr(gather_region, "decode_in_place", None)  # not called for rows gathered whole
    fake_world(4)
    extra, p, u, e = _gather(4, 8, torch.float32, LAYOUT)
    assert extra <= 5 * p + e + SLACK, (extra / p, e)


def _decode_both_ways(world: int, layout: transport.PieceLayout, u_numel: int, dtype: torch.dtype) -> None:
    """The in-place decode of random wire rows against the decode of a separate copy, row by row."""
    gen = torch.Generator().manual_seed(world * 7 + layout.row_bytes)
    wire = torch.randint(0, 256, (world * layout.row_bytes,), dtype=torch.uint8, generator=gen)
    out = torch.full((world * u_numel,), float("nan"), dtype=dtype)
    region = gather_region.region(out, layout)
    assert region is not None
    region.copy_(wire)
    expected = torch.empty_like(out).view(world, u_numel)
    scratch = torch.empty(layout.row_bytes, dtype=torch.uint8)

    def decode(rows: torch.Tensor, j0: int, j1: int, dst: torch.Tensor) -> None:
        # a stand-in decoder: each output element from a few of its row's wire bytes (reads the whole row)
        n = rows.shape[1]
        idx = torch.arange(u_numel) % n
        vals = rows[:, idx].to(torch.float32) + rows[:, (idx * 7 + 3) % n].to(torch.float32) / 256
        dst[j0:j1].copy_(vals.to(dtype))

    for j in range(world):
        decode(layout.read_row(wire, j, scratch).view(1, -1).clone(), j, j + 1, expected)
    rows = out.view(world, u_numel)
    gather_region.decode_in_place(region, layout, rows, lambda w, j0, j1: decode(w, j0, j1, rows))
    assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("pieced", [False, True])
def test_in_place_decode_equals_separate_buffer(world: int, pieced: bool) -> None:
    p = 1000 if pieced else 400  # pieced: 1000 bytes in pieces of 300 (a short last piece of 100)
    layout = transport.PieceLayout.for_rows(world, p, torch.device("cpu"), piece_bytes=300 if pieced else None)
    assert layout.pieced == pieced and (not pieced or layout.cols[-1][1] - layout.cols[-1][0] < 300)
    for dtype, u_numel in ((torch.float32, 600), (torch.bfloat16, 600), (torch.float32, 260)):
        _decode_both_ways(world, layout, u_numel, dtype)


class _Done:
    def wait(self) -> None:
        pass


def _fake_all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's row: this rank's bytes plus 37 i (mod 256) for rank i, so that the rows differ."""
    rows = out.view(dist.get_world_size(group), -1)
    for i in range(rows.shape[0]):
        rows[i].copy_(inp + 37 * i)
    return _Done() if async_op else None


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("pieced", [True])  # rows gathered whole use a separate buffer (the one-launch decode)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_in_place_equals_separate_buffer(fake_world, monkeypatch, world, pieced, dtype) -> None:
    """The adapter's output with the region against the same call with it refused (a separate N-row buffer)."""
    fake_world(world)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, _fake_all_gather, raising=False)
    if not pieced:
        monkeypatch.setattr(transport, "TRANSFER_PIECE_BYTES", 1 << 30)
    params = [ParamShard(n, n, world * n, 2 if q else 1, True) for n, q in LAYOUT]
    s_numel = sum(n for n, _ in LAYOUT)
    codec = get_codec("uniform", bits=8, bucket_size=1024)
    ag = QuantizedAllGather(codec, QSDPCommState(seed=1), 0, params, 1024)
    p = ag._row_codec(s_numel, dtype, params, codec).row_nbytes(dtype)
    layout = transport.PieceLayout.for_rows(world, p, torch.device("cpu"))
    assert layout.pieced == pieced
    assert not pieced or layout.cols[-1][1] - layout.cols[-1][0] < layout.cols[0][1]  # a short last piece
    group, outs = dist.group.WORLD, []
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(gather_region, "region", lambda output, layout: None)
        out = torch.zeros(world * s_numel, dtype=dtype)
        inp = out.view(world, s_numel)[group.rank()]
        inp.copy_(torch.randn(s_numel, generator=torch.Generator().manual_seed(3)))
        ag(out, inp, group)
        outs.append(out.view(torch.uint8))
    assert torch.equal(outs[0], outs[1])
