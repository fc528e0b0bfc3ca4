"""FSDP2 comm adapters for QSDP: quantized weight all-gather and gradient reduce-scatter (docs/design.md, "QSDP").

This file owns the bridge between FSDP2's flat communication buffers and the codecs. FSDP2 (torch >= 2.9)
lets a module replace its collectives with ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``; the objects installed here implement those interfaces
(``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``: ``allocate`` plus
``__call__``). They run synchronously and return ``None``, except the all-gather when given a
``CommWorker``: on CPU it then runs on that thread and returns a ``FutureWork`` (FSDP2 waits on it before
reading the gathered weights), so a prefetched group's all-gather overlaps compute.

Buffer layout (torch 2.13 ``_fsdp_collectives``): one FSDP param group = one flat buffer per collective.
Per rank, the buffer is the concatenation, in ``fsdp_params`` order, of each parameter's *padded* dim-0
shard (``padded_sharded_param_size``). The all-gather input is this rank's row (a view of the output at
``rank * S``); the output is N such rows. The reduce-scatter input is N rows (row j goes to rank j) with
the same per-row layout (only parameters that have a gradient this step); the output is one row.

Each row is split into *segments*, one per parameter shard. A segment is quantized with the codec when
the parameter is "large" (``ndim >= 2`` and ``numel >= min_quant_numel``, the CGX rule) and travels raw in
the buffer dtype otherwise (norm gains, biases). Quantized segments are bucketed on their own, so a
bucket never mixes two parameters' scales. The wire row is ``[seg_0 bytes | seg_1 bytes | ...]`` with
``codec.nbytes(n)`` bytes (codes, then fp32 scales) per quantized segment: a pure function of the layout,
so no sizes are exchanged.

* All-gather (weights): this rank encodes its row, ``all_gather_single`` of the bytes (``all_gather_bytes``:
  concurrent pieces on gloo), then every rank decodes all N rows, its own included, so every rank computes
  with identical weights.
* Reduce-scatter (grads): encode each of the N rows, ``all_to_all_single`` (``all_to_all_bytes``), decode the received rows to
  fp32, replace the own row by its exact value (it never left the rank), sum in fp32 and write the shard.
  ``set_force_sum_reduction_for_comms(True)`` makes FSDP pass ``SUM`` and divide by N itself.

Seeds: ``derive_seed(seed, kind, step, group_id, rank, segment, ...)`` with ``step`` read from the shared
``QSDPCommState`` (the strategy advances it once per optimizer step). The codec RNG is counter-based, so
the forward all-gather and the backward re-gather of the same shard in the same step produce the same
codes: forward and backward see the same quantized weights. Reduce-scatters also fold in a per-step call
counter, so gradient-accumulation micro-batches get fresh rounding.

Every call records one entry into ``get_ledger()`` (tags ``"weights"`` / ``"grads"``): payload = bytes this
rank handed to torch.distributed; baseline = 4 bytes per logical element (fp32).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_qcomm.codecs import Codec, Packed, derive_seed
from lightning_qcomm.codecs.base import FLOAT_DTYPES
from lightning_qcomm.comm.collectives import all_gather_bytes, all_to_all_bytes
from lightning_qcomm.comm.comm_worker import CommWorker, FutureWork
from lightning_qcomm.comm.ledger import get_ledger

log = logging.getLogger(__name__)

SEED_WEIGHTS = 1
SEED_GRADS = 2
SEED_MASTER = 3
FP32_BYTES = 4

_logged: set[str] = set()


def _log_once(key: str, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg)


def has_custom_comms() -> bool:
    """Whether this torch's FSDP2 supports ``set_custom_all_gather`` (torch >= 2.9)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")


@dataclass
class QSDPCommState:
    """Mutable state shared by all comms of one strategy: the user seed and the optimizer step."""

    seed: int = 0
    step: int = 0


@dataclass(frozen=True)
class ParamShard:
    """What the comms need to know about one parameter of an FSDP param group."""

    padded_shard_numel: int  # elements of this param in one rank's row
    shard_numel: int  # real (unpadded) elements of this rank's shard; a prefix of the padded one
    numel: int  # elements of the whole (unsharded) parameter
    ndim: int
    requires_grad: bool


