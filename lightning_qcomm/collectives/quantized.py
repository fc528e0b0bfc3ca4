"""The quantized collectives: all-gather, reduce-scatter and the precision-preserving all-reduce (collectives layer;
docs/design.md, "Collectives").

The process logic that moves codec payloads between ranks; the codecs' math is ``lightning_qcomm.codecs``, the
transport ``comm.transport``, the per-call cross-rank check ``collectives.call_check`` (``check=True``: one 64-byte
all-gather per call), the byte accounting ``comm.ledger``.

Invariants: seeds derive from the caller's ``seed`` (phase 1: ``derive_seed(seed, 1, r, j)``, the reduced chunk:
``derive_seed(seed, 2, j)``, an all-gather shard: ``derive_seed(seed, r)``), and every rank decodes every chunk
from the same bytes, so all-gather and all-reduce results are bit-identical on all ranks. A world of one (or no
process group) calls nothing and returns the quantized round trip of the input. A bucket holding NaN/Inf decodes to
NaN, so a non-finite element on any rank makes its output chunk non-finite on every rank; error-feedback buffers
move only where the new residual is finite. Every call records one ledger entry (payload bytes, collective bytes,
the fp32 baseline).

Example::

    codec = get_codec("uniform", bits=8)
    quantized_all_reduce(grad, codec, op="avg", seed=derive_seed(7, step))   # in place, same on all ranks
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, decode_rows_into, decode_rows_sum, derive_seed, feedback_rows
from lightning_qcomm.collectives.call_check import _check_consistent
from lightning_qcomm.collectives.chunked import (
    FP32_BYTES,
    _check_codec,
    _check_piece_numel,
    _check_reduce_op,
    _check_tensor,
    _chunk_len,
    _copy_back,
    _decode_rows,
    _encode_bytes,
    _encode_rows,
    _fp32_output,
    _payload,
)
from lightning_qcomm.collectives.engine import run_all_gather, run_pipelined, run_reduce_scatter
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.transport import _all_gather, _rank_world, _reduce_scatter_single

DEFAULT_PIECE_NUMEL = 1 << 15  # min elements per rank per pipelined piece of quantized_all_reduce (32 KB at 8 bits)
MAX_ALL_REDUCE_PIECES = 16  # ... and at most this many pieces per call


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

    Example::

        out = torch.empty(world_size * shard.numel())
        quantized_all_gather(out, shard, get_codec("uniform", bits=8), seed=derive_seed(7, step))
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

        def decode(gathered: torch.Tensor) -> int:
            flat_out.copy_(_decode_rows(codec, gathered, world, s).view(-1))
            return gathered.numel() // world

        mine = derive_seed(seed, rank)
        p = run_all_gather(lambda: _encode_bytes(codec, shard.detach().reshape(-1), mine), decode, group, world)
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

    Example::

        out = torch.empty(grad.numel() // world_size)
        quantized_reduce_scatter(out, grad, get_codec("uniform", bits=8), op="avg")
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

        def reduce(recv: torch.Tensor) -> None:
            acc = _decode_rows(codec, recv, world, s).sum(dim=0)
            if op == "avg":
                acc /= world
            out.copy_(acc.view(out.shape))

        seeds = [derive_seed(seed, 1, rank, j) for j in range(world)]
        run_reduce_scatter(lambda: _encode_rows(codec, rows, seeds), reduce, group, world)
    get_ledger().record("reduce_scatter", world * p, world * s * FP32_BYTES, world, _payload(world * p, world), tag)
    return out


# ---------------------------------------------------------------------------------------------- all-reduce
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


class _SumReducer:
    """``quantized_all_reduce``'s math per piece (``collectives.engine`` runs the pieces): units are
    (k, offset, length, chunk length c) with seed s_k = ``_piece_seed(seed, k)``.

    encode: y = x + e zero-padded to N*c; chunk j coded with ``derive_seed(s_k, 1, rank, j)``; y and its payloads
    kept (error feedback). reduce: S = sum_r D(Q(y_r[rank])) (/N for avg; ``codecs.decode_rows_sum``, one
    launch on CUDA), coded with ``derive_seed(s_k, 2, rank)`` (``encode_rows``, one row). decode: x <- D(Q(S)) of
    every chunk, straight into the output; then e <- (y - D(Q(y))) + [chunk rank] k (S - held) where finite
    (``codecs.feedback_rows``: D(Q(y)) decoded from the payloads inside the one launch on CUDA). A piece's encode
    reads and its decode writes only its own slice e[o : o + n], and the engine runs every encode before any
    decode.
    """

    def __init__(self, x, codec: Codec, rank: int, world: int, op: str, seed: int, error_feedback) -> None:
        self.codec, self.rank, self.world, self.seed = codec, rank, world, seed
        self.x_dtype, self.device = x.dtype, x.device
        self.flat_in = x.detach().reshape(-1)
        self.error_feedback = error_feedback
        # e is written piece by piece where it lies: a non-contiguous buffer through a flat copy (``finish``)
        self.flat_err = None if error_feedback is None else error_feedback.detach().reshape(-1)
        self.out_flat = _fp32_output(x)
        self.avg = op == "avg"
        self.k_scale = world if self.avg else 1
        self.phase1: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reduced: dict[int, torch.Tensor] = {}

    def chunk_nbytes(self, unit) -> int:
        return self.codec.nbytes(unit[3])

    def encode(self, unit) -> torch.Tensor:
        k, o, n, c = unit
        world, flat_in, flat_err = self.world, self.flat_in, self.flat_err
        y = torch.empty(world * c, dtype=torch.float32, device=self.device)
        if world * c > n:
            y[n:].zero_()
        head, err_head = y[:n], None if flat_err is None else flat_err[o : o + n]
        if err_head is not None and flat_in.dtype == err_head.dtype == torch.float32:
            torch.add(flat_in[o : o + n], err_head, out=head)  # one launch where copy-then-add took two
        else:
            head.copy_(flat_in[o : o + n])
            if err_head is not None:
                head += err_head.to(torch.float32)
        s_k = _piece_seed(self.seed, k)
        send = _encode_rows(self.codec, y.view(world, c), [derive_seed(s_k, 1, self.rank, j) for j in range(world)])
        if flat_err is not None:  # its payloads too: the residual decodes them (no fp32 copy of D(Q(y)) kept)
            self.phase1[k] = (y, send)
        return send

    def reduce(self, unit, recv: torch.Tensor) -> torch.Tensor:
        k, _o, _n, c = unit
        reduced = decode_rows_sum(self.codec, recv, c, avg=self.avg)
        if self.flat_err is not None:
            self.reduced[k] = reduced
        seed = derive_seed(_piece_seed(self.seed, k), 2, self.rank)
        return _encode_rows(self.codec, reduced.view(1, c), [seed])  # the payload's bytes, no concatenation

    def decode(self, unit, gathered: torch.Tensor) -> None:
        k, o, n, c = unit
        piece = self.out_flat[o : o + n]
        if (self.world - 1) * c < n:  # all N chunks in one codec call, padding dropped, straight into the output
            decode_rows_into(self.codec, gathered, c, piece)
        else:  # chunks past the end hold padding only
            piece.copy_(_decode_rows(self.codec, gathered, self.world, c).view(-1)[:n])
        if self.flat_err is not None:
            # what x finally holds is the output rounded to x's dtype: that rounding is residual too; positions
            # past the piece's n real elements are padding and dropped
            y, send = self.phase1.pop(k)
            rows = send.view(self.world, -1)[: -(-n // c)]  # the chunks holding the piece's n real elements
            start, err = self.rank * c, self.flat_err[o : o + n]
            feedback_rows(
                self.codec, y[:n], rows, c, self.reduced.pop(k), piece, start, self.k_scale, self.x_dtype, err
            )

    def finish(self) -> None:
        e = self.error_feedback
        if e is not None and self.flat_err.data_ptr() != e.data_ptr():  # a non-contiguous e: written back once
            e.copy_(self.flat_err.view(e.shape))


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

    Pieces are pipelined (``collectives.engine``, this function's math in ``_SumReducer``): every piece's
    all-to-all is issued asynchronously as soon as it is encoded, and piece k is reduced and its all-gather
    issued while later pieces are still on the wire. Two blocking
    phases in a row leave the link idle between them (gloo's figures: BENCHMARKS.md §3, "Why two blocking
    phases lose the link"). Small
    tensors are one piece, and so is every tensor off the CPU (NCCL pipelines by itself, and a piece costs
    kernel launches). Each phase codes all N chunks of a piece in one pass (``codecs.encode_rows`` / ``decode_rows``), so the
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

    Example::

        ef = torch.zeros_like(grad)       # error feedback, kept across steps
        quantized_all_reduce(grad, get_codec("uniform", bits=8), op="avg", error_feedback=ef, seed=step)
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

    reducer = _SumReducer(x, codec, rank, world, op, seed, error_feedback)
    # gloo gains from pipelining pieces; NCCL pipelines internally, and each piece costs launches: one piece
    pieces = all_reduce_pieces(d, world, codec, piece_numel) if x.device.type == "cpu" else [(0, d)]
    units = [(k, o, n, _chunk_len(n, world)) for k, (o, n) in enumerate(pieces)]
    total_p = run_pipelined(reducer, units, group, world)
    out_flat = reducer.out_flat
    _copy_back(x, out_flat)
    ledger.record("all_reduce", world * total_p, d * FP32_BYTES, world, _payload((world + 1) * total_p, world), tag)
    return x


__all__ = [
    "DEFAULT_PIECE_NUMEL",
    "MAX_ALL_REDUCE_PIECES",
    "all_reduce_pieces",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
]
