"""``benchmarks/tensor_memory.TensorMemory``: live and peak bytes per storage, and by owner."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from tensor_memory import TensorMemory, owners  # noqa: E402


def test_adamw_live_bytes_by_owner_views_and_frees():
    with TensorMemory() as mem:
        model = torch.nn.Linear(100, 10, bias=False)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(4, 100)
        model(x).sum().backward()
        opt.step()
        start = mem.mark()
        big = torch.zeros(1000)  # 4000 bytes, then a view and an in-place op: no new storage
        big.view(10, 100).add_(1)
        del big
        gc.collect()
    groups = mem.by_owner(owners(model, opt))
    assert groups["parameters"] == groups["gradients"] == 4000
    assert groups["optimizer state"] == 8000 + 4  # m, v and the fp32 step count
    assert mem.peak_since(start) == 4000
    assert mem.live == start  # the freed tensor is off again
    assert mem.alive(x) and not mem.alive(torch.zeros(3))