def _fsdp_params(module: torch.nn.Module) -> list:
    """The ``FSDPParam`` objects of ``module``'s (single) FSDP param group; [] if it owns no params.

    Reads FSDP2 internals (``_get_fsdp_state()._fsdp_param_groups[0].fsdp_params``), pinned to torch 2.9-2.13.
    """
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return []
    if len(groups) > 1:
        raise ValueError(
            f"module {type(module).__name__} has {len(groups)} FSDP param groups (shard_placement_fn with "
            "per-param meshes); QSDP comms support one group per fully_shard call"
        )
    return list(groups[0].fsdp_params)


def _param_shard(fp) -> ParamShard:
    if fp.fsdp_placement.dim != 0:
        raise ValueError(f"QSDP comms need dim-0 sharding, got Shard({fp.fsdp_placement.dim}) for {fp}")
    return ParamShard(
        padded_shard_numel=fp.padded_sharded_param_size.numel(),
        shard_numel=fp.sharded_size.numel(),
        numel=fp._orig_size.numel(),
        ndim=len(fp._orig_size),
        requires_grad=fp.sharded_param.requires_grad,
    )


def fsdp_param_shards(module: torch.nn.Module) -> list[ParamShard]:
    """The per-parameter row layout of ``module``'s FSDP param group, in buffer order."""
    return [_param_shard(fp) for fp in _fsdp_params(module)]


def is_quantized_param(p: ParamShard, min_quant_numel: int) -> bool:
    """Large matrices are quantized; vectors (norms, biases) and small tensors travel raw."""
    return p.ndim >= 2 and p.numel >= min_quant_numel


# --------------------------------------------------------------------------- row codec
@dataclass(frozen=True)
class Segment:
    numel: int
    quantize: bool


