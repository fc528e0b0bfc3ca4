"""Rows stored piece by piece (``comm.transport.PieceLayout``) and their copy-free exchange.

QSDP's gradient reduce-scatter writes its wire rows piece-major so that the concurrent pieces of the
all-to-all send and receive contiguous memory without copies. Checked: the layout's writes and reads round
trip on cuts that fall inside segments and rows; on 3 gloo ranks, ``all_to_all_pieces`` moves exactly what
one ``all_to_all_single`` moves, and a reduce-scatter whose rows are cut into pieces returns bit for bit what
the same call with one piece returns (fp32 and bf16 gradients, both codecs' paths: fused-size rows, rows
with a piece boundary inside a segment, a raw bias).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, run_checks, spawn, write_rank_result

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, QuantizedReduceScatter
from lightning_qcomm.adapters.fsdp2.shim import ParamShard
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.comm import transport
from lightning_qcomm.comm.transport import PieceLayout, all_to_all_pieces

WORLD = 3
LAYOUT = ((20_000, True), (4_099, False), (40_960, True), (3_000, True))  # (elements, quantized) per param


def _layout(world: int, row_bytes: int, piece_bytes: int) -> PieceLayout:
    return PieceLayout.for_rows(world, row_bytes, torch.device("cpu"), piece_bytes=piece_bytes)


def test_layout_writes_and_reads_round_trip():
    world, row_bytes = 3, 1000
    layout = _layout(world, row_bytes, 97)  # pieces of 97 bytes (the last one shorter)
    assert layout.pieced and layout.cols[0] == (0, 97) and layout.cols[-1][1] == row_bytes
    rows = torch.randint(0, 256, (world, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    buf = layout.empty(torch.device("cpu"))
    layout.write(buf, 0, rows[:, :450])
    for j in range(world):
        layout.write_row(buf, j, 450, rows[j, 450:])
    for a, b in layout.cols:  # a piece holds columns a..b of every row, contiguously
        assert torch.equal(buf[world * a : world * b].view(world, b - a), rows[:, a:b])
    scratch = torch.empty(row_bytes, dtype=torch.uint8)
    for j in range(world):
        assert torch.equal(layout.read_row(buf, j, scratch), rows[j])
    assert torch.equal(layout.span(buf, 1, 100, 150), rows[1, 100:150])  # inside the second piece
    assert layout.span(buf, 1, 90, 100) is None  # across the first cut
    plain = _layout(world, row_bytes, row_bytes)
    assert not plain.pieced and torch.equal(plain.read_row(rows.reshape(-1), 2), rows[2])


def _reduce_scatter(world: int, rank: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    params = [ParamShard(n, n, world * n, 2 if q else 1, True) for n, q in LAYOUT]
    s = sum(n for n, _ in LAYOUT)
    rs = QuantizedReduceScatter(get_codec(name, bits=8, bucket_size=1024), QSDPCommState(seed=3), 0, params, 1024)
    g = torch.Generator().manual_seed(10 + rank)
    inp = torch.randn(world * s, generator=g).to(dtype)
    out = torch.empty(s, dtype=dtype)
    rs(out, inp, dist.group.WORLD)
    return out


def _check_exchange(rank: int, world: int) -> None:
    row = 5003
    send = torch.randint(0, 256, (world * row,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    expect = torch.empty_like(send)
    dist.all_to_all_single(expect, send)
    layout = _layout(world, row, 700)
    src, got = layout.empty(send.device), layout.empty(send.device)
    layout.write(src, 0, send.view(world, row))
    all_to_all_pieces(got, src, layout)
    scratch = torch.empty(row, dtype=torch.uint8)
    for j in range(world):
        assert torch.equal(layout.read_row(got, j, scratch), expect.view(world, row)[j]), f"row from rank {j}"


def _check_reduce_scatter(rank: int, world: int) -> None:
    default = transport.TRANSFER_PIECE_BYTES
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for name in ("uniform", "qsgd"):
                transport.TRANSFER_PIECE_BYTES = 1 << 30  # one piece: plain rows
                one = _reduce_scatter(world, rank, dtype, name)
                transport.TRANSFER_PIECE_BYTES = 10_007  # cuts inside segments
                cut = _reduce_scatter(world, rank, dtype, name)
                assert torch.equal(one.view(torch.uint8), cut.view(torch.uint8)), (dtype, name)
    finally:
        transport.TRANSFER_PIECE_BYTES = default


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    write_rank_result(outdir, rank, run_checks((_check_exchange, _check_reduce_scatter), rank, world))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("pieces"))
    spawn(_worker, WORLD, free_port(), outdir, nprocs=WORLD, timeout_s=240)
    return rank_results(outdir, WORLD)


@pytest.mark.parametrize("check", ["_check_exchange", "_check_reduce_scatter"])
def test_on_gloo(results, check):
    bad = [f"rank {r}:\n{res.get(check)}" for r, res in enumerate(results) if res.get(check) != "ok"]
    assert not bad, "\n".join(bad)
