"""RowCodec joins adjacent raw segments (a transformer block's norms and biases) into one copy each way, and reads
aligned raw bytes in place: fewer torch ops per all-gather and reduce-scatter, the same wire bytes.

The wire is checked against its definition (tests/adapters/test_row_codec_layout.py's: a raw segment is its bytes, a
quantized one the codec's encode with ``derive_seed(seed, k)``, k its index among the segments), so joining raw
segments does not shift a quantized segment's seed. The op counts: a layout of many adjacent raw segments
dispatches the ops of the same layout with each run of them as one segment.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment
from lightning_qcomm.codecs import derive_seed, get_codec

# GPT-2 block's parameters in order (ln_1 w/b, c_attn w/b, c_proj w/b, ln_2 w/b, c_fc w/b, c_proj w/b), one rank's
# row at width 64 over 4 ranks: matrices quantized, vectors raw
D = 64
BLOCK = [(16, False), (16, False), (D * 3 * D // 4, True), (48, False), (D * D // 4, True), (16, False)]
BLOCK += [(16, False), (16, False), (D * 4 * D // 4, True), (64, False), (4 * D * D // 4, True), (16, False)]
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "as_strided", "alias", "detach"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in FREE:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _count(fn) -> list[str]:
    with _Ops() as mode:
        fn()
    return mode.ops


def _joined(segments: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
    out: list[tuple[int, bool]] = []
    for n, q in segments:
        if out and not q and not out[-1][1]:
            out[-1] = (out[-1][0] + n, False)
        else:
            out.append((n, q))
    return out


def _definition(rc: RowCodec, rows: torch.Tensor, seed: int) -> torch.Tensor:
    parts, off = [], 0
    for k, s in enumerate(rc.segments):
        x = rows[:, off : off + s.numel]
        off += s.numel
        if not s.quantize:
            parts.append(x.contiguous().view(torch.uint8))
        else:
            p = rc.codec.encode(x.reshape(-1), seed=derive_seed(seed, k))
            parts += [p.codes.view(rows.shape[0], -1), p.scales.reshape(rows.shape[0], -1).view(torch.uint8)]
    return torch.cat(parts, dim=1)


@pytest.fixture
def codec():
    return get_codec("uniform", bits=8, bucket_size=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_wire_is_the_definition_and_raw_segments_come_back_exact(codec, dtype):
    rc = RowCodec([Segment(n, q) for n, q in BLOCK], codec)
    rows = (torch.randn(4, rc.row_numel, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    wire = rc.encode(rows, seed=9)
    assert torch.equal(wire, _definition(rc, rows, 9))
    out = torch.full_like(rows, float("nan"))
    rc.decode(wire, out)
    off = 0
    for k, s in enumerate(rc.segments):
        got, want = out[:, off : off + s.numel], rows[:, off : off + s.numel]
        if s.quantize:
            ref = codec.decode(codec.encode(want.reshape(-1), seed=derive_seed(9, k))).view_as(want).to(dtype)
            assert torch.equal(got, ref), f"segment {k}"
        else:
            assert torch.equal(got, want), f"segment {k}"
        off += s.numel


def test_adjacent_raw_segments_cost_the_ops_of_one(codec, monkeypatch):
    from lightning_qcomm.codecs import cpu_fused

    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")  # the path an accelerator takes: the codec's ops, not C
    split = RowCodec([Segment(n, q) for n, q in BLOCK], codec)
    joined = RowCodec([Segment(n, q) for n, q in _joined(BLOCK)], codec)
    rows = torch.randn(4, split.row_numel, generator=torch.Generator().manual_seed(1))
    wire = split.encode(rows, seed=3)
    out = torch.empty_like(rows)
    assert _count(lambda: split.encode(rows, seed=3)) == _count(lambda: joined.encode(rows, seed=3))
    assert _count(lambda: split.decode(wire, out)) == _count(lambda: joined.decode(wire, out))


@pytest.mark.parametrize("offset", [0, 4, 2], ids=["aligned", "aligned-after-a-segment", "unaligned"])
def test_raw_bytes_are_read_in_place_where_aligned(offset):
    """A raw fp32 segment decodes in one copy where its bytes start on a multiple of 4 in every row, else through a
    contiguous copy first (two ops), with the same values."""
    rc = RowCodec([Segment(12, False)], None)
    rows = torch.randn(3, 12)
    buf = torch.zeros(3, 48 + offset, dtype=torch.uint8)
    buf[:, offset:] = rc.encode(rows, seed=0)
    out = torch.empty_like(rows)

    def decode():
        view = buf[:, offset:]
        rc.decode(view, out)

    ops = _count(decode)
    assert torch.equal(out, rows)
    assert ops == (["copy_"] if offset % 4 == 0 else ["clone", "copy_"]), ops
