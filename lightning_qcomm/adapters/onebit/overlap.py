"""1-bit momentum buckets launched from backward, as their gradients become ready (adapter layer; docs/design.md,
"1-bit Adam").

After the freeze 1-bit Adam's one collective is the momentum average; inline it starts only after backward.
``BackwardLauncher`` starts each bucket of a ``OneBitMomentumSync`` while backward still runs, as DDP does: a
``post_accumulate_grad_hook`` marks each parameter ready once its gradient is final (tied ones after every use);
buckets launch in a fixed order, the last first, bucket k only after those before it, so every rank issues the same
collectives in the same order whatever order its hooks fire in; launching computes the members' new momenta out of
place (``candidate``: m' = β1 m + (1-β1) g) and queues ``sync.reduce_bucket_wire`` on a ``CommWorker`` over a group
of its own; ``finish()`` (the optimizer step) launches what no hook completed, waits, and returns the averages in
their 1-bit wire form (``OneBitWire``, 1/32 of the momenta; the step decodes one bucket at a time). A bucket's fp32
candidate lives until its collective has read it; a hook that would launch one while ``MAX_IN_FLIGHT`` run waits
for the oldest (memory: docs/design.md, "1-bit Adam").

Invariants: the values are those of the inline ``sync_`` (same layout, candidate arithmetic, error buffers;
``decode()`` gives the same bits); only when each bucket starts differs. Which parameters must report is read at
the first hook of a backward. A second gradient for a parameter before ``finish()`` raises: its bucket may already
be on the wire.

Example::

    launcher = BackwardLauncher(sync, params, candidate, worker, group)   # hooks registered now
    loss.backward()                                                      # buckets start during backward
    averaged = [w.decode() for w in launcher.finish()]                   # one fp32 flat per bucket, all ranks equal
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from lightning_qcomm.adapters.onebit.sync import DecodedAverage, OneBitMomentumSync
from lightning_qcomm.collectives.sign_collective import OneBitWire
from lightning_qcomm.comm.comm_worker import BackgroundComm, CommWorker
from lightning_qcomm.comm.topology import NodeGroups

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # buckets launched whose collective may still be running (their fp32 candidates alive)


def _on_grad(launcher: weakref.ref, i: int, param: torch.Tensor) -> None:
    target = launcher()
    if target is not None:
        target._on_grad(i, param)


class BackwardLauncher:
    """Launch ``sync``'s buckets from ``params``' gradient hooks; ``finish()`` waits for them (module doc).

    Args:
        sync: the momentum layout and its error buffers.
        params: the layout's tensors' parameters, in ``sync``'s tensor order.
        candidate: bucket members (indices into ``params``) -> their new momenta, concatenated, fp32.
        worker: the thread that runs the collectives.
        group: the group they run on (a dedicated one: nothing else may use it meanwhile), or ``NodeGroups``.
    """

    def __init__(
        self,
        sync: OneBitMomentumSync,
        params: list[torch.Tensor],
        candidate: Callable[[list[int]], torch.Tensor],
        worker: CommWorker,
        group: dist.ProcessGroup | NodeGroups | None,
    ) -> None:
        self.sync = sync
        self.params = params
        self.candidate = candidate
        self.worker = worker
        self.group = group
        self.bucket_of = {i: b for b, members in enumerate(sync.buckets) for i in members}
        self.order = list(reversed(range(len(sync.buckets))))
        self.launched_in_backward = 0  # buckets the last step started from a hook (the rest: finish())
        # the hooks hold the launcher weakly: a discarded optimizer leaves inert hooks behind, not a live launcher
        me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(partial(_on_grad, me, i)) for i, p in enumerate(params)]
        self._reset()

    def _reset(self) -> None:
        self._missing: list[set[int]] | None = None  # read at the first hook of a backward
        self._seen: set[int] = set()
        self._next = 0  # position in self.order
        self._inflight: dict[int, torch.futures.Future] = {}
        self._from_hooks = 0

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        if i in self._seen:
            raise RuntimeError(
                f"OneBitAdam(overlap=True): parameter {i} of the momentum layout (shape {tuple(self.params[i].shape)}) "
                "received a second gradient before the optimizer step; its 1-bit bucket may already be on the wire. "
                "With gradient accumulation or several backward passes per step use overlap=False"
            )
        self._seen.add(i)
        if self._missing is None:
            self._missing = [{j for j in members if self.params[j].requires_grad} for members in self.sync.buckets]
        self._missing[self.bucket_of[i]].discard(i)
        while self._next < len(self.order) and not self._missing[self.order[self._next]]:
            self._launch(self.order[self._next])
            self._from_hooks += 1

    def _launch(self, b: int) -> None:
        if self._next >= MAX_IN_FLIGHT:  # the worker runs jobs in order: this one done, so are all before it
            self._inflight[self.order[self._next - MAX_IN_FLIGHT]].wait()  # re-raises its error here, in backward
        flat = self.candidate(self.sync.buckets[b])  # the job holds it: freed once the collective has read it
        self._inflight[b] = self.worker.submit(partial(self.sync.reduce_bucket_wire, b, flat, self.group))
        self._next += 1

    def finish(self) -> list[OneBitWire | DecodedAverage]:
        """Launch the buckets no hook completed, wait for all; every bucket's average in its wire form
        (``decode()``: the fp32 flat, identical on every rank), in bucket order. Re-raises a collective's error."""
        self.launched_in_backward = self._from_hooks
        try:
            while self._next < len(self.order):
                self._launch(self.order[self._next])
            return [self._inflight[b].wait() for b in range(len(self.sync.buckets))]
        finally:
            self._reset()

    def close(self) -> None:
        """Remove the hooks; wait for buckets still in flight."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for future in self._inflight.values():
            future.wait()
        self._reset()


class MomentumOverlap:
    """Whether a OneBitAdam overlaps its momentum buckets with backward, and the launcher once it does.

    ``start`` makes the launcher after the first compression step (every rank reaches it at the same step: the
    dedicated group is made then, collectively) unless overlap is off, the world is one rank, the momenta are not on
    the CPU (CUDA overlap needs side streams, not a thread: the reference path, logged once), or ``disable`` gave a
    reason (the Lightning callback: gradient accumulation or clipping).
    """

    def __init__(self, enabled: bool, timeout: timedelta | None = None) -> None:
        self.enabled = enabled
        self.off_reason: str | None = None if enabled else "overlap=False"
        self.launcher: BackwardLauncher | None = None
        self._background = BackgroundComm("lightning_qcomm-onebit", timeout=timeout)
        self._node_worker: CommWorker | None = None
        self._logged = False

    def disable(self, reason: str) -> None:
        """Run the momentum sync after backward from now on (``reason`` is logged once)."""
        self.off_reason = reason
        self.close()

    def start(
        self,
        sync: OneBitMomentumSync,
        params: list[torch.Tensor],
        candidate: Callable[[list[int]], torch.Tensor],
        group: dist.ProcessGroup | NodeGroups | None,
    ) -> None:
        if self.launcher is not None:
            return
        reason = self.off_reason
        if reason is None and sync.world_size() == 1:
            reason = "one rank"
        if reason is None and any(p.device.type != "cpu" for p in params):
            reason = "overlap runs on a CPU thread; on CUDA the momentum buckets are averaged after backward"
        if reason is not None:
            if not self._logged and self.enabled:
                self._logged = True
                log.info("OneBitAdam: 1-bit momentum averaged after backward (%s)", reason)
            return
        if isinstance(group, NodeGroups):  # our own groups, used by nothing else: the worker may use them
            self._node_worker = self._node_worker or CommWorker("lightning_qcomm-onebit")
            worker, run_on = self._node_worker, group
        else:
            worker, run_on = self._background.acquire(group)
        self.launcher = BackwardLauncher(sync, params, candidate, worker, run_on)
        log.info("OneBitAdam: %d 1-bit momentum bucket(s) start during backward", len(sync.buckets))

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None


__all__ = ["MAX_IN_FLIGHT", "BackwardLauncher", "MomentumOverlap"]
