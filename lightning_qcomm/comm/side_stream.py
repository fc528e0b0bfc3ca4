"""Run a DDP comm hook's job on a side CUDA stream and hand DDP a future for it (docs/design.md, "QuantDDP").

A hook that encodes, communicates and decodes on the current stream makes that stream wait for NCCL at every
phase, so the backward kernels queued after the hook wait too: communication never overlaps backward.
Torch's own hooks return ``work.get_future()``; a multi-phase compressed collective has several works, so
the whole job runs on a side stream instead::

    side.wait_stream(current)          # the bucket's gradients are ready
    with torch.cuda.stream(side):
        result = job()                 # codec kernels and NCCL calls, all ordered on ``side``
        future.set_result(result)      # a CUDA-aware future: records an event on ``side``

DDP waits on the future at the end of backward, which makes its stream wait on that event (no host sync).
The host still issues the job inline; it returns as soon as the kernels are queued when the job has no host
syncs (tests/adapters/test_host_syncs.py). Tensors the job allocates belong to the side stream's pool; the bucket
buffer, allocated by DDP on the current stream, is marked as used by the side stream (``record_stream``).

Example::

    side = SideStream()
    return side.submit(job, bucket.buffer())   # in a comm hook, for a CUDA bucket
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SideStream:
    """One side stream per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def submit(self, job: Callable[[], torch.Tensor], buffer: torch.Tensor) -> torch.futures.Future:
        """Run ``job`` on the side stream of ``buffer``'s device after the work queued so far on the current
        stream; the returned future completes with ``job()``'s result, ordered after the side stream's work."""
        device = buffer.device
        side = self.stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        future: torch.futures.Future = torch.futures.Future(devices=[device])
        with torch.cuda.stream(side):
            buffer.record_stream(side)
            try:
                future.set_result(job())
            except BaseException as err:  # DDP would otherwise wait on the future forever
                future.set_exception(err)
                raise
        return future

    def run(self, job: Callable[[], object], device: torch.device) -> object:
        """``job()`` on the side stream of ``device`` (for jobs that complete futures themselves)."""
        side = self.stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            return job()


__all__ = ["SideStream"]
