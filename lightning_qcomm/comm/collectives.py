"""Compressed collectives over torch.distributed (docs/design.md, "Collectives").

This module owns the process logic that moves codec payloads between ranks; the math of each
codec lives in ``lightning_qcomm.codecs`` and the byte accounting in ``comm.ledger``.

Wire format: every payload is the flat uint8 buffer ``Packed.to_bytes()`` (codes, then fp32 scales).
Its size is ``codec.nbytes(numel)``, a pure function of the length, so no rank ever exchanges sizes.
Only two torch primitives carry payloads: ``all_to_all_single`` (gloo has no list ``all_to_all``) and
``all_gather_single`` (called ``all_gather_into_tensor`` before torch 2.13); both run on gloo and NCCL.

Notation: d = elements of the logical tensor, N = world size, r = this rank, P = payload bytes of one
chunk. Chunked collectives split a flat tensor into N chunks of c = ceil(d / N) elements, zero-padding
the tail (padding travels and is counted in the ledger; it is never written to the output).

Seeds: a caller passes ``seed`` (fold step and tensor id into it with ``codecs.derive_seed``). Internally
the chunk rank r encodes for rank j in phase 1 uses ``derive_seed(seed, 1, r, j)`` and the reduced chunk
j (encoded by rank j) uses ``derive_seed(seed, 2, j)``; the all-gather shard of rank r uses
``derive_seed(seed, r)``. Every rank decodes every chunk, its own included, from the same bytes, so the
results of ``quantized_all_gather``, ``quantized_all_reduce`` and ``onebit_all_reduce`` are bit-identical
on all ranks.

Consistency check (``check=True``, the default): before moving data, the ranks all-gather a 64-byte
int64 row (op, numel, dtype, codec, ...) and every rank raises the same ``ValueError`` if the rows
differ, instead of hanging or garbling memory. It costs one tiny all_gather (one network latency);
hot paths whose shapes are fixed by construction (DDP buckets, FSDP shards) may pass ``check=False``.
Its bytes are recorded in the ledger as an ``all_gather`` with the same tag and a zero fp32 baseline
(the uncompressed collective would not send them).

World size 1 (or torch.distributed not initialised, which is treated as a world of one): no
torch.distributed call is made, the ledger records zero wire bytes, and the result is exactly what N
ranks would compute with one rank: the quantized round trip(s) of the input (codec=None: the input).

Non-finite input: a codec bucket holding NaN/Inf decodes entirely to NaN, so a non-finite element on
any rank makes the corresponding output chunk non-finite on every rank. Error-feedback buffers are
only updated where the new residual is finite, so a skipped step does not poison later ones.

Every call records one entry (plus the check's entry) into ``get_ledger()``: ``payload_bytes`` = bytes
of the tensors this rank hands to torch.distributed, ``collective_bytes`` per the ledger convention, and
the fp32 baseline = 4 bytes per logical element of the same collective.
"""

from __future__ import annotations

import json
import zlib

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, cpu_fused, derive_seed, get_codec
from lightning_qcomm.codecs.base import FLOAT_DTYPES
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.row_batch import decode_rows, encode_rows

REDUCE_OPS = ("sum", "avg")
FP32_BYTES = 4
DEFAULT_PIECE_NUMEL = 1 << 15  # min elements per rank per pipelined piece of quantized_all_reduce (32 KB at 8 bits)
MAX_ALL_REDUCE_PIECES = 16  # ... and at most this many pieces per call
DEFAULT_ONEBIT_PIECE_NUMEL = 1 << 18  # the same for onebit_all_reduce (32 KB of signs per rank)
# min bytes per rank per concurrent sub-exchange of all_to_all_bytes / all_gather_bytes: QSDP W8G8 steps
# (0.36 MB gathers) measured 590 / 605 / 740 ms at 100 Mbit/s and 224 / 313 / 199 ms at 1 Gbit/s with
# 128 KB / 32 KB / no pieces (netbench, one repeat): smaller pieces cost per-call overhead on fast links
TRANSFER_PIECE_BYTES = 1 << 17
MAX_TRANSFER_PIECES = 16  # ... and at most this many sub-exchanges per call

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "onebit_all_reduce": 4}
_META_FIELDS = ("collective", "numel", "dtype", "codec", "reduce_op", "world_size", "aux", "version")
_META_VERSION = 1


# ---------------------------------------------------------------------------------------------- helpers
def _all_gather_fn():
    """``all_gather_single`` (torch >= 2.13), else its older name ``all_gather_into_tensor`` (looked up per
    call, so wrappers installed on ``torch.distributed`` are seen)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    _all_gather_fn()(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, op, group) -> None:
    """``reduce_scatter_single`` (torch >= 2.13), else its older name ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")


