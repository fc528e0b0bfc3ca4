"""The memory tests' shared pieces: a tensor counter that also counts the comm worker's thread, the deep narrow MLP
whose weights are one DDP / 1-bit bucket each, its training steps, and two gloo ranks' results.

``counted(mem)`` patches ``CommWorker._run_one`` while inside, so the buffers an overlapped collective makes on
the worker's thread count into ``mem`` (``benchmarks/tensor_memory.TensorMemory.in_thread``), as
``benchmarks/memory_per_method.py`` counts them.

Example::

    mem = TensorMemory()
    with counted(mem), mem:
        model = deep_mlp()
        ...
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from collections.abc import Callable, Iterator

import torch
from _launch import free_port, rank_results, spawn

WIDTH, LAYERS = 64, 16  # 16 weights of 64 x 64 (66,560 parameters): with 16 KB buckets, 17 buckets
BUCKET_MB = 4096 * 4 / 2**20  # 4096 fp32 elements: one weight per bucket


@contextlib.contextmanager
def counted(mem) -> Iterator[None]:
    """Count the comm worker's allocations into ``mem`` while inside."""
    from lightning_qcomm.comm.comm_worker import CommWorker

    run_one = CommWorker._run_one

    def run_counted(fn, fut):
        with mem.in_thread():
            run_one(fn, fut)

    CommWorker._run_one = staticmethod(run_counted)
    try:
        yield
    finally:
        CommWorker._run_one = staticmethod(run_one)


def deep_mlp(width: int = WIDTH, layers: int = LAYERS) -> torch.nn.Sequential:
    """``layers`` Linear(width, width) with Tanh between them (seeded by the caller)."""
    mods = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    return torch.nn.Sequential(*mods[:-1])


def train(ddp, opt, mem, rank: int, steps: int, counted_from: int, batch: int = 4) -> None:
    """``steps`` steps of cross-entropy on random rows (seeded by rank and step) through ``ddp``; ``mem``'s peak
    restarts at step ``counted_from``. The inputs are freed and garbage collected at the end."""
    for step in range(steps):
        if step == counted_from:
            mem.mark()
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(batch, WIDTH, generator=g), torch.randint(0, WIDTH, (batch,), generator=g)
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    del x, y, g
    gc.collect()


def two_rank_results(worker: Callable) -> list[dict]:
    """``worker(rank, world, port, outdir)`` on 2 spawned ranks; their ``write_rank_result`` dicts."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, 2, free_port(), tmp, nprocs=2)
        return rank_results(tmp, 2)
