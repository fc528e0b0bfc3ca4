"""FSDP2 comm adapters for QSDP: quantized weight all-gather and gradient reduce-scatter (adapter layer;
docs/design.md, "QSDP").

The objects installed by ``adapters.fsdp2.install`` implement FSDP2's custom ``AllGather`` / ``ReduceScatter``
(reached through ``adapters.fsdp2.shim``). Each row of FSDP2's flat buffer (the padded dim-0 shards of a param
group's parameters) travels in ``RowCodec``'s wire format, on the collectives' engine: the all-gather encodes this
rank's row and every rank decodes all N rows (its own included), so every rank computes with identical weights;
the reduce-scatter encodes N rows, all-to-all, and sums the received rows in fp32 in rank order, the own row
exact. With a ``CommWorker`` on CPU the all-gather (and a reduce-scatter whose output is only viewed,
``adapters.fsdp2.deferred``) run on that thread. Unquantized calls (width 32) are FSDP2's own collective.

Invariants: seeds fold in (seed, kind, step, group, rank, segment), so the forward all-gather and the backward
re-gather of a shard in one step give the same codes; reduce-scatters fold in a per-step call counter (fresh
rounding per micro-batch); ``"auto"`` widths read ``QSDPCommState.trial`` when a call is made; every call records
one ledger entry (tags ``weights`` / ``grads``, ``@intra`` under HSDP). Buffer layout and details:
docs/design.md, "Module notes".

Example::

    state = QSDPCommState(seed=0, step=0)
    install_qsdp_comms(model, QSDPCommConfig(weight_codec, grad_codec, 1024, ""), state)   # on every FSDPModule
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_qcomm._log import log_once
from lightning_qcomm.adapters.fsdp2 import gather_region
from lightning_qcomm.adapters.fsdp2.deferred import DeferredReduceScatters
from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment, is_quantized_param
from lightning_qcomm.adapters.fsdp2.shim import (
    AllGather,
    ParamShard,
    ReduceScatter,
    check_fsdp_param_internals,
    check_torch_fsdp_api,
    fsdp_param_shards,
    install_requires_grad_syncs,
    sync_unsharded_requires_grad,
)
from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.codecs.base import FLOAT_DTYPES
from lightning_qcomm.collectives.engine import run_all_gather, run_reduce_scatter
from lightning_qcomm.comm.auto_trial import WidthTrial
from lightning_qcomm.comm.comm_worker import CommWorker, FutureWork
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.transport import PieceLayout

log = logging.getLogger(__name__)

SEED_WEIGHTS = 1
SEED_GRADS = 2
SEED_MASTER = 3
FP32_BYTES = 4  # the baseline the ledger compares against: fp32 elements

__all__ = [
    "ParamShard",
    "QSDPCommState",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "RowCodec",
    "Segment",
    "check_fsdp_param_internals",
    "check_torch_fsdp_api",
    "fsdp_param_shards",
    "install_requires_grad_syncs",
    "is_quantized_param",
    "sync_unsharded_requires_grad",
]


@dataclass
class QSDPCommState:
    """Mutable state shared by all comms of one strategy: the user seed, the optimizer step, and with an
    ``"auto"`` width the trial that sets each step's width."""

    seed: int = 0
    step: int = 0
    trial: WidthTrial | None = None
    deferred: DeferredReduceScatters = field(default_factory=DeferredReduceScatters)