def _check_codec(codec: Codec | None) -> None:
    if codec is not None and not isinstance(codec, Codec):
        raise TypeError(f"codec must be a Codec from get_codec(...) or None, got {type(codec).__name__}")


def _check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def _codec_code(codec: Codec | None) -> int:
    """A 32-bit fingerprint of every option that defines the codes (``Codec.config``); 0 for fp32."""
    if codec is None:
        return 0
    return zlib.crc32(json.dumps(codec.config(), sort_keys=True, default=str).encode()) + 1


def _check_consistent(
    collective: str,
    group: dist.ProcessGroup | None,
    world: int,
    tag: str,
    *,
    numel: int,
    dtype: torch.dtype,
    codec: Codec | None,
    reduce_op: str = "sum",
    aux: int = 0,
    device: torch.device,
) -> None:
    """All-gather one int64 row of metadata and raise the same ValueError on every rank if rows differ."""
    row = torch.tensor(
        [
            _OP_CODES[collective],
            numel,
            _DTYPE_CODES[dtype],
            _codec_code(codec),
            REDUCE_OPS.index(reduce_op),
            world,
            aux,
            _META_VERSION,
        ],
        dtype=torch.int64,
        device=device,
    )
    rows = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
    _all_gather_single(rows, row, group)
    get_ledger().record("all_gather", rows.numel() * 8, 0, world, payload_bytes=row.numel() * 8, tag=tag)
    table = rows.view(world, -1).cpu()
    if bool((table == table[0]).all()):
        return
    diffs = [
        f"{field}: " + ", ".join(f"rank{r}={int(table[r, i])}" for r in range(world))
        for i, field in enumerate(_META_FIELDS)
        if not bool((table[:, i] == table[0, i]).all())
    ]
    raise ValueError(
        f"{collective}: ranks disagree on the input ({'; '.join(diffs)}); every rank must pass the same "
        f"numel, dtype, codec and op (dtype codes {dict((str(k), v) for k, v in _DTYPE_CODES.items())})"
    )


