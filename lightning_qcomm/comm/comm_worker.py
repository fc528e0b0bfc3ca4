"""A background thread that runs compressed collectives off the autograd thread (process layer).

DDP calls a comm hook from the backward pass and only waits for the returned future at the end of
backward. torch's own all-reduce hook on gloo returns at once (gloo runs the transfer on its own
threads), so the rest of the backward pass overlaps the communication. A hook that encodes, sends,
reduces and decodes inline blocks the backward pass for all of that time instead. ``CommWorker`` gives
such a hook the same overlap: ``submit(fn)`` queues ``fn`` and returns a ``torch.futures.Future`` that
completes with ``fn()``'s result (or its exception) once the worker thread has run it.

Ordering: jobs run one at a time, in submission order. Collectives issued by the worker must go through
a process group that nothing else uses concurrently (``dedicated_group``): two threads issuing
collectives on one gloo group could enqueue them in different orders on different ranks, and gloo
pairs operations by their order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit

log = logging.getLogger(__name__)

_STOP = object()


class CommWorker:
    """One daemon thread executing submitted jobs in FIFO order."""

    def __init__(self, name: str = "lightning_qcomm-comm") -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._run_one(*item)
            del item  # the job and its result are the waiter's now: this thread keeps no buffer alive between jobs

    @staticmethod
    def _run_one(fn: Callable[[], Any], fut: torch.futures.Future) -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the waiter, which re-raises it
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``fn``; the returned future holds its result (or raises its exception on ``wait``)."""
        self._ensure_started()
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((fn, fut))
        return fut

    def drain(self) -> None:
        """Block until every job submitted so far has run."""
        if self._thread is not None and self._thread.is_alive():
            self.submit(lambda: None).wait()

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent; ``submit`` restarts it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP)
            thread.join()


class FutureWork(dist.Work):
    """A ``torch.distributed`` ``Work`` for a job running on a ``CommWorker``: ``wait()`` blocks until the
    job's future completes and re-raises its exception (the Work that torch's ``_create_work_from_future``
    makes swallows it). Lets a custom collective that runs on the worker return what callers such as
    FSDP2 (``foreach_all_gather_copy_out``) wait on."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group``'s (default: the world's) collectives were created with, or None if this torch
    does not expose it (read from the backend's options)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or no options on this torch
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def dedicated_group(
    group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
) -> dist.ProcessGroup | None:
    """A new process group over the same ranks and backend as ``group`` (default: the world), for a ``CommWorker``.

    ``timeout``: its collectives' timeout; None inherits ``group``'s (``torch.distributed.new_group`` would
    otherwise give it torch's 30-minute default, whatever the user set). Collective: every rank of the world
    must call it, in the same order. Returns None when torch.distributed is not initialised (a world of one
    needs no group). On gloo the default group (and with it this one) is destroyed at exit
    (``process_group.destroy_gloo_group_at_exit``).

    Example::

        group = dedicated_group(ddp_model.process_group, timeout=timedelta(seconds=60))
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    backend = dist.get_backend(group)
    if timeout is None:
        timeout = group_timeout(group)
    destroy_gloo_group_at_exit()  # groups of ours alive at exit can abort the process in teardown
    log.debug(
        "lightning_qcomm: creating a %s process group over ranks %s for background collectives (timeout %s)",
        backend,
        ranks,
        timeout,
    )
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


_SHARED: dict[tuple, tuple[CommWorker, dist.ProcessGroup | None]] = {}


def group_is_live(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is still registered with torch.distributed (not destroyed since it was made)."""
    return group is None or group in dist.distributed_c10d._world.pg_map


def shared_background(
    name: str, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
) -> tuple[CommWorker, dist.ProcessGroup | None]:
    """This process's one ``CommWorker`` and dedicated group for ``name`` over ``group``'s ranks (default: the
    world), made on first use (collective: ``dedicated_group``) and handed to every later caller with the same name,
    ranks, backend and timeout, so objects made again and again (an optimizer per fit, a ``LocalSGD`` per run) do not
    each add a process group for the life of the process. Sharing is safe: one thread runs every holder's jobs in
    submission order, which is the same on every rank. A group destroyed since (``destroy_process_group``) is
    replaced.

    Example::

        worker, group = shared_background("lightning_qcomm-onebit")       # the same pair on the next call
    """
    if not (dist.is_available() and dist.is_initialized()):
        return CommWorker(name), None
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    key = (name, ranks, dist.get_backend(group), timeout)
    shared = _SHARED.get(key)
    if shared is None or not group_is_live(shared[1]):
        shared = _SHARED[key] = (CommWorker(name), dedicated_group(group, timeout=timeout))
    return shared


def shared_node_background(name: str, topology: Any, timeout: timedelta | None = None) -> tuple[CommWorker, Any]:
    """This process's one ``CommWorker`` for ``name`` and a second set of ``topology``'s node groups
    (``comm.topology.node_groups``: every rank creates every node's groups, so all ranks must call it, in the same
    order) that nothing else uses, made on first use and shared as ``shared_background`` shares its pair. A per-rank
    subgroup (one node's ranks, or one rank per node) cannot be copied with ``dedicated_group``: each rank would
    create only its own.

    Example::

        worker, lanes = shared_node_background("lightning_qcomm-qsdp", Topology(world_size=4, node_size=2))
        worker.submit(lambda: dist.all_reduce(t, group=lanes.inter))
    """
    from lightning_qcomm.comm.topology import node_groups

    key = (name, "nodes", topology, timeout)
    shared = _SHARED.get(key)
    if shared is None or not (group_is_live(shared[1].intra) and group_is_live(shared[1].inter)):
        shared = _SHARED[key] = (CommWorker(name), node_groups(topology, timeout=timeout))
    return shared


class BackgroundComm:
    """A ``CommWorker`` and the process group dedicated to it (``shared_background``), taken on first use and then
    reused, so a strategy that sets up again (a later Trainer stage, a second ``fit``) creates no other group.

    Example::

        background = BackgroundComm("lightning_qcomm-qsdp", timeout=timedelta(minutes=30))
        worker, group = background.acquire(mesh.get_group())   # collective the first time
        background.close()                                      # stops the thread; ``acquire`` restarts it
    """

    def __init__(self, name: str = "lightning_qcomm-comm", timeout: timedelta | None = None) -> None:
        self.name = name
        self.timeout = timeout
        self.worker: CommWorker | None = None
        self.group: dist.ProcessGroup | None = None

    def acquire(self, group: dist.ProcessGroup | None = None) -> tuple[CommWorker, dist.ProcessGroup | None]:
        """The worker and its group over ``group``'s ranks. Collective on the first call (``dedicated_group``)."""
        if self.worker is None:
            self.worker, self.group = shared_background(self.name, group, self.timeout)
        return self.worker, self.group

    def acquire_nodes(self, topology: Any) -> tuple[CommWorker, Any]:
        """The worker and a second set of ``topology``'s node groups (``shared_node_background``). Collective on the
        first call, on every rank of the world."""
        worker, lanes = shared_node_background(self.name, topology, self.timeout)
        self.worker = worker
        return worker, lanes

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


__all__ = [
    "BackgroundComm",
    "CommWorker",
    "FutureWork",
    "dedicated_group",
    "group_is_live",
    "group_timeout",
    "shared_background",
    "shared_node_background",
]