# --------------------------------------------------------------------------- FSDP2 comms
class _QSDPComm:
    """Shared parts: allocation, layout selection, bookkeeping."""

    def __init__(
        self,
        codec: Codec | None | Mapping[int, Codec | None],
        state: QSDPCommState,
        group_id: int,
        params: Sequence[ParamShard],
        min_quant_numel: int,
        scope: str = "",
    ) -> None:
        # one codec per width (the trial's width of this step picks one), or the one codec of every call
        self._by_width = dict(codec) if isinstance(codec, Mapping) else None
        self._codec = None if isinstance(codec, Mapping) else codec
        self.state = state
        self.group_id = int(group_id)
        self.params = list(params)
        self.min_quant_numel = int(min_quant_numel)
        self.scope = scope  # the ledger tags' suffix: "" (the whole world) or "@intra" (a node's group)

    @property
    def codec(self) -> Codec | None:
        """The codec of this call (None: unquantized)."""
        if self._by_width is None:
            return self._codec
        return self._by_width[self.state.trial.width(self.state.step)]

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _row_codec(
        self, row_numel: int, dtype: torch.dtype, params: Sequence[ParamShard], codec: Codec | None
    ) -> RowCodec:
        wanted, codec = codec, codec if dtype in FLOAT_DTYPES else None
        if codec is None and wanted is not None:
            log_once(log, f"dtype{dtype}", f"QSDP: FSDP buffer of dtype {dtype} is not floating; sent unquantized")
        if sum(p.padded_shard_numel for p in params) == row_numel:
            segs = [Segment(p.padded_shard_numel, is_quantized_param(p, self.min_quant_numel)) for p in params]
        else:
            log_once(
                log,
                "layout",
                f"QSDP: FSDP buffer row of {row_numel} elements does not match the param layout "
                f"{[p.padded_shard_numel for p in params]}; quantizing the row as one segment",
            )
            segs = [Segment(row_numel, True)]
        return RowCodec(segs, codec)


class QuantizedAllGather(_QSDPComm, AllGather):
    """FSDP2 all-gather of weight shards with every rank decoding every shard (its own included).

    With a ``worker`` (a ``CommWorker``) and its ``worker_group`` (same ranks as FSDP's group, used by
    nothing else), CPU calls run encode, transfer and decode on the worker thread and return a
    ``FutureWork`` that FSDP2 waits on before it reads the gathered weights; a prefetched group's
    all-gather then overlaps the current group's compute. The seed is fixed when the call is made, so the
    result is bit-identical to the inline call.

    Memory: rows cut into transfer pieces (CPU rows past ``transport.TRANSFER_PIECE_BYTES``, decoded a row at a
    time) are gathered into the output's own last bytes and decoded in an order that reads each wire row before it
    is written over (``adapters.fsdp2.gather_region``): beside FSDP2's output the call holds the encoded own row
    (P) during the transfer, then copies of the k wire rows that overlap the output rows still to decode (k P at
    most, about N P / U + 1 of N rows of U bytes). Rows gathered whole (CUDA, small CPU rows) keep a separate
    buffer, (N + 1) P, so that their decode stays one launch for all N rows.
    """

    def __init__(self, *args, worker: CommWorker | None = None, worker_group: dist.ProcessGroup | None = None, **kw):
        super().__init__(*args, **kw)
        if worker is not None and worker_group is None:
            raise ValueError(
                "QuantizedAllGather: a worker needs its own worker_group (see comm_worker.dedicated_group)"
            )
        self.worker = worker
        self.worker_group = worker_group

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> FutureWork | None:
        self.state.deferred.settle_stale()  # a backward that raised left its deferred calls unwritten
        codec = self.codec  # read when the call is made: a queued job must not see a later step's width
        if codec is None:  # unquantized: FSDP2's own collective, no encode / decode copies
            world, nbytes = group.size(), input_tensor.numel() * input_tensor.element_size()
            work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            _record("all_gather", world * nbytes, world * input_tensor.numel(), world, nbytes, "weights" + self.scope)
            return work
        rank = group.rank()
        seed = derive_seed(self.state.seed, SEED_WEIGHTS, self.state.step, self.group_id, rank)
        if self.worker is None or input_tensor.device.type != "cpu":
            self._gather(output_tensor, input_tensor, group, seed, codec)
            return None
        if (self.worker_group.size(), self.worker_group.rank()) != (group.size(), rank):
            raise ValueError(
                f"QuantizedAllGather: worker_group (size {self.worker_group.size()}, rank {self.worker_group.rank()}) "
                f"does not match FSDP's group (size {group.size()}, rank {rank})"
            )
        job = functools.partial(self._gather, output_tensor, input_tensor, self.worker_group, seed, codec)
        return FutureWork(self.worker.submit(job))

    def _gather(self, output_tensor, input_tensor, group: dist.ProcessGroup, seed: int, codec: Codec) -> None:
        world = group.size()
        s_numel = input_tensor.numel()
        rc = self._row_codec(s_numel, input_tensor.dtype, self.params, codec)
        layout = PieceLayout.for_rows(world, rc.row_nbytes(input_tensor.dtype), input_tensor.device)
        rows = output_tensor.view(world, s_numel)
        # rows cut into pieces (CPU) decode a row at a time anyway: their wire rows go in the output's last bytes;
        # rows gathered whole (CUDA) keep a separate buffer and decode in one launch
        into = gather_region.region(output_tensor, layout) if layout.pieced else None

        def decode_rows(wire: torch.Tensor, j0: int, j1: int) -> None:
            rc.decode(wire, rows[j0:j1])

        def decode(gathered: torch.Tensor) -> int:
            if into is not None:
                gather_region.decode_in_place(gathered, layout, rows, decode_rows)
            elif not layout.pieced:
                rc.decode(gathered.view(world, -1), rows)
            else:
                scratch = torch.empty(layout.row_bytes, dtype=torch.uint8, device=gathered.device)
                for j in range(world):  # the rows gathered piece by piece: one row's bytes at a time
                    rc.decode(layout.read_row(gathered, j, scratch).view(1, -1), rows[j : j + 1])
            return layout.row_bytes

        encode = lambda: rc.encode(input_tensor.reshape(1, s_numel), seed).reshape(-1)  # noqa: E731
        p = run_all_gather(encode, decode, group, world, layout=layout, into=into)
        _record("all_gather", world * p, world * s_numel, world, p, "weights" + self.scope)