def _chunk_len(numel: int, world: int) -> int:
    return -(-numel // world)


def _encode_bytes(codec: Codec, x: torch.Tensor, seed: int) -> torch.Tensor:
    return codec.encode(x, seed=seed).to_bytes()


def _decode_bytes(codec: Codec, buf: torch.Tensor, numel: int) -> torch.Tensor:
    """fp32 flat values of one payload."""
    return codec.decode(codec.from_bytes(buf, (numel,), torch.float32))


def _decode_rows(codec: Codec, buf: torch.Tensor, rows: int, numel: int) -> torch.Tensor:
    """Decode ``rows`` consecutive payloads of ``numel`` elements each into a (rows, numel) fp32 tensor, in one
    codec call (``row_batch.decode_rows``)."""
    return decode_rows(codec, buf, numel).view(rows, numel)


def _encode_rows(codec: Codec, rows: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """The flat concatenation of ``codec.encode(rows[j], seeds[j]).to_bytes()``, in one pass (``row_batch``)."""
    return encode_rows(codec, rows, seeds).view(-1)


def _column_pieces(row_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[a, b) byte ranges of a row cut for ``all_to_all_bytes`` / ``all_gather_bytes``: pieces of at least
    ``piece_bytes``, at most ``MAX_TRANSFER_PIECES`` of them; one range if the row is short."""
    if row_bytes <= piece_bytes:
        return [(0, row_bytes)]
    size = max(piece_bytes, -(-row_bytes // MAX_TRANSFER_PIECES))
    return [(a, min(a + size, row_bytes)) for a in range(0, row_bytes, size)]


def all_to_all_bytes(
    recv: torch.Tensor,
    send: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    piece_bytes: int = TRANSFER_PIECE_BYTES,
) -> None:
    """``all_to_all_single`` of N equal rows of bytes (row j of ``send`` to rank j, row r of ``recv`` from
    rank r), issued on CPU/gloo as up to 16 concurrent exchanges of >= ``piece_bytes`` per row.

    One blocking gloo exchange of a few MB leaves a shaped TCP link partly idle (2.1 MB per rank at
    100 Mbit/s, Linux defaults: 345 ms as one call, 190 ms as 8 concurrent ones, 168 ms at line rate;
    benchmarks/gloo_phases.py).
    CUDA tensors go as one call (NCCL pipelines internally). Same bytes, same result either way.
    """
    _, world = _rank_world(group)
    if world == 1:
        recv.copy_(send)
        return
    row = send.numel() // world
    cols = _column_pieces(row, piece_bytes) if send.device.type == "cpu" else [(0, row)]
    if len(cols) == 1:
        dist.all_to_all_single(recv, send, group=group)
        return
    src, dst = send.view(world, row), recv.view(world, row)
    works = []
    for a, b in cols:
        piece_out = torch.empty(world * (b - a), dtype=recv.dtype, device=recv.device)
        work = dist.all_to_all_single(piece_out, src[:, a:b].contiguous().view(-1), group=group, async_op=True)
        works.append((a, b, piece_out, work))
    for a, b, piece_out, work in works:
        work.wait()
        dst[:, a:b] = piece_out.view(world, b - a)


def all_gather_bytes(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    piece_bytes: int = TRANSFER_PIECE_BYTES,
) -> None:
    """``all_gather_single`` (rank r's ``inp`` into row r of ``out``), issued on CPU/gloo as up to 16
    concurrent gathers of >= ``piece_bytes`` per rank (see ``all_to_all_bytes``)."""
    _, world = _rank_world(group)
    if world == 1:
        out.copy_(inp)
        return
    row = inp.numel()
    cols = _column_pieces(row, piece_bytes) if inp.device.type == "cpu" else [(0, row)]
    if len(cols) == 1:
        _all_gather_single(out, inp, group)
        return
    fn = _all_gather_fn()
    src, dst = inp.view(-1), out.view(world, row)
    works = []
    for a, b in cols:
        piece_out = torch.empty(world * (b - a), dtype=out.dtype, device=out.device)
        works.append((a, b, piece_out, fn(piece_out, src[a:b], group=group, async_op=True)))
    for a, b, piece_out, work in works:
        work.wait()
        dst[:, a:b] = piece_out.view(world, b - a)


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, group, world: int) -> None:
    if world == 1:
        recv.copy_(send)
    else:
        all_to_all_bytes(recv, send, group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, world: int) -> None:
    if world == 1:
        out.copy_(inp)
    else:
        all_gather_bytes(out, inp, group)


def _payload(nbytes: int, world: int) -> int:
    """Bytes handed to torch.distributed (none when a world of one skips the call)."""
    return nbytes if world > 1 else 0


def _fp32_output(x: torch.Tensor) -> torch.Tensor:
    """Where a collective decodes its result: x's own flat view when x is contiguous fp32 (callers read
    all of x in phase 1 before phase 3 writes), else a new fp32 buffer for ``_copy_back``."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x.view(-1)
    return torch.empty(x.numel(), dtype=torch.float32, device=x.device)


def _copy_back(x: torch.Tensor, out_flat: torch.Tensor) -> None:
    """x <- out_flat unless out_flat already is x's storage (see ``_fp32_output``)."""
    if out_flat.data_ptr() != x.data_ptr():
        x.copy_(out_flat.view(x.shape))


def _update_error(err: torch.Tensor, new: torch.Tensor) -> None:
    """err <- new where new is finite (keeps the previous residual where a step was non-finite).

    Branch-free: deciding on the host whether any element is non-finite would wait for the device every step.
    """
    new = new.reshape(err.shape)
    if err.dtype == new.dtype:
        torch.where(torch.isfinite(new), new, err, out=err)
    else:
        err.copy_(torch.where(torch.isfinite(new), new, err.to(new.dtype)))


# ---------------------------------------------------------------------------------------------- all-gather
def quantized_all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    codec: Codec | None,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
    tag: str = "weights",
    check: bool = True,
) -> torch.Tensor:
    """out[r*s:(r+1)*s] = decode(encode(shard_r, derive_seed(seed, r))) for every rank r, on every rank.

    ``out`` has N * shard.numel() elements (any shape, contiguous); ``shard`` any shape. Each rank's own
    slice is decoded from its own payload too, so all ranks hold identical data. codec=None gathers the
    raw values (cast to ``out.dtype``) with ``all_gather_single``.
    Ledger: all_gather, collective = N * P (P = codec.nbytes(s), or s * itemsize), baseline N * s * 4.
    """
    _check_tensor("out", out)
    _check_tensor("shard", shard)
    _check_codec(codec)
    rank, world = _rank_world(group)
    s = shard.numel()
    if out.numel() != world * s:
        raise ValueError(f"out must have world_size * shard.numel() = {world} * {s} elements, got {out.numel()}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if check and world > 1:
        _check_consistent("all_gather", group, world, tag, numel=s, dtype=shard.dtype, codec=codec, device=shard.device)
    flat_out = out.view(-1)
    if codec is None:
        src = shard.detach().reshape(-1).to(out.dtype)
        _all_gather(flat_out, src, group, world)
        p = src.numel() * src.element_size()
    else:
        mine = _encode_bytes(codec, shard.detach().reshape(-1), derive_seed(seed, rank))
        p = mine.numel()
        buf = torch.empty(world * p, dtype=torch.uint8, device=shard.device)
        _all_gather(buf, mine, group, world)
        flat_out.copy_(_decode_rows(codec, buf, world, s).view(-1))
    get_ledger().record("all_gather", world * p, world * s * FP32_BYTES, world, _payload(p, world), tag)
    return out


# ---------------------------------------------------------------------------------------------- reduce-scatter
def quantized_reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    codec: Codec | None,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    seed: int = 0,
    tag: str = "grads",
    check: bool = True,
) -> torch.Tensor:
    """out = sum_i decode(Q(inp_i[row r])) (or that / N for op="avg"), summed in fp32 in rank order.

    ``inp`` has N * out.numel() elements; row j = inp.flatten()[j*s:(j+1)*s] goes to rank j, encoded
    with ``derive_seed(seed, 1, r, j)``. codec=None is ``reduce_scatter_single`` (SUM or AVG).
    Ledger: reduce_scatter, collective = payload = N * P, baseline N * s * 4.
    """
    _check_tensor("out", out)
    _check_tensor("inp", inp)
    _check_codec(codec)
    _check_reduce_op(op)
    rank, world = _rank_world(group)
    s = out.numel()
    if inp.numel() != world * s:
        raise ValueError(f"inp must have world_size * out.numel() = {world} * {s} elements, got {inp.numel()}")
    if check and world > 1:
        _check_consistent(
            "reduce_scatter", group, world, tag, numel=s, dtype=inp.dtype, codec=codec, reduce_op=op, device=inp.device
        )
    rows = inp.detach().reshape(world, s)
    if codec is None:
        src = rows.reshape(-1).to(out.dtype).contiguous()
        dst = out.view(-1) if out.is_contiguous() else torch.empty(s, dtype=out.dtype, device=out.device)
        if world == 1:
            dst.copy_(src)
        else:
            red = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
            _reduce_scatter_single(dst, src, red, group)
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(out.shape))
        p = s * src.element_size()
    else:
        p = codec.nbytes(s)
        send = _encode_rows(codec, rows, [derive_seed(seed, 1, rank, j) for j in range(world)])
        recv = torch.empty_like(send)
        _all_to_all(recv, send, group, world)
        acc = _decode_rows(codec, recv, world, s).sum(dim=0)
        if op == "avg":
            acc /= world
        out.copy_(acc.view(out.shape))
    get_ledger().record("reduce_scatter", world * p, world * s * FP32_BYTES, world, _payload(world * p, world), tag)
    return out


# ---------------------------------------------------------------------------------------------- all-reduce
def _check_piece_numel(piece_numel: int) -> None:
    if not isinstance(piece_numel, int) or isinstance(piece_numel, bool) or piece_numel < 1:
        raise ValueError(f"piece_numel must be a positive int (elements per rank per piece), got {piece_numel!r}")


def all_reduce_pieces(
    numel: int, world_size: int, codec: Codec | None, piece_numel: int = DEFAULT_PIECE_NUMEL
) -> list[tuple[int, int]]:
    """(offset, length) of the pieces ``quantized_all_reduce`` pipelines a tensor of ``numel`` elements in.

    A piece holds N*m elements, m = max(``piece_numel``, ceil(d / (N * MAX_ALL_REDUCE_PIECES))) rounded up
    to a multiple of the codec's bucket (so the buckets of a piece's chunks are the buckets of the unpieced
    algorithm); the last piece holds the rest. A tensor of at most N*m elements is one piece. codec=None
    is never pieced (one fp32 all_reduce).
    """
    _check_piece_numel(piece_numel)
    m = max(piece_numel, -(-numel // (world_size * MAX_ALL_REDUCE_PIECES)))
    if codec is not None and codec.bucket_size is not None:
        m = -(-m // codec.bucket_size) * codec.bucket_size
    step = world_size * m
    if codec is None or numel <= step:
        return [(0, numel)]
    return [(o, min(step, numel - o)) for o in range(0, numel, step)]


def _piece_seed(seed: int, k: int) -> int:
    return seed if k == 0 else derive_seed(seed, 3, k)


def _all_to_all_async(recv: torch.Tensor, send: torch.Tensor, group, world: int):
    if world == 1:
        recv.copy_(send)
        return None
    return dist.all_to_all_single(recv, send, group=group, async_op=True)


def _all_gather_async(out: torch.Tensor, inp: torch.Tensor, group, world: int):
    if world == 1:
        out.copy_(inp)
        return None
    return _all_gather_fn()(out, inp, group=group, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


def quantized_all_reduce(
    x: torch.Tensor,
    codec: Codec | None,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    error_feedback: torch.Tensor | None = None,
    seed: int = 0,
    tag: str = "grads",
    check: bool = True,
    piece_numel: int = DEFAULT_PIECE_NUMEL,
) -> torch.Tensor:
    """Precision-preserving compressed all-reduce, in place (also returned). Any length, any N.

    The flat tensor is cut into pieces (``all_reduce_pieces``: N*m elements each, m >= ``piece_numel``,
    at most 16 pieces, m rounded up to the bucket); piece k runs the algorithm below with seed
    s_k = ``seed`` for k = 0 and ``derive_seed(seed, 3, k)`` after. With y_r = x_r + e_r (e_r = ``error_feedback``, 0 if None) of one
    piece, zero-padded to N*c, c = ceil(len/N):

    1. rank r encodes chunk j of y_r (seed ``derive_seed(s_k, 1, r, j)``) and sends it to rank j
       (``all_to_all_single``);
    2. rank j decodes the N chunks to fp32 and sums them in rank order -- no low-precision accumulation:
       S_j = sum_r D(Q(y_r[j])) for op="sum", S_j = (1/N) sum_r D(Q(y_r[j])) for op="avg";
    3. rank j re-encodes S_j (seed ``derive_seed(s_k, 2, j)``); ``all_gather_single`` of the N codes;
    4. every rank decodes all N chunks from the gathered bytes: x <- D(Q(S))[:len], identical on all ranks.

    Pieces are pipelined: every piece's all-to-all is issued asynchronously as soon as it is encoded, and
    piece k is reduced and its all-gather issued while later pieces are still on the wire. Two blocking
    phases in a row leave the link idle between them (gloo, 2.1 MB per phase at 100 Mbit/s: 516 ms
    blocking, 356 ms pipelined in 16 pieces, 336 ms at line rate; benchmarks/gloo_phases.py). Small
    tensors are one piece, and so is every tensor off the CPU (NCCL pipelines by itself, and a piece costs
    kernel launches). Each phase codes all N chunks of a piece in one pass (``comm.row_batch``), so the
    launches per call do not grow with N.

    Error feedback (``error_feedback`` = e_r, updated in place): e_r is everything rank r meant to
    contribute that the output does not contain, so that nothing is lost over steps:

        e_r <- (y_r - D(Q(y_r)))  +  k * [chunk r] (S_r - D(Q(S_r))),      k = 1 (sum) or N (avg)

    The first term is docs/design.md's error feedback e <- (x + e) - decode (this rank's phase-1 residual); the
    second is the requantization residual of the reduced chunk that rank r itself encoded in step 3
    (written into the chunk-r slice of each piece of e_r only), measured against the value x finally
    holds (rounded to x's dtype when x is bf16/fp16; keep e in fp32 so it can hold that rounding). Summed over ranks,
    sum_r e_r = sum_r y_r - k * x_out, hence over steps t = 1..T (e = 0 at the start, exact up to fp32
    rounding, for any codec, biased or not):

        k * sum_t x_out,t = sum_t sum_r x_r,t - sum_r e_r,T

    codec=None is ``dist.all_reduce`` (SUM or AVG) of x + e, and e is zeroed.
    Ledger: one all_reduce record; over pieces, collective = sum_k N*P_k (P_k = codec.nbytes(c_k)),
    payload = sum_k (N+1)*P_k (all_to_all input plus all-gather input), baseline 4*d;
    wire = 2(N-1)/N * collective.
    """
    _check_tensor("x", x)
    _check_codec(codec)
    _check_reduce_op(op)
    _check_piece_numel(piece_numel)
    if error_feedback is not None:
        _check_tensor("error_feedback", error_feedback)
        if error_feedback.numel() != x.numel():
            raise ValueError(f"error_feedback must have x.numel()={x.numel()} elements, got {error_feedback.numel()}")
    rank, world = _rank_world(group)
    d = x.numel()
    if check and world > 1:
        _check_consistent(
            "all_reduce",
            group,
            world,
            tag,
            numel=d,
            dtype=x.dtype,
            codec=codec,
            reduce_op=op,
            aux=piece_numel,
            device=x.device,
        )
    ledger = get_ledger()
    if codec is None:
        buf = x if x.is_contiguous() else x.contiguous()
        if error_feedback is not None:
            buf.add_(error_feedback.reshape(buf.shape).to(buf.dtype))
            error_feedback.zero_()
        if world > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM, group=group)
        if buf.data_ptr() != x.data_ptr():
            x.copy_(buf)
        nb = d * x.element_size()
        ledger.record("all_reduce", nb, d * FP32_BYTES, world, _payload(nb, world), tag)
        return x

    flat_in = x.detach().reshape(-1)
    flat_err = None if error_feedback is None else error_feedback.detach().reshape(-1)
    out_flat = _fp32_output(x)
    residual = None if error_feedback is None else torch.empty(d, dtype=torch.float32, device=x.device)
    k_scale = world if op == "avg" else 1
    # gloo gains from pipelining pieces; NCCL pipelines internally, and each piece costs launches: one piece
    pieces = all_reduce_pieces(d, world, codec, piece_numel) if x.device.type == "cpu" else [(0, d)]
    total_p = 0
    # phase 1 for every piece: encode, issue the all-to-all, move on
    phase1 = []
    for k, (o, n) in enumerate(pieces):
        c = _chunk_len(n, world)
        s_k = _piece_seed(seed, k)
        y = torch.zeros(world * c, dtype=torch.float32, device=x.device)
        y[:n] = flat_in[o : o + n]
        if flat_err is not None:
            y[:n] += flat_err[o : o + n].to(torch.float32)
        chunks = y.view(world, c)
        send = _encode_rows(codec, chunks, [derive_seed(s_k, 1, rank, j) for j in range(world)])
        res = None if residual is None else y - _decode_rows(codec, send, world, c).view(-1)
        recv = torch.empty_like(send)
        phase1.append((o, n, c, s_k, res, recv, send, _all_to_all_async(recv, send, group, world)))
        total_p += codec.nbytes(c)
    # phase 2 in order: reduce piece k while later pieces travel, issue its all-gather
    phase2 = []
    for o, n, c, s_k, res, recv, _send, work in phase1:
        _wait(work)
        reduced = _decode_rows(codec, recv, world, c).sum(dim=0)
        if op == "avg":
            reduced /= world
        mine = _encode_bytes(codec, reduced, derive_seed(s_k, 2, rank))
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=x.device)
        phase2.append((o, n, c, res, reduced, gathered, mine, _all_gather_async(gathered, mine, group, world)))
    del phase1
    low_precision_out = x.dtype != torch.float32
    for o, n, c, res, reduced, gathered, _mine, work in phase2:
        _wait(work)
        rows = _decode_rows(codec, gathered, world, c)  # all N chunks in one codec call
        out_flat[o : o + n] = rows.view(-1)[:n]
        if res is not None:
            # what x finally holds is row rounded to x's dtype: that rounding is residual too (positions past
            # the piece's n real elements are padding and dropped below)
            held = rows[rank].to(x.dtype).to(torch.float32) if low_precision_out else rows[rank]
            res.view(world, c)[rank] += k_scale * (reduced - held)
            residual[o : o + n] = res[:n]
    if residual is not None:
        _update_error(error_feedback, residual)
    _copy_back(x, out_flat)
    ledger.record("all_reduce", world * total_p, d * FP32_BYTES, world, _payload((world + 1) * total_p, world), tag)
    return x


# ---------------------------------------------------------------------------------------------- 1-bit
_SIGN1: Codec | None = None


def _sign_codec() -> Codec:
    global _SIGN1
    if _SIGN1 is None:
        _SIGN1 = get_codec("sign1", bits=1, bucket_size=None)
    return _SIGN1


def onebit_pieces(numel: int, world_size: int, piece_numel: int = DEFAULT_ONEBIT_PIECE_NUMEL) -> list[tuple[int, int]]:
    """(offset, length) of the pieces ``onebit_all_reduce`` pipelines ``numel`` elements in: N*m each
    (m = ``piece_numel``), the last one shorter; at most N*m elements are one piece."""
    _check_piece_numel(piece_numel)
    step = world_size * piece_numel
    if numel <= step:
        return [(0, numel)]
    return [(o, min(step, numel - o)) for o in range(0, numel, step)]


def onebit_server_error_numel(numel: int, group: dist.ProcessGroup | None = None) -> int:
    """Length of ``server_error`` for ``onebit_all_reduce`` of a tensor of ``numel`` elements: ceil(numel/N)
    (the sum over pieces of each piece's chunk length, which adds up to the same)."""
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    return _chunk_len(numel, _rank_world(group)[1])


def _onebit_pieces_reference(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group,
    rank: int,
    world: int,
    pieces: list[tuple[int, int]],
) -> int:
    """``onebit_all_reduce``'s pieces through the sign1 codec's encode/decode (the spec); returns the
    payload bytes of one chunk summed over pieces."""
    d = x.numel()
    sign = _sign_codec()
    flat_x = x.detach().reshape(-1)
    flat_ew = worker_error.detach().reshape(-1)
    flat_es = server_error.detach().reshape(-1)
    new_ew = torch.empty(d, dtype=torch.float32, device=x.device)
    new_es = torch.empty(flat_es.numel(), dtype=torch.float32, device=x.device)
    out_flat = _fp32_output(x)
    total_p = 0
    phase1 = []
    es_off = 0
    for o, n in pieces:
        c = _chunk_len(n, world)
        y = torch.empty(world * c, dtype=torch.float32, device=x.device)
        torch.add(flat_x[o : o + n], flat_ew[o : o + n], out=y[:n])
        y[n:] = 0.0
        send = _encode_rows(sign, y.view(world, c), [0] * world)
        torch.sub(y[:n], _decode_rows(sign, send, world, c).view(-1)[:n], out=new_ew[o : o + n])  # e_w = y - C(y)
        recv = torch.empty_like(send)
        phase1.append((o, n, c, es_off, recv, send, _all_to_all_async(recv, send, group, world)))
        es_off += c
        total_p += sign.nbytes(c)
    phase2 = []
    for o, n, c, e_off, recv, _send, work in phase1:
        _wait(work)
        valid = min(c, n - rank * c)  # real (unpadded) elements of this rank's chunk; may be <= 0 on tail ranks
        received = _decode_rows(sign, recv, world, c)
        z = received[0].clone()
        for r in range(1, world):  # in rank order, as the fused path sums (a decode-sum codec op would fuse this)
            z += received[r]
        z.div_(world)
        z += flat_es[e_off : e_off + c].to(torch.float32)
        if valid < c:
            z[max(valid, 0) :] = 0.0
        mine = _encode_bytes(sign, z, 0)
        es = torch.sub(z, _decode_bytes(sign, mine, c), out=new_es[e_off : e_off + c])
        if valid < c:
            es[max(valid, 0) :] = 0.0
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=x.device)
        phase2.append((o, n, c, gathered, mine, _all_gather_async(gathered, mine, group, world)))
    del phase1
    for o, n, c, gathered, _mine, work in phase2:
        _wait(work)
        out_flat[o : o + n] = _decode_rows(sign, gathered, world, c).view(-1)[:n]
    _update_error(worker_error, new_ew)
    _update_error(server_error, new_es)
    _copy_back(x, out_flat)
    return total_p


def _onebit_pieces_fused(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group,
    rank: int,
    world: int,
    pieces: list[tuple[int, int]],
) -> int:
    """``_onebit_pieces_reference`` with the sign1 work in fused CPU passes (``cpu_fused.sign_*``), bit for
    bit: per chunk one norm (torch) and one pass for the codes and the residual, written straight into
    the error buffers and the payloads; the server sum and the final decode are one pass each.
    Error buffers must be contiguous fp32; x is read whole (phase 1) before it is written (phase 3)."""
    sign = _sign_codec()
    flat_x = x.detach().reshape(-1)
    flat_ew = worker_error.detach().view(-1)
    flat_es = server_error.detach().view(-1)
    out_flat = _fp32_output(x)
    total_p = 0
    phase1 = []
    es_off = 0
    for o, n in pieces:
        c = _chunk_len(n, world)
        p = sign.nbytes(c)
        y = torch.empty(world * c, dtype=torch.float32)
        torch.add(flat_x[o : o + n], flat_ew[o : o + n], out=y[:n])
        y[n:] = 0.0
        send = torch.empty(world * p, dtype=torch.uint8)
        for j in range(world):
            yj = y[j * c : (j + 1) * c]
            length = max(min(c, n - j * c), 0)
            ew_j = flat_ew[o + j * c : o + j * c + length] if length else flat_ew[:0]
            cpu_fused.sign_encode_err(yj, cpu_fused.sign_scale(yj), send[j * p : (j + 1) * p], ew_j, length, length)
        recv = torch.empty_like(send)
        phase1.append((o, n, c, p, es_off, recv, send, _all_to_all_async(recv, send, group, world)))
        es_off += c
        total_p += p
    phase2 = []
    for o, n, c, p, e_off, recv, _send, work in phase1:
        _wait(work)
        valid = max(min(c, n - rank * c), 0)  # real (unpadded) elements of this rank's chunk
        es = flat_es[e_off : e_off + c]
        z = torch.empty(c, dtype=torch.float32)
        cpu_fused.sign_server_sum(recv, world, c, es, valid, z)
        mine = torch.empty(p, dtype=torch.uint8)
        cpu_fused.sign_encode_err(z, cpu_fused.sign_scale(z), mine, es, valid, c)
        gathered = torch.empty(world * p, dtype=torch.uint8)
        phase2.append((o, n, c, p, gathered, mine, _all_gather_async(gathered, mine, group, world)))
    del phase1
    for o, n, c, p, gathered, _mine, work in phase2:
        _wait(work)
        for j in range(world):
            length = max(min(c, n - j * c), 0)
            if length:
                cpu_fused.sign_decode(gathered[j * p : (j + 1) * p], c, out_flat[o + j * c : o + j * c + length])
    _copy_back(x, out_flat)
    return total_p


def onebit_all_reduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tag: str = "momentum",
    check: bool = True,
    piece_numel: int = DEFAULT_ONEBIT_PIECE_NUMEL,
) -> torch.Tensor:
    """Error-compensated 1-bit average over ranks (docs/design.md, "1-bit all-reduce"), in place on a flat fused buffer.

    The buffer is cut into pieces of N*m elements (``onebit_pieces``, m = ``piece_numel``); each piece,
    of length n, runs the algorithm below on its own, with chunks of c = ceil(n/N) elements.
    C(v) = (||v||_2 / sqrt(len v)) * sign(v), sign(0) = +1, applied per chunk (the ``sign1`` codec with one
    bucket per chunk; the zero tail padding of the last chunk counts in its length). With e_w =
    ``worker_error`` (d elements) and e_s = ``server_error`` (this rank's chunk of every piece, in piece
    order: ceil(d/N) elements, see ``onebit_server_error_numel``)::

        worker r:  y = x + e_w (zero-padded to N*c); send C(y[chunk j]) to rank j; e_w <- y - C(y)  (n elements)
        server j:  z = (1/N) sum_r C(y_r[chunk j]) + e_s  (sum in rank order; padding positions of z set to 0);
                   send C(z) to all; e_s <- z - C(z)  (padding positions kept 0)
        all:       x <- concat_j C(z_j)[:n], identical on every rank.

    Pieces are pipelined as in ``quantized_all_reduce`` (async all-to-all per piece; each piece's
    all-gather issued once its all-to-all is done). Wire per rank ~ 2(N-1)/N * d/8 bytes plus 8(N-1)
    bytes of scales per piece (1/32 of an fp32 ring all-reduce).
    Ledger: all_reduce, collective = sum_k N*P_k with P_k = ceil(c_k/8) + 4, payload sum_k (N+1)*P_k,
    baseline 4*d.
    """
    _check_tensor("x", x)
    _check_tensor("worker_error", worker_error)
    _check_tensor("server_error", server_error)
    _check_piece_numel(piece_numel)
    rank, world = _rank_world(group)
    d = x.numel()
    if worker_error.numel() != d:
        raise ValueError(f"worker_error must have x.numel()={d} elements, got {worker_error.numel()}")
    if server_error.numel() != _chunk_len(d, world):
        raise ValueError(
            f"server_error must have ceil(x.numel()/world_size)={_chunk_len(d, world)} elements, "
            f"got {server_error.numel()}"
        )
    if check and world > 1:
        _check_consistent(
            "onebit_all_reduce",
            group,
            world,
            tag,
            numel=d,
            dtype=x.dtype,
            codec=None,
            aux=piece_numel,
            device=x.device,
        )
    pieces = onebit_pieces(d, world, piece_numel)
    fused = (
        worker_error.dtype == torch.float32
        and server_error.dtype == torch.float32
        and worker_error.is_contiguous()
        and server_error.is_contiguous()
        and worker_error.device.type == "cpu"
        and server_error.device.type == "cpu"
        and cpu_fused.use_fused(_sign_codec(), x, _chunk_len(pieces[0][1], world))
    )
    run = _onebit_pieces_fused if fused else _onebit_pieces_reference
    total_p = run(x, worker_error, server_error, group, rank, world, pieces)
    get_ledger().record(
        "all_reduce", world * total_p, d * FP32_BYTES, world, _payload((world + 1) * total_p, world), tag
    )
    return x


def wire_bytes_formula(
    collective: str,
    numel: int,
    world_size: int,
    codec: Codec | None = None,
    itemsize: int = FP32_BYTES,
    piece_numel: int = DEFAULT_PIECE_NUMEL,
    onebit_piece_numel: int | None = None,
) -> float:
    """Ledger wire estimate (bytes this rank sends) of one call, for benchmarks and docs.

    ``collective`` is "all_gather" (numel = shard length), "reduce_scatter" (numel = output length),
    "all_reduce" or "onebit_all_reduce" (numel = d). Excludes the consistency check's 8*8*N bytes. The
    all-reduce is pieced as on CPU; a CUDA tensor goes as one piece (``piece_numel=numel`` gives its bytes).
    """
    n = world_size
    if collective == "onebit_all_reduce":
        sign = _sign_codec()
        pieces = onebit_pieces(
            numel, n, DEFAULT_ONEBIT_PIECE_NUMEL if onebit_piece_numel is None else onebit_piece_numel
        )
        return 2 * (n - 1) * sum(sign.nbytes(_chunk_len(length, n)) for _, length in pieces)
    if collective == "all_reduce":
        if codec is None:
            return 2 * (n - 1) * itemsize * numel / n
        pieces = all_reduce_pieces(numel, n, codec, piece_numel)
        return 2 * (n - 1) * sum(codec.nbytes(_chunk_len(length, n)) for _, length in pieces)
    if collective in ("all_gather", "reduce_scatter"):
        per = itemsize * numel if codec is None else codec.nbytes(numel)
        return (n - 1) * per
    raise ValueError(
        f"collective must be all_gather, reduce_scatter, all_reduce or onebit_all_reduce, got {collective!r}"
    )


__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "DEFAULT_PIECE_NUMEL",
    "REDUCE_OPS",
    "TRANSFER_PIECE_BYTES",
    "all_gather_bytes",
    "all_reduce_pieces",
    "all_to_all_bytes",
    "onebit_pieces",
    "onebit_all_reduce",
    "onebit_server_error_numel",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "wire_bytes_formula",
]
