"""QSDP gradient reduce-scatters finished at the end of backward instead of inline (adapter layer; docs/design.md,
"QSDP", "Module notes").

FSDP2's ``foreach_reduce`` calls the custom reduce-scatter synchronously, then post-divides, casts, makes the
sharded gradients views of the output (or accumulates into them), runs post-accumulate-grad hooks and, under
HSDP, the all-reduce hook. When all of that only takes views (no cast, no existing gradient, no hook, no custom
divide factor) the call may return at once: encode, all-to-all and fp32 sum run on the comm worker into a private
buffer while backward goes on. One call is pending at a time: ``add`` first writes the calls before it (waiting for
their jobs), so a worker slower than backward holds one group's buffers, as FSDP2's own reduce-scatter does, and
``DeferredReduceScatters.flush`` (an autograd callback after FSDP2's own) writes the last one. Writing a call puts
its sum into its output and replays the division. The HSDP all-reduce hook may be deferred the same way.

Invariants: the values are those of the inline call (same seed, same rank-order sum, same division); backward
returns only once every gradient is final; ``deferrable(module)`` decides per call from FSDP2's internals
(``adapters.fsdp2.shim.output_only_viewed``), and on a torch whose ``foreach_reduce`` is not one of the reviewed
shapes every call runs inline, logged once.

Example::

    deferred = DeferredReduceScatters()
    deferred.add(worker.submit(job), output_tensor, total, post_divide=world)   # inside the custom reduce-scatter
    # ... backward continues; at its end ``flush`` writes ``output_tensor``
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_qcomm.adapters.fsdp2.shim import output_only_viewed

_DEFERRABLE_DTYPES = (torch.float32, torch.bfloat16)  # FSDP2 divides these by N after the call, nothing before it


class DeferredReduceScatters:
    """Reduce-scatters in flight in this backward, flushed (in call order) by an autograd final callback.

    A backward that raises runs no final callback: its calls stay pending. ``settle_stale`` writes them (as the
    flush would have) at the next QSDP collective, optimizer step or ``close``, so gradients that outlive the
    failed backward (kept and accumulated into, or stepped on) hold the inline call's values, not the unwritten
    output. Calls are told apart by autograd's graph-task id (-1 outside backward)."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, torch.futures.Future, torch.Tensor, torch.Tensor, float | None]] = []

    def add(self, future: torch.futures.Future, output: torch.Tensor, total: torch.Tensor, post_divide: float | None):
        """``future`` completes once ``total`` (fp32, the output's elements) holds the sum; then the output gets
        ``total`` and is divided by ``post_divide`` (None: not divided).

        One call in flight at a time: the calls added before this one are written first (waiting for their jobs),
        as the flush would write them. Their FSDP2 post-processing has returned (the main thread made this call
        since), so the values are the flush's; what it bounds is memory: a pending call holds its padded fp32
        input (N x the shard, in the job) and ``total`` until written, and a worker slower than backward would
        otherwise keep every group's at once, where FSDP2's own reduce-scatter keeps one group's."""
        # one callback per call, not per backward: extra callbacks of this backward find nothing left to do
        torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.flush()
        self._pending.append((torch._C._current_graph_task_id(), future, output, total, post_divide))

    def flush(self) -> None:
        """Wait for every deferred reduce-scatter and write its output (the autograd callback; idempotent)."""
        pending, self._pending = self._pending, []
        self._write(pending)

    def settle_stale(self) -> None:
        """Write the calls left by a backward other than the running one (one that raised); a no-op otherwise.
        Calls are kept in call order, so a failed backward's come first: the first entry tells (O(1) per call)."""
        task = torch._C._current_graph_task_id()
        if not self._pending or self._pending[0][0] == task:
            return
        first_current = next((i for i, entry in enumerate(self._pending) if entry[0] == task), len(self._pending))
        stale, self._pending = self._pending[:first_current], self._pending[first_current:]
        self._write(stale)

    @staticmethod
    def _write(pending) -> None:
        for _task, future, output, total, post_divide in pending:
            future.wait()
            output.copy_(total.view(output.shape))
            if post_divide is not None and post_divide != 1:
                output.div_(post_divide)

    def __len__(self) -> int:
        return len(self._pending)


def deferrable(module: torch.nn.Module, *, in_all_reduce_hook: bool = False) -> Callable[[torch.Tensor], bool]:
    """For an FSDP module: ``ok(input_tensor)``, whether its reduce-scatter of this call may be deferred (module doc).

    ``in_all_reduce_hook``: asked by the module's own all-reduce hook (``parallel.hsdp``) about its
    ``reduce_output``: the hook is then the reader of the output, not a reason to run inline, and FSDP2's
    post-divide after it is replayed at the flush (``fsdp_shim.post_divide_factor``)."""

    def ok(input_tensor: torch.Tensor) -> bool:
        if input_tensor.device.type != "cpu" or input_tensor.dtype not in _DEFERRABLE_DTYPES:
            return False
        return output_only_viewed(module, input_tensor.dtype, in_all_reduce_hook)

    return ok


__all__ = ["DeferredReduceScatters", "deferrable"]