class QuantizedReduceScatter(_QSDPComm, ReduceScatter):
    """FSDP2 reduce-scatter of gradients: quantized rows, all-to-all, fp32 sum (precision preserving).

    Received rows are decoded one at a time and added in rank order into an fp32 total (the output itself
    when it is a contiguous fp32 buffer); besides the wire buffers the extra memory is one fp32 row and one
    wire row whatever the world size (the send buffer is freed before the decode). The own row never leaves
    the rank and enters the sum exactly. Raw segments (biases, norms) travel in the gradient dtype and are
    widened exactly, so with bf16/fp16 gradients they come back as the fp32 sum of the ranks' values, rounded
    once to the output dtype.

    ``live_requires_grad`` (optional) returns the group's current ``requires_grad`` flags in param order:
    FSDP2 leaves parameters without a gradient out of the buffer, and which ones those are can change
    between steps (``toggle_optimizer``); without it the flags read at installation are used.
    """

    def __init__(
        self,
        *args,
        live_requires_grad: Callable[[], list[bool]] | None = None,
        worker: CommWorker | None = None,
        worker_group: dist.ProcessGroup | None = None,
        deferrable: Callable[[torch.Tensor], bool] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._live_requires_grad = live_requires_grad
        self.worker, self.worker_group, self._deferrable = worker, worker_group, deferrable
        self._call_step = -1
        self._calls = 0

    def _layout(self, s_numel: int) -> list[ParamShard]:
        if sum(p.padded_shard_numel for p in self.params) == s_numel:
            return self.params
        flags = self._live_requires_grad() if self._live_requires_grad is not None else None
        if flags is None:
            flags = [p.requires_grad for p in self.params]
        return [p for p, flag in zip(self.params, flags) if flag]  # params without a grad this step are left out

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> None:
        self.state.deferred.settle_stale()  # a backward that raised left its deferred calls unwritten
        if op == dist.ReduceOp.SUM:
            divide = False
        elif op == dist.ReduceOp.AVG:
            divide = True
        else:
            raise NotImplementedError(
                f"QSDP reduce-scatter supports ReduceOp SUM and AVG, got {op}; call "
                "set_force_sum_reduction_for_comms(True) on the FSDP module"
            )
        world, rank = group.size(), group.rank()
        s_numel = output_tensor.numel()
        if input_tensor.numel() != world * s_numel:
            raise ValueError(f"reduce-scatter input has {input_tensor.numel()} elements, expected {world}x{s_numel}")
        codec = self.codec
        if codec is None and input_tensor.dtype == torch.float32:  # unquantized: FSDP2's own collective
            nbytes = input_tensor.numel() * FP32_BYTES
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            if divide:
                output_tensor.div_(world)
            _record("reduce_scatter", nbytes, input_tensor.numel(), world, nbytes, "grads" + self.scope)
            return None
        if self._call_step != self.state.step:
            self._call_step, self._calls = self.state.step, 0
        self._calls += 1
        rc = self._row_codec(s_numel, input_tensor.dtype, self._layout(s_numel), codec)
        seed = derive_seed(self.state.seed, SEED_GRADS, self.state.step, self.group_id, rank, self._calls)
        if self.worker is not None and not divide and self._deferrable is not None and self._deferrable(input_tensor):
            # the rest of backward runs meanwhile; the sum is written into the output at its end (adapters.fsdp2.deferred)
            total = torch.empty(s_numel, dtype=torch.float32, device=input_tensor.device)
            job = functools.partial(self._sum_rows, total, input_tensor, rc, seed, self.worker_group)
            self.state.deferred.add(self.worker.submit(job), output_tensor, total, float(world))
            return None
        direct = output_tensor.dtype == torch.float32 and output_tensor.is_contiguous()
        total = (
            output_tensor.view(-1) if direct else torch.empty(s_numel, dtype=torch.float32, device=input_tensor.device)
        )
        self._sum_rows(total, input_tensor, rc, seed, group)
        if divide:
            total.div_(world)
        if not direct:
            output_tensor.copy_(total.view(output_tensor.shape))
        return None

    def _sum_rows(self, total: torch.Tensor, input_tensor: torch.Tensor, rc: RowCodec, seed: int, group) -> None:
        """Encode the N rows, all-to-all, decode and add the received rows in rank order into ``total`` (fp32)."""
        world, rank = group.size(), group.rank()
        s_numel = total.numel()
        rows, device = input_tensor.view(world, s_numel), input_tensor.device
        layout = PieceLayout.for_rows(world, rc.row_nbytes(input_tensor.dtype), device)

        def reduce(recv: torch.Tensor) -> int:  # the send buffer is freed by now: it reads the received rows only
            if rc.sum_into(recv, rows, rank, total, layout):
                return recv.numel()  # the segment ops: every row decoded and summed in one launch
            row = torch.empty(s_numel, dtype=torch.float32, device=device) if world > 1 else total
            scratch = torch.empty(layout.row_bytes, dtype=torch.uint8, device=device) if layout.pieced else None
            for j in range(world):  # rank order, the same order on every rank
                dst = total if j == 0 else row
                if j == rank:
                    dst.copy_(rows[rank])  # the own row never left this rank: keep it exact
                else:
                    wire = layout.read_row(recv, j, scratch).view(1, -1)
                    rc.decode(wire, dst.view(1, s_numel), wire_dtype=input_tensor.dtype)
                if j > 0:
                    total.add_(row)  # in place: the closure only reads the name
            return recv.numel()

        encode = lambda: rc.encode(rows, seed, layout.empty(device), layout)  # noqa: E731
        nbytes = run_reduce_scatter(encode, reduce, group, world, layout=layout)
        _record("reduce_scatter", nbytes, world * s_numel, world, nbytes, "grads" + self.scope)


def _record(op: str, collective_bytes: int, logical_numel: int, world: int, payload_bytes: int, tag: str) -> None:
    """One ledger entry; the baseline is fp32 for the ``logical_numel`` elements of the whole buffer."""
    get_ledger().record(op, collective_bytes, logical_numel * FP32_BYTES, world, payload_bytes=payload_bytes, tag=tag)
