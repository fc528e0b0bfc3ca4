"""Local SGD's parameter average overlapped with the next round (entry-point layer).

With ``LocalSGDConfig(overlap=True)`` a scheduled average no longer stops training (docs/design.md, "Local SGD
and QSR"). At the end of round k each rank takes a flat copy s_k of its parameters and starts their average
A_k = mean_r s_k^(r) on a ``CommWorker`` over process groups of its own (``AveragingLane``), and trains round
k+1 on from its own parameters x. At the end of round k+1 it waits for A_k and swaps the snapshot for the
average, keeping the progress it made meanwhile:

    x <- A_k + (x - s_k)                                     (outer_optimizer="average")
    x <- θ_g' + (x - s_k),   θ_g' = the outer step from θ̄ = A_k   (outer_optimizer="nesterov")

and then snapshots x and starts the next average. This is CoCoD-SGD's update (Shen et al. 2019) and, with the
outer step, DiLoCo's outer step delayed by one round: every average a rank applies is one round old, and the
replicas differ by their last round's progress. They are made equal by an exact, inline average where that
matters: the last scheduled sync (step == total_steps) and every ``LocalSGD.sync()`` (evaluation, checkpoints)
first finish the pending average, then average inline.

Invariants: the values an average produces are those of the inline averager on the snapshot (same averager,
same seed per round, same bytes); at most one average is in flight; with a codec in delta mode the anchor moves
to A_k on the worker, and only the worker touches it while an average is in flight. Memory: the snapshot and
the buffer in flight, one flat copy of the trainable parameters each (the delta codecs send their own fp32
difference instead of the second copy).

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
