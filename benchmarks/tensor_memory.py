"""Live and peak tensor bytes, counted per storage: memory per rank as the tensors see it (CPU tests, benchmarks).

``TensorMemory`` is a ``TorchDispatchMode``: every tensor an op returns while it is active has its storage recorded
once (keyed by the storage itself, its bytes ``nbytes()``), and a ``weakref.finalize`` on the storage takes the bytes
off when the storage is freed. So at any moment::

    live = Σ nbytes(s) over recorded storages s still alive        peak = max over time of live

A view, an in-place op or a ``copy_`` into an existing tensor adds nothing (same storage); the storages of tensors
made before the mode (a model built outside it) are added with ``adopt``. What it sees: every storage allocated
through the dispatcher on the threads where the mode is active, the C++ ones included (DDP's reducer buckets,
autograd's saved tensors, a collective's output), whether Python can reach them or not; ``in_thread`` enters it on
another thread (a comm worker's). What it does not see: allocator slack and scratch memory inside kernels (the
CPU profiler's ``peak_memory.peak_bytes`` and CUDA's ``max_memory_allocated`` count those), storages allocated
outside the dispatcher (``torch.from_numpy``).

``by_owner`` splits the live bytes among named groups of tensors (parameters, gradients, optimizer state, a
strategy's state ...), each storage counted once, under the first group that holds it, the rest under ``"other"``;
``owners`` builds the usual groups from a model and an optimizer. ``peak_since(mark)`` is the peak above the live
bytes at ``mark()``: what a step adds at its worst moment (its transient buffers).

On a GPU the benchmark reads ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` instead (``cuda_bytes``).

Example::

    with TensorMemory() as mem:
        model = torch.nn.Linear(1000, 1000)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, 1000)).sum().backward(); opt.step()
    mem.live, mem.peak                                   # 16 B/param live: p, grad, m, v (+ the bias and input)
    mem.by_owner(owners(model, opt))                     # {"parameters": 4004000, "gradients": ..., ...}
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2's parameters): this rank's shard
    if isinstance(local, torch.Tensor):
        t = local
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    try:
        s = t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage
        return None
    return s if s.nbytes() > 0 else None


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the storages created while active (module docstring).

    Args:
        where: keep the Python stack of the allocation that last raised the peak in ``peak_stack`` (slow).

    Attributes:
        live: bytes of the recorded storages alive now.
        peak: the largest ``live`` seen since the mode was made (or since ``mark``).
    """

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.where = where  # keep the Python stack of the allocation that set the peak (``peak_stack``)
        self.peak_stack: list[str] = []
        self._sizes: dict[int, int] = {}  # storage's _cdata -> bytes recorded
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._record(t)
        return out

    def _record(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is None:
            return
        key, nbytes = s._cdata, s.nbytes()
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                self._sizes[key] = nbytes
                weakref.finalize(s, self._free, key)
            elif old != nbytes:  # resized in place
                self._sizes[key] = nbytes
            else:
                return
            self.live += nbytes - (old or 0)
            if self.live > self.peak:
                self.peak = self.live
                if self.where:
                    self.peak_stack = traceback.format_stack(limit=12)

    def _free(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (made before the mode, e.g. a model's parameters) as live."""
        for t in tensors:
            self._record(t)

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[None]:
        """Count the calling thread's allocations (a comm worker's) into this mode's totals while inside."""
        with _Follower(self):
            yield

    # ------------------------------------------------------------------ reading
    def mark(self) -> int:
        """The live bytes now, and the peak restarts from them (``peak_since`` reads what comes after)."""
        with self._lock:
            self.peak = self.live
            return self.live

    def peak_since(self, mark: int) -> int:
        """Peak bytes above ``mark`` (a value returned by ``mark()``)."""
        return self.peak - mark

    def alive(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one of the recorded live ones."""
        s = _storage(t)
        return s is not None and s._cdata in self._sizes

    def by_owner(self, groups: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, int]:
        """Live bytes per named group of tensors (each storage once, under the first group holding it); the live
        storages of no group under ``"other"``. Storages of a group that were never recorded are not counted."""
        with self._lock:
            sizes = dict(self._sizes)
        out: dict[str, int] = {}
        for name, tensors in groups.items():
            total = 0
            for t in tensors:
                s = _storage(t)
                if s is not None and s._cdata in sizes:
                    total += sizes.pop(s._cdata)
            out[name] = out.get(name, 0) + total
        out["other"] = out.get("other", 0) + sum(sizes.values())
        return out


class _Follower(TorchDispatchMode):
    """A mode of its own on another thread (dispatch modes are per thread) that records into ``leader``."""

    def __init__(self, leader: TensorMemory) -> None:
        super().__init__()
        self.leader = leader

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.leader._record(t)
        return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def owners(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extra: Any
) -> dict[str, list[torch.Tensor]]:
    """The usual owner groups: ``parameters`` (and buffers), ``gradients``, ``optimizer state`` (every tensor in
    ``optimizer.state``), then each ``extra`` name with the tensors found in its value (lists, dicts, tuples)."""
    params = list(model.parameters()) + list(model.buffers())
    groups: dict[str, list[torch.Tensor]] = {
        "parameters": params,
        "gradients": [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None],
    }
    if optimizer is not None:
        groups["optimizer state"] = _tensors([dict(s) for s in optimizer.state.values()])
    for name, value in extra.items():
        groups[name.replace("_", " ")] = _tensors(value)
    return groups


def cuda_bytes(device: torch.device | str | None = None) -> tuple[int, int]:
    """(``memory_allocated``, ``max_memory_allocated``) of a CUDA device: the GPU's live and peak bytes."""
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


__all__ = ["TensorMemory", "cuda_bytes", "owners"]
