"""Replay of a saved DDP bucket layout over DDP's current buckets, so a resumed run compresses as the
uninterrupted one did (adapter layer; used by ``adapters.ddp.hooks``; docs/design.md, "QuantDDP").

Why: a bucket's compressed all-reduce depends on which parameters share it (chunks, scale buckets, seed). DDP
starts every run, a resumed one too, on its initial buckets and rebuilds them after the first iteration in
gradient-ready order, so a resumed run would take its first step on other buckets than the uninterrupted one.

What: the hook state saves the members of every bucket it reduces. After a load, until DDP's buckets are those
again, the hook gathers the gradients of DDP's current buckets into *virtual* buckets with the saved members and
reduces each exactly as the real bucket of that index was (same seed, error-feedback buffer, element order), then
writes the results back. A virtual bucket runs once its last member has arrived; the future of a real bucket
completes once every virtual bucket holding one of its members is written back. Arrival order is DDP's bucket
order, identical on all ranks, so every rank issues the same collectives in the same order. The replay ends after
the first round in which DDP's buckets equal the saved ones, or, if they never do (another ``bucket_cap_mb``),
after that round with a warning.

Example::

    replay = LayoutReplay([("head.weight", "head.bias"), ("stem.weight", "stem.bias")], params_by_name)
    future = replay.hook(state, bucket)   # instead of reducing ``bucket`` itself
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class VirtualBucket:
    """The part of ``dist.GradBucket`` the hook's job reads: an index, its parameters and a flat buffer."""

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], buffer: torch.Tensor) -> None:
        self._index, self._params, self._buffer = index, list(params), buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return False  # the real bucket that completes the round advances the round counter


@dataclass
class _Waiting:
    """A real bucket whose future completes once the virtual buckets holding its members are done."""

    future: torch.futures.Future
    buffer: torch.Tensor
    groups: set[int]


@dataclass
class _Round:
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> slice of a real bucket's buffer
    missing: list[set[str]] = field(default_factory=list)  # per virtual bucket: members not arrived yet
    done: set[int] = field(default_factory=set)  # virtual buckets already scheduled
    waiting: list[_Waiting] = field(default_factory=list)
    matched: bool = True  # every real bucket so far had exactly the saved members


class LayoutReplay:
    """Reduce DDP's gradients by a saved bucket layout (``layout[i]`` = member names of bucket ``i``).

    Args:
        layout: the saved buckets, by index: parameter names in DDP's bucket order.
        params_by_name: the live parameters under the names the layout uses.
    """

    def __init__(self, layout: Sequence[Sequence[str]], params_by_name: dict[str, torch.nn.Parameter]) -> None:
        self.layout = [tuple(names) for names in layout]
        self.params_by_name = params_by_name
        self.group_of = {name: g for g, names in enumerate(self.layout) for name in names}
        self.rounds = 0
        self.active = True
        self._round = self._new_round()

    @staticmethod
    def matches(layout: Sequence[Sequence[str]], names: set[str]) -> bool:
        """Whether ``layout`` partitions exactly ``names`` (the parameters DDP reduces now)."""
        flat = [n for members in layout for n in members]
        return len(flat) == len(set(flat)) and set(flat) == names

    def _new_round(self) -> _Round:
        return _Round(missing=[set(names) for names in self.layout])

    def hook(
        self,
        bucket: dist.GradBucket,
        names: Sequence[str],
        make_job: Callable[[VirtualBucket], Callable[[], torch.Tensor]],
        submit: Callable[[Callable[[], torch.Tensor]], object] | None,
        advance_round: Callable[[], None],
        devices: list[torch.device] | None = None,
    ) -> torch.futures.Future:
        """Register ``bucket`` (its parameters are ``names``), schedule the virtual buckets it completes and
        return the future DDP waits on for it.

        ``make_job(vb)`` does the bookkeeping of one virtual bucket on this thread and returns its job;
        ``submit`` runs a job on the comm worker or a side stream (None: inline); ``advance_round`` is called
        after the round's last real bucket, as for an unreplayed bucket; ``devices``: the CUDA devices the
        futures are ordered on (CUDA-aware futures, for a job on a side stream).
        """
        rnd = self._round
        buf = bucket.buffer()
        rnd.matched &= bucket.index() < len(self.layout) and tuple(names) == self.layout[bucket.index()]
        groups, ready, off = set(), [], 0
        for p, name in zip(bucket.parameters(), names):
            rnd.views[name] = buf[off : off + p.numel()]
            off += p.numel()
            g = self.group_of[name]
            groups.add(g)
            rnd.missing[g].discard(name)
            if not rnd.missing[g] and g not in rnd.done:
                ready.append(g)
                rnd.done.add(g)
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        rnd.waiting.append(_Waiting(future, buf, groups))
        jobs = []
        for g in ready:  # bookkeeping (seed, error buffer, round) now, on the autograd thread
            members = self.layout[g]
            flat = torch.cat([rnd.views[n].reshape(-1) for n in members])
            vb = VirtualBucket(g, [self.params_by_name[n] for n in members], flat)
            jobs.append((members, [rnd.views[n] for n in members], vb, make_job(vb)))
        complete = [w for w in rnd.waiting if w.groups <= rnd.done]
        rnd.waiting = [w for w in rnd.waiting if not w.groups <= rnd.done]
        last = bucket.is_last()
        if last:
            self._end_round(rnd)
            advance_round()

        def run() -> torch.Tensor:
            try:
                for _members, views, vb, job in jobs:
                    job()
                    out = vb.buffer()
                    pos = 0
                    for view in views:
                        view.copy_(out[pos : pos + view.numel()].view_as(view))
                        pos += view.numel()
                for w in complete:
                    w.future.set_result(w.buffer)
            except BaseException as err:  # fail every future still open, or DDP would wait on them forever
                for w in complete + rnd.waiting:
                    if not w.future.done():
                        w.future.set_exception(err)
                raise
            return buf

        if submit is None:
            run()
        else:
            submit(run)
        return future

    def _end_round(self, rnd: _Round) -> None:
        unfinished = [g for g, missing in enumerate(rnd.missing) if missing]
        if unfinished or rnd.waiting:
            raise RuntimeError(
                f"quant_ddp: replaying the checkpoint's bucket layout, members of buckets {unfinished} never "
                "arrived in this backward pass (a parameter without a gradient needs find_unused_parameters=True)"
            )
        self.rounds += 1
        if rnd.matched:
            log.debug("quant_ddp: DDP's buckets equal the checkpoint's again; replay ends")
            self.active = False
        elif self.rounds >= 2:
            log.warning(
                "quant_ddp: DDP's bucket layout still differs from the checkpoint's after it rebuilt its buckets "
                "(another bucket_cap_mb?); compressing by DDP's own buckets from now on, so this resumed run "
                "departs from the uninterrupted one"
            )
            self.active = False
        self._round = self._new_round()


__all__ = ["LayoutReplay", "VirtualBucket"]
