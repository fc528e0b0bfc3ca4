"""The DDP hook's bucket plan: a bucket's segments gathered into one flat tensor and written back.

On a GPU every op is a launch: writing the averaged gradients back into a bucket of many parameters must be one
multi-tensor copy, not a copy per parameter (a GPT-2-small step has 96 such segments over 13 buckets)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from launch_counts import Launches  # noqa: E402  (the project's launch counter)

from lightning_qcomm.adapters.ddp.plan import gather_segments, scatter_segments

SEGMENTS = [(0, 5), (7, 3), (12, 9), (30, 1), (31, 4), (40, 8)]  # six, with gaps between some


def test_scatter_writes_every_segment_and_nothing_else():
    buf = torch.arange(48, dtype=torch.float32)
    flat = -torch.arange(1, 31, dtype=torch.float32)
    expected = buf.clone()
    pos = 0
    for off, n in SEGMENTS:
        expected[off : off + n] = flat[pos : pos + n]
        pos += n
    scatter_segments(buf, SEGMENTS, flat)
    assert torch.equal(buf, expected)
    assert torch.equal(gather_segments(buf, SEGMENTS), flat)


def test_scatter_is_one_multi_tensor_copy():
    buf, flat = torch.zeros(48), torch.randn(30)
    with Launches() as mode:
        scatter_segments(buf, SEGMENTS, flat)
    assert mode.torch_ops == ["_foreach_copy_"], mode.torch_ops


def test_scatter_of_a_view_copies_nothing():
    buf = torch.randn(48)
    flat = gather_segments(buf, [(4, 20)])  # one segment: a view of buf
    before = buf.clone()
    with Launches() as mode:
        scatter_segments(buf, [(4, 20)], flat)
    assert mode.torch_ops == [] and torch.equal(buf, before)
