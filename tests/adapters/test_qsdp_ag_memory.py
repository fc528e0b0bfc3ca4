"""Extra memory of one QSDP weight all-gather: the wire rows, once each (``adapters.fsdp2.comms``).

FSDP2's own all-gather needs nothing beside its output (the input is a view of the output's own row). QSDP's
needs its encoded row (P bytes) and the N gathered rows (N P), which it decodes into the output: at most
(N + 1) P at any moment. On CPU a row of more than ``transport.TRANSFER_PIECE_BYTES`` is gathered as concurrent
pieces; they land straight in a piece-major buffer (``PieceLayout``), not in piece buffers copied into a second
N-row buffer (2N + 1 rows: the QSDP rows' excess over FSDP2's at the GPT-2 benchmark's peak). Counted per storage
(``benchmarks/tensor_memory``) on the fake process group at N = 2 and 4; a memory count, not a timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lightning_qcomm.adapters.fsdp2.comms import ParamShard, QSDPCommState, QuantizedAllGather  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402

SLACK = 4096  # bytes: scalars, scales' views, the codec's small per-call tensors


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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_holds_each_wire_row_once(fake_world, world: int, bits: int) -> None:
    from tensor_memory import TensorMemory

    fake_world(world)
    layout = ((300_000, True), (300_000, True), (4_096, False))  # rows of several 128 KiB pieces at 4 and 8 bits
    params = [ParamShard(n, n, world * n, 2 if q else 1, True) for n, q in layout]
    s_numel = sum(n for n, _ in layout)
    ag = QuantizedAllGather(get_codec("uniform", bits=bits, bucket_size=1024), QSDPCommState(seed=1), 0, params, 1024)
    group = dist.group.WORLD
    rank = group.rank()
    row_bytes = ag._row_codec(s_numel, torch.float32, params, ag.codec).row_nbytes(torch.float32)
    with TensorMemory() as mem:
        out = torch.empty(world * s_numel)
        inp = out.view(world, s_numel)[rank]  # FSDP2's layout: the input is the output's own row
        inp.copy_(torch.randn(s_numel))
        ag(out, inp, group)  # warm: caches, first-use work
        start = mem.mark()
        ag(out, inp, group)
        extra = mem.peak_since(start)
    assert row_bytes > 2 * (1 << 17)  # several pieces per row: the case that cut the rows
    assert extra <= (world + 1) * row_bytes + SLACK, (extra / row_bytes, world, bits)
