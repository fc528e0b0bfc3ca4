"""The one greedy bucket planner (``comm.buckets.bucket_layout``) behind Local SGD's ``TensorAverager`` and
1-bit Adam's ``OneBitMomentumSync``: order kept, a bucket per key, oversize tensors alone."""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.collectives.averaging import TensorAverager
from lightning_qcomm.comm.buckets import bucket_layout


def test_one_open_bucket_per_key():
    assert bucket_layout([2, 2, 2], 4, keys=["a", "b", "a"]) == [[0, 2], [1]]
    assert bucket_layout([2, 2, 2], 4) == [[0, 1], [2]]  # one key: the greedy split in order
    assert bucket_layout([], 4) == []


def test_keys_must_match_the_tensors():
    with pytest.raises(ValueError, match="keys has 1 entries"):
        bucket_layout([1, 2], 4, keys=["a"])


def test_averager_buckets_by_dtype_and_skips_empty_tensors():
    f32, f16 = torch.float32, torch.float16
    tensors = [torch.zeros(3, dtype=f32), torch.zeros(3, dtype=f16), torch.zeros(0, dtype=f32)]
    tensors += [torch.zeros(3, dtype=f32), torch.zeros(10, dtype=f16), torch.zeros(4, dtype=f32)]
    avg = TensorAverager(tensors, None, bucket_numel=6)
    layout = [[next(i for i, t in enumerate(tensors) if t is m) for m in b.tensors] for b in avg._buckets]
    # f32: 3 + 3 fill a bucket, 4 opens the next; f16: 3, then 10 (over 6) alone; the empty tensor nowhere
    assert layout == [[0, 3], [1], [4], [5]]
    assert [b.numel for b in avg._buckets] == [6, 3, 10, 4]
