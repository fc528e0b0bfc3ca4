"""Local SGD's parameter average overlapped with the next round (entry-point layer; docs/design.md, "The average
overlapped with the next round").

With ``LocalSGDConfig(overlap=True)`` each rank snapshots its parameters s_k at the end of round k, starts their
average A_k on a ``CommWorker`` over groups of its own (``AveragingLane``) and trains round k+1 on; at its end it
swaps the snapshot for the average, keeping its progress: x <- A_k + (x - s_k) (``"nesterov"``: the outer step from
A_k instead of A_k), CoCoD-SGD's update. The last scheduled sync and every ``LocalSGD.sync()`` first finish the
pending average, then average inline, so evaluated and saved replicas are equal.

Invariants: an average's values are those of the inline averager on the snapshot (same averager, seed and bytes);
at most one average is in flight; in delta mode only the worker touches the anchor while an average is in flight.
Memory: the snapshot and the buffer in flight.

Example::

    lane = AveragingLane(group=None)                       # collective: a process group of its own
    params = [p for p in model.parameters() if p.requires_grad]
    overlap = OverlappedAverage(TensorAverager(params, group=lane.group), lane.worker)
    overlap.launch(round_idx=0)                            # returns at once; training goes on
    ...                                                    # H local steps
    overlap.finish()                                       # x <- A_0 + (x - s_0)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_qcomm.collectives.averaging import TensorAverager
from lightning_qcomm.comm.comm_worker import CommWorker, shared_background, shared_node_background
from lightning_qcomm.comm.topology import NodeGroups
from lightning_qcomm.parallel.outer_optim import NesterovOuterOptimizer


class AveragingLane:
    """A ``CommWorker`` and process groups nothing else uses: a copy of ``group`` (default the world), or with
    ``groups`` (``scope="inter_node"``) a second set of node groups over the same topology. Collective the first
    time; later lanes over the same ranks reuse the worker and groups (``comm_worker.shared_background``).

    Example::

        lane = AveragingLane(group=None)
        lane.worker.submit(lambda: dist.all_reduce(t, group=lane.group)).wait()
        lane.close()                                        # stops the thread; a later submit restarts it
    """

    def __init__(self, group: dist.ProcessGroup | None = None, groups: NodeGroups | None = None) -> None:
        self.node_groups: NodeGroups | None = None
        self.group: dist.ProcessGroup | None = None
        if groups is None:
            self.worker, self.group = shared_background("lightning_qcomm-local-sgd", group)
            return
        self.worker, self.node_groups = shared_node_background("lightning_qcomm-local-sgd", groups.topology)

    def close(self) -> None:
        self.worker.close()


class OverlappedAverage:
    """At most one average of ``averager``'s tensors in flight on ``worker`` (see the module docstring).

    Args:
        averager: the parameters' averager, over the lane's groups (its tensors are the trainable parameters).
        worker: the lane's worker.
    """

    def __init__(self, averager: TensorAverager, worker: CommWorker) -> None:
        self.averager = averager
        self.worker = worker
        self._future: torch.futures.Future | None = None
        self._snapshot: list[torch.Tensor] | None = None

    @property
    def pending(self) -> bool:
        """Whether an average is in flight (started and not yet applied)."""
        return self._future is not None

    def launch(self, round_idx: int, check: bool | None = None) -> None:
        """Snapshot the parameters and start their average on the worker (collective, in the background)."""
        if self._future is not None:
            raise RuntimeError("OverlappedAverage.launch: an average is already in flight; finish() it first")
        averager = self.averager
        snapshot = averager.snapshot()
        # the plain and value-quantized averages reduce their input in place; the delta form sends a difference
        send = snapshot if averager.delta else [s.clone() for s in snapshot]
        self._future = self.worker.submit(lambda: averager.reduce_flats(send, round_idx, check))
        self._snapshot = snapshot

    @torch.no_grad()
    def finish(self, outer: NesterovOuterOptimizer | None = None) -> bool:
        """Wait for the average in flight and apply it, x <- A + (x - s), or with ``outer`` x <- θ_g' + (x - s)
        (the outer step taken from θ̄ = A; the quantization anchor moves to θ_g'). False when none was in flight."""
        if self._future is None:
            return False
        future, snapshot = self._future, self._snapshot
        self._future = self._snapshot = None
        averaged = future.wait()
        averager = self.averager
        progress = [x.to(torch.float32).sub_(s) for x, s in zip(averager.snapshot(), snapshot, strict=True)]
        del snapshot
        if outer is None:
            base = averaged
        else:
            averager.write(averaged)
            outer.step()  # the parameters become θ_g'
            averager.reset_anchor()
            base = averager.snapshot()
        averager.write([d.add_(b) for d, b in zip(progress, base, strict=True)])
        return True

    def discard(self) -> None:
        """Wait for the average in flight (every rank takes part) and drop it (the parameters are being replaced)."""
        if self._future is not None:
            future, self._future, self._snapshot = self._future, None, None
            future.wait()


__all__ = ["AveragingLane", "OverlappedAverage"]
