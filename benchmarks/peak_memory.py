"""Peak memory of a callable, measured from the allocator, not from a sum of tensors.

* CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated`` after the call, less what was
  allocated before it.
* CPU: the profiler's memory events (``profile_memory=True``): every allocation and free of the CPU allocator
  during the call, summed in time order; the peak of that running sum. Scratch buffers inside kernels are
  counted too (they go through the same allocator). The profiler slows the call down; its events are read
  from ``prof.profiler.kineto_results`` (the profiler's own result object).

Both report bytes above the memory in use when the call starts: what the call adds at its worst moment
(activations, their gradients, temporaries; not parameters or optimizer state that exist before it).

    peak, _ = peak_bytes(lambda: model(x).sum().backward())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def peak_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[int, Any]:
    """(peak bytes allocated above the starting point during ``fn()``, ``fn()``'s result)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort()
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, out
