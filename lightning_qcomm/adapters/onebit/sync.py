"""1-bit Adam's collectives (adapter layer; docs/design.md, "1-bit Adam"): the fused momentum sync and the warm-up
DDP hook; nothing of Lightning or of the optimizer's math.

``OneBitMomentumSync`` averages a fixed list of tensors (the momenta) over ranks: laid out in order into flat fp32
buckets of at most ``bucket_numel`` elements, each bucket one ``onebit_all_reduce`` with its own per-rank error
buffers (two collectives per bucket; about 1/32 of an fp32 all-reduce's bytes). With a ``comm.topology.NodeGroups``
each bucket goes through ``hierarchical_onebit_all_reduce`` (exact inside a node, 1-bit across nodes).
``rank_state_dict`` / ``load_rank_state_dict`` hold the error buffers, which differ per rank; a saved state loads
only into the same layout, world size and topology (else ValueError; the caller decides to reset).
``sync_(tensors, read_only=...)`` lets a tensor take part without being overwritten.

``OneBitGradHookState`` + ``onebit_adam_grad_hook``: the warm-up's DDP hook, an fp32 average through
``quantized_all_reduce(codec=None)`` (ledger tag ``"grads"``) until ``state.compressing``, then nothing.
Details: docs/design.md, "Module notes".

No ``from __future__ import annotations`` here: DDP checks a hook's annotations against real classes.

Example::

    sync = OneBitMomentumSync([p.numel() for p in params], bucket_numel=1 << 23)
    sync.sync_([optimizer.state[p]["exp_avg"] for p in params])     # identical on every rank
"""

import logging

import torch
import torch.distributed as dist

from lightning_qcomm.collectives.hierarchical import hierarchical_onebit_all_reduce, shard_numel
from lightning_qcomm.collectives.quantized import quantized_all_reduce
from lightning_qcomm.collectives.sign_collective import (
    DEFAULT_ONEBIT_PIECE_NUMEL,
    OneBitWire,
    check_block_numel,
    onebit_all_reduce,
    onebit_all_reduce_wire,
    onebit_server_error_numel,
)
from lightning_qcomm.comm.buckets import bucket_layout
from lightning_qcomm.comm.side_stream import SideStream
from lightning_qcomm.comm.topology import NodeGroups

log = logging.getLogger(__name__)


