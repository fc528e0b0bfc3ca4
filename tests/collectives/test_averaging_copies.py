"""Local SGD's averager writes a bucket's average back into its tensors in one multi-tensor copy.

On a GPU every op is a launch: a GPT-2-small parameter average wrote 148 tensors back one ``copy_`` each over 19
buckets; one ``torch._foreach_copy_`` per bucket is 19 launches. The values are the per-tensor copies'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from launch_counts import Launches  # noqa: E402  (the project's launch counter)

from lightning_qcomm.collectives.averaging import TensorAverager


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _tensors(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 2), (7,), (3, 3)]  # 12 + 5 + 8 + 7 + 9 = 41 elements
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_puts_each_span_into_its_tensor(fake_group, dtype):
    tensors = _tensors(dtype)
    avg = TensorAverager(tensors, bucket_numel=20)  # buckets of at most 20 elements: [12, 5], [8, 7], [9]
    flats = [-f.to(torch.float32) - 1 for f in avg.snapshot()]  # fp32, as a codec's averages come back
    expected = [t.to(torch.float32).neg().sub(1).to(dtype) for t in tensors]
    avg.write(flats)
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e)


def test_average_writes_each_bucket_back_in_one_copy(fake_group):
    tensors = _tensors()
    avg = TensorAverager(tensors, bucket_numel=20)
    assert avg.num_buckets == 3
    with Launches() as mode:
        avg.average()
    assert mode.torch_ops.count("copy_") == 0, mode.torch_ops
    assert mode.torch_ops.count("_foreach_copy_") == avg.num_buckets, mode.torch_ops