class RowCodec:
    """Encodes R rows of one layout (R, S) into wire bytes (R, P) and back.

    ``segments`` partition S; quantized segments use ``codec``, raw ones the buffer dtype's bytes.
    """

    def __init__(self, segments: Sequence[Segment], codec: Codec | None) -> None:
        self.segments = [s for s in segments if s.numel > 0]
        self.codec = codec
        self.row_numel = sum(s.numel for s in self.segments)

    def row_nbytes(self, dtype: torch.dtype) -> int:
        es = torch.empty((), dtype=dtype).element_size()
        return sum(self._seg_nbytes(s, es) for s in self.segments)

    def _seg_nbytes(self, s: Segment, elem_size: int) -> int:
        return self.codec.nbytes(s.numel) if (s.quantize and self.codec is not None) else s.numel * elem_size

    def _aligned(self, n: int, rows: int) -> bool:
        """Whether R rows of a segment can be coded as one flat tensor with per-row byte boundaries."""
        if rows == 1:
            return True
        b = self.codec.bucket_size
        return b is not None and n % b == 0 and n % 8 == 0

    def encode(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        """rows (R, S) float -> uint8 (R, P)."""
        r_count = rows.shape[0]
        parts = []
        off = 0
        for k, s in enumerate(self.segments):
            x = rows[:, off : off + s.numel]
            off += s.numel
            if not (s.quantize and self.codec is not None):
                parts.append(x.contiguous().view(torch.uint8))
                continue
            seg_seed = derive_seed(seed, k)
            if self._aligned(s.numel, r_count):
                p = self.codec.encode(x.reshape(-1), seed=seg_seed)
                parts.append(p.codes.reshape(r_count, -1))
                parts.append(p.scales.reshape(r_count, -1).view(torch.uint8))
            else:
                parts.append(
                    torch.stack(
                        [self.codec.encode(x[r], seed=derive_seed(seg_seed, r)).to_bytes() for r in range(r_count)]
                    )
                )
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()

    def decode(self, buf: torch.Tensor, out: torch.Tensor, skip_row: int | None = None) -> torch.Tensor:
        """uint8 (R, P) -> writes ``out`` (R, S) (any float dtype; raw segments are bit-exact); row
        ``skip_row`` is left as it is."""
        r_count = buf.shape[0]
        es = out.element_size()
        boff = 0
        off = 0
        rows = [r for r in range(r_count) if r != skip_row]
        for s in self.segments:
            dst = out[:, off : off + s.numel]
            off += s.numel
            nb = self._seg_nbytes(s, es)
            src = buf[:, boff : boff + nb]
            boff += nb
            if not (s.quantize and self.codec is not None):
                for r in rows:
                    dst[r].copy_(src[r].clone().view(out.dtype))  # clone: the byte offset may not be 4-aligned
                continue
            if out.dtype == torch.float32 and (skip_row is not None or self._aligned(s.numel, r_count)):
                # row by row straight into the output: same values as the batched decode (whole buckets
                # per row when aligned), no temporary and no copy
                for r in rows:
                    self.codec.decode_into(self.codec.from_bytes(src[r], (s.numel,), torch.float32), dst[r])
                continue
            if self._aligned(s.numel, r_count):
                ncode = nb - self.codec.num_buckets(s.numel) * self.codec.scales_per_bucket * FP32_BYTES
                codes = src[:, :ncode].reshape(-1)
                scales = src[:, ncode:].contiguous().view(torch.float32).reshape(-1, self.codec.scales_per_bucket)
                packed = Packed(codes=codes, scales=scales, shape=torch.Size((r_count * s.numel,)), dtype=torch.float32)
                dst.copy_(self.codec.decode(packed).view(r_count, s.numel))
            else:
                for r in range(r_count):
                    p = self.codec.from_bytes(src[r], (s.numel,), torch.float32)
                    dst[r].copy_(self.codec.decode(p))
        return out


# --------------------------------------------------------------------------- FSDP2 comms
class _QSDPComm:
    """Shared parts: allocation, layout selection, bookkeeping."""

    def __init__(
        self,
        codec: Codec | None,
        state: QSDPCommState,
        group_id: int,
        params: Sequence[ParamShard],
        min_quant_numel: int,
    ) -> None:
        self.codec = codec
        self.state = state
        self.group_id = int(group_id)
        self.params = list(params)
        self.min_quant_numel = int(min_quant_numel)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _row_codec(self, row_numel: int, dtype: torch.dtype, params: Sequence[ParamShard]) -> RowCodec:
        codec = self.codec if dtype in FLOAT_DTYPES else None
        if codec is None and self.codec is not None:
            _log_once(f"dtype{dtype}", f"QSDP: FSDP buffer of dtype {dtype} is not floating; sent unquantized")
        if sum(p.padded_shard_numel for p in params) == row_numel:
            segs = [Segment(p.padded_shard_numel, is_quantized_param(p, self.min_quant_numel)) for p in params]
        else:
            _log_once(
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
        rank = group.rank()
        seed = derive_seed(self.state.seed, SEED_WEIGHTS, self.state.step, self.group_id, rank)
        if self.worker is None or input_tensor.device.type != "cpu":
            self._gather(output_tensor, input_tensor, group, seed)
            return None
        if (self.worker_group.size(), self.worker_group.rank()) != (group.size(), rank):
            raise ValueError(
                f"QuantizedAllGather: worker_group (size {self.worker_group.size()}, rank {self.worker_group.rank()}) "
                f"does not match FSDP's group (size {group.size()}, rank {rank})"
            )
        job = functools.partial(self._gather, output_tensor, input_tensor, self.worker_group, seed)
        return FutureWork(self.worker.submit(job))

    def _gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, seed: int):
        world = group.size()
        s_numel = input_tensor.numel()
        rc = self._row_codec(s_numel, input_tensor.dtype, self.params)
        payload = rc.encode(input_tensor.reshape(1, s_numel), seed).reshape(-1)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        all_gather_bytes(gathered, payload, group=group)
        rc.decode(gathered.view(world, -1), output_tensor.view(world, s_numel))
        get_ledger().record(
            "all_gather",
            collective_bytes=world * payload.numel(),
            baseline_collective_bytes=world * s_numel * FP32_BYTES,
            world_size=world,
            payload_bytes=payload.numel(),
            tag="weights",
        )


class QuantizedReduceScatter(_QSDPComm, ReduceScatter):
    """FSDP2 reduce-scatter of gradients: quantized rows, all-to-all, fp32 sum (precision preserving)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call_step = -1
        self._calls = 0

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> None:
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
        if self._call_step != self.state.step:
            self._call_step, self._calls = self.state.step, 0
        self._calls += 1
        params = self.params
        if sum(p.padded_shard_numel for p in params) != s_numel:  # params without a grad this step are left out
            params = [p for p in params if p.requires_grad]
        rc = self._row_codec(s_numel, input_tensor.dtype, params)
        seed = derive_seed(self.state.seed, SEED_GRADS, self.state.step, self.group_id, rank, self._calls)
        rows = input_tensor.view(world, s_numel)
        send = rc.encode(rows, seed)
        recv = torch.empty_like(send)
        all_to_all_bytes(recv.view(-1), send.view(-1), group=group)
        decoded = torch.empty(world, s_numel, dtype=torch.float32, device=input_tensor.device)
        decoded[rank].copy_(rows[rank])  # the own row never left this rank: keep it exact
        rc.decode(recv, decoded, skip_row=rank)
        direct = output_tensor.dtype == torch.float32 and output_tensor.is_contiguous()
        total = output_tensor.view(-1) if direct else torch.empty(s_numel, dtype=torch.float32)
        if world > 1:
            torch.add(decoded[0], decoded[1], out=total)
        else:
            total.copy_(decoded[0])
        for j in range(2, world):  # rank order
            total += decoded[j]
        if divide:
            total.div_(world)
        if not direct:
            output_tensor.copy_(total.view(output_tensor.shape))
        get_ledger().record(
            "reduce_scatter",
            collective_bytes=send.numel(),
            baseline_collective_bytes=world * s_numel * FP32_BYTES,
            world_size=world,
            payload_bytes=send.numel(),
            tag="grads",
        )
        return None


# --------------------------------------------------------------------------- installation and master projection
@dataclass(frozen=True)
class QSDPCommConfig:
    """What to install: codecs (None = unquantized) and the small-tensor threshold."""

    weight_codec: Codec | None
    grad_codec: Codec | None
    min_quant_numel: int = 1024


def install_qsdp_comms(
    root: torch.nn.Module,
    config: QSDPCommConfig,
    state: QSDPCommState,
    worker: CommWorker | None = None,
    worker_group: dist.ProcessGroup | None = None,
) -> list[torch.nn.Module]:
    """Install quantized comms on every ``FSDPModule`` under ``root`` (``root`` included) that owns params.

    Group ids follow ``root.modules()`` order, identical on every rank. Returns the modules, in group-id order.
    ``worker`` / ``worker_group``: run CPU weight all-gathers on that thread and group (see
    ``QuantizedAllGather``); reduce-scatters stay inline (FSDP2 reads their output right after the call).
    """
    from torch.distributed.fsdp import FSDPModule

    if not has_custom_comms():
        raise RuntimeError("QSDP needs FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (torch >= 2.9)")
    installed = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        params = fsdp_param_shards(module)
        if not params:
            continue
        gid = len(installed)
        module.set_custom_all_gather(
            QuantizedAllGather(
                config.weight_codec,
                state,
                gid,
                params,
                config.min_quant_numel,
                worker=worker,
                worker_group=worker_group,
            )
        )
        module.set_custom_reduce_scatter(
            QuantizedReduceScatter(config.grad_codec, state, gid, params, config.min_quant_numel)
        )
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # else FSDP passes AVG, which the comm also does
            module.set_force_sum_reduction_for_comms(True)
        installed.append(module)
    return installed


@torch.no_grad()
def project_master_weights(
    modules: Sequence[torch.nn.Module], codec: Codec, state: QSDPCommState, min_quant_numel: int
) -> None:
    """Project each large parameter's sharded master weights onto the codec's lattice (QSDP's analysed variant).

    ``modules`` in group-id order (as returned by ``install_qsdp_comms``). Each rank rounds its own padded
    shard exactly as the all-gather segments it (one segment per parameter, buckets starting at the segment
    start), then writes back only the real elements (padding stays zero). For the min-max codec the bucket
    extremes map to themselves, so the next all-gather of a projected shard is exact up to fp rounding.
    """
    for gid, module in enumerate(modules):
        fparams = _fsdp_params(module)
        if not fparams:
            continue
        rank = module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.shard_mesh_rank
        for k, fp in enumerate(fparams):
            info = _param_shard(fp)
            data = fp._sharded_param_data
            if info.shard_numel == 0 or not is_quantized_param(info, min_quant_numel) or data.dtype not in FLOAT_DTYPES:
                continue
            seed = derive_seed(state.seed, SEED_MASTER, state.step, gid, rank, k)
            q = codec.roundtrip(data, seed)
            data[: info.shard_numel].copy_(q[: info.shard_numel])