class DecodedAverage:
    """A bucket's average held decoded (the hierarchical all-reduce ends in an exact fp32 all-gather inside the
    node: there is no 1-bit form to keep), with ``OneBitWire``'s ``finite`` and ``decode``."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat

    def finite(self) -> torch.Tensor:
        return self.flat.isfinite().all()

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.flat if out is None else out.copy_(self.flat)


class OneBitMomentumSync:
    """Error-compensated 1-bit average of a fixed list of tensors over flat fused buckets (see module doc).

    Args:
        numels: element counts of the tensors, in the order ``sync_`` will receive them.
        bucket_numel: maximum elements per flat bucket (>= 1).
        process_group: the group to average over (None: the default group, or a world of one when
            torch.distributed is not initialised); a ``NodeGroups``: hierarchically over the default group.
        tag: ledger tag of the collectives.
        piece_numel: ``onebit_all_reduce``'s pipelining piece (elements per rank). It decides where each
            server-error element belongs, so it is part of the saved layout. None (the default): chosen on the
            first sync from the buffers' device (``resolve_piece_numel``): ``DEFAULT_ONEBIT_PIECE_NUMEL`` on the
            CPU (gloo gains from pipelining pieces), else one piece per bucket (NCCL runs a group's collectives
            in order on one stream: pieces gain no overlap there and multiply the kernel launches); or a saved
            layout's value (``load_rank_state_dict``).
        block_numel: elements per 1-bit scale (``onebit_all_reduce``; None: one scale per chunk). It changes
            the code, not the error buffers' layout: saved buffers load across block sizes.
    """

    def __init__(
        self,
        numels: list[int],
        bucket_numel: int,
        process_group: dist.ProcessGroup | NodeGroups | None = None,
        tag: str = "momentum",
        piece_numel: int | None = None,
        block_numel: int | None = None,
    ) -> None:
        check_block_numel(block_numel, "OneBitMomentumSync")
        if piece_numel is not None and (
            not isinstance(piece_numel, int) or isinstance(piece_numel, bool) or piece_numel < 1
        ):
            raise ValueError(
                f"OneBitMomentumSync(piece_numel={piece_numel!r}): allowed None (chosen from the device on the "
                "first sync) or an int >= 1 (elements per rank per piece)"
            )
        if not numels:
            raise ValueError("numels must name at least one tensor")
        self.numels = [int(n) for n in numels]
        self.buckets = bucket_layout(self.numels, bucket_numel)
        self.bucket_numels = [sum(self.numels[i] for i in b) for b in self.buckets]
        self.process_group = process_group
        self.tag = tag
        self.piece_numel: int | None = piece_numel
        self.block_numel = block_numel
        self.worker_error: list[torch.Tensor] | None = None
        self.server_error: list[torch.Tensor] | None = None
        self._checked = [False] * len(self.buckets)

    def world_size(self) -> int:
        if isinstance(self.process_group, NodeGroups):
            return self.process_group.topology.world_size
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def topology(self) -> list[int] | None:
        """[num_nodes, node_size] when hierarchical (the error buffers are this rank's shard's), else None."""
        if not isinstance(self.process_group, NodeGroups):
            return None
        return [self.process_group.topology.num_nodes, self.process_group.topology.node_size]

    def _error_numels(self, n: int) -> tuple[int, int]:
        """(worker, server) error elements of a bucket of ``n`` elements on this rank."""
        groups = self.process_group
        if isinstance(groups, NodeGroups):
            c = shard_numel(n, groups.topology.node_size)
            return c, onebit_server_error_numel(c, groups.inter)
        return n, onebit_server_error_numel(n, groups)

    def resolve_piece_numel(self, device: torch.device) -> int:
        """The pipelining piece for buffers on ``device`` when none is set (``piece_numel`` None): on the CPU
        ``DEFAULT_ONEBIT_PIECE_NUMEL``; elsewhere ceil(w / N) with w the largest bucket's worker-error elements
        (its shard when hierarchical) and N the ranks of its 1-bit all-reduce, so every bucket is one piece.

        Example::

            OneBitMomentumSync([10, 7, 30], bucket_numel=20).resolve_piece_numel(torch.device("cuda"))   # 30 at N = 1
        """
        if device.type == "cpu":
            return DEFAULT_ONEBIT_PIECE_NUMEL
        groups = self.process_group
        ranks = groups.topology.num_nodes if isinstance(groups, NodeGroups) else self.world_size()
        widest = max(self._error_numels(n)[0] for n in self.bucket_numels)
        return max(1, -(-widest // ranks))

    def _ensure_errors(self, device: torch.device) -> None:
        if self.piece_numel is None:
            self.piece_numel = self.resolve_piece_numel(device)
        if self.worker_error is None:
            sizes = [self._error_numels(n) for n in self.bucket_numels]
            self.worker_error = [torch.zeros(w, dtype=torch.float32, device=device) for w, _ in sizes]
            self.server_error = [torch.zeros(s, dtype=torch.float32, device=device) for _, s in sizes]

    def sync_(self, tensors: list[torch.Tensor], read_only: list[bool] | None = None) -> None:
        """Replace every tensor by the compressed average over ranks, in place (same values on all ranks).

        ``read_only[i]`` True: tensor i enters the average (and its error buffers move on) but is not
        overwritten. The flags must be equal on all ranks.
        """
        if len(tensors) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} tensors, got {len(tensors)}")
        if read_only is None:
            read_only = [False] * len(tensors)
        elif len(read_only) != len(tensors):
            raise ValueError(f"read_only has {len(read_only)} flags; allowed: one per tensor ({len(tensors)})")
        for i, (t, n) in enumerate(zip(tensors, self.numels)):
            if t.numel() != n:
                raise ValueError(f"tensor {i} has {t.numel()} elements, the layout expects {n}")
        self._ensure_errors(tensors[0].device)
        for b, members in enumerate(self.buckets):
            parts = [tensors[i].detach().reshape(-1) for i in members]
            # one fp32 contiguous tensor: reduce it in place (a copy if read-only); otherwise a fused fp32 copy
            if len(parts) > 1:
                flat = torch.cat(parts).to(torch.float32)
            else:
                flat = parts[0].to(torch.float32, copy=read_only[members[0]])
            self.reduce_bucket_(b, flat)
            self.scatter_bucket_(b, flat, tensors, read_only)

    def reduce_bucket_(
        self, b: int, flat: torch.Tensor, process_group: dist.ProcessGroup | NodeGroups | None = None
    ) -> torch.Tensor:
        """Bucket ``b``'s error-compensated 1-bit average of ``flat`` (its members concatenated, fp32), in place.

        ``process_group``: the group to run it on (None: ``self.process_group``); a group over the same ranks, such
        as ``comm_worker.dedicated_group``'s for a background thread. Buckets are independent: their order of
        calls does not change any value, but it must be the same on every rank.
        """
        group = self.process_group if process_group is None else process_group
        reduce = hierarchical_onebit_all_reduce if isinstance(group, NodeGroups) else onebit_all_reduce
        return self._run(reduce, b, flat, group)

    def reduce_bucket_wire(
        self, b: int, flat: torch.Tensor, process_group: dist.ProcessGroup | NodeGroups | None = None
    ) -> OneBitWire | DecodedAverage:
        """``reduce_bucket_`` with the average kept in its 1-bit wire form (``OneBitWire``: 1/32 of ``flat``'s
        bytes, ``decode()`` gives the same bits) and ``flat`` only read, so a caller holding many buckets' averages
        holds their payloads, not their fp32 values. Hierarchically the average is held decoded
        (``DecodedAverage``), in ``flat``."""
        group = self.process_group if process_group is None else process_group
        if isinstance(group, NodeGroups):
            return DecodedAverage(self._run(hierarchical_onebit_all_reduce, b, flat, group))
        return self._run(onebit_all_reduce_wire, b, flat, group)

    def _run(self, reduce, b: int, flat: torch.Tensor, group):
        """``reduce`` (a 1-bit all-reduce of ``collectives``) of bucket ``b``'s ``flat`` with its error buffers."""
        self._ensure_errors(flat.device)
        out = reduce(
            flat,
            self.worker_error[b],
            self.server_error[b],
            group,
            tag=self.tag,
            check=not self._checked[b],
            piece_numel=self.piece_numel,
            block_numel=self.block_numel,
        )
        self._checked[b] = True
        return out

    def scatter_bucket_(
        self, b: int, flat: torch.Tensor, tensors: list[torch.Tensor], read_only: list[bool] | None = None
    ) -> None:
        """Copy bucket ``b``'s averaged ``flat`` back into its member tensors (not into read-only ones)."""
        members = self.buckets[b]
        for i, piece in zip(members, torch.split(flat, [self.numels[i] for i in members])):
            if (read_only is None or not read_only[i]) and piece.data_ptr() != tensors[i].data_ptr():
                tensors[i].copy_(piece.view_as(tensors[i]))

    # ------------------------------------------------------------------ per-rank state
    def rank_state_dict(self) -> dict:
        """This rank's error buffers (CPU fp32 copies) with the layout they belong to."""
        return {
            "numels": list(self.numels),
            "bucket_numels": list(self.bucket_numels),
            "world_size": self.world_size(),
            "piece_numel": self.piece_numel,
            "topology": self.topology(),
            "worker_error": None
            if self.worker_error is None
            else [t.detach().cpu().clone() for t in self.worker_error],
            "server_error": None
            if self.server_error is None
            else [t.detach().cpu().clone() for t in self.server_error],
        }

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore error buffers saved by ``rank_state_dict`` on this rank; ValueError if the layout differs.

        A sync whose piece is not chosen yet (``piece_numel`` None, no sync run) takes the saved piece, so an exact
        resume keeps the saved layout; a set piece must equal the saved one. Buffers saved without a piece (an
        earlier version) belong to no known layout.
        """
        saved_piece = state.get("piece_numel")  # absent: saved before the piece was recorded
        piece = saved_piece if self.piece_numel is None else self.piece_numel
        mine = (self.numels, self.bucket_numels, self.world_size(), piece, self.topology())
        saved = (list(state["numels"]), list(state["bucket_numels"]), int(state["world_size"]), saved_piece)
        theirs = (*saved, state.get("topology"))  # absent: flat
        if mine != theirs or (saved_piece is None and state["worker_error"] is not None):
            raise ValueError(
                "saved 1-bit error buffers belong to another layout (tensor numels, bucket numels, world size, "
                f"piece, topology): saved {theirs[1]} buckets over {theirs[2]} ranks in pieces of {theirs[3]} "
                f"(topology {theirs[4]}), now {mine[1]} over {mine[2]} in pieces of {mine[3]} (topology {mine[4]})"
            )
        self.piece_numel = piece
        if state["worker_error"] is None:
            self.worker_error = self.server_error = None
            return
        self.worker_error = [t.to(torch.float32).clone() for t in state["worker_error"]]
        self.server_error = [t.to(torch.float32).clone() for t in state["server_error"]]

    def to(self, device: torch.device) -> "OneBitMomentumSync":
        """Move the error buffers (e.g. after loading CPU copies) to ``device``."""
        if self.worker_error is not None:
            self.worker_error = [t.to(device) for t in self.worker_error]
            self.server_error = [t.to(device) for t in self.server_error]
        return self


class OneBitGradHookState:
    """State of ``onebit_adam_grad_hook``: the process group and whether the warm-up is over."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.compressing = False  # set by the owner once the optimizer froze its variance
        self.side_stream = SideStream()  # CUDA buckets: the all-reduce overlaps the rest of backward


def onebit_adam_grad_hook(state: OneBitGradHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: fp32 average of the bucket during warm-up (ledger tag "grads"); local gradient after.

    Register with ``ddp_model.register_comm_hook(state, onebit_adam_grad_hook)``. DDP's bucket shapes
    agree across ranks by construction, so the cross-rank consistency check is skipped. On CUDA the average
    runs on a side stream (``comm.side_stream``) and the future is ordered after it.
    """
    buf = bucket.buffer()

    def average() -> torch.Tensor:
        quantized_all_reduce(buf, None, group=state.process_group, op="avg", tag="grads", check=False)
        return buf

    if not state.compressing and buf.is_cuda:
        return state.side_stream.submit(average, buf)
    if not state.compressing:
        average()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


__all__ = [
    "DecodedAverage",
    "OneBitGradHookState",
    "OneBitMomentumSync",
    "bucket_layout",
    "onebit_adam_grad_hook",
]
