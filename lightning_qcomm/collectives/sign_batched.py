"""The 1-bit all-reduce's pieces as one batch: the accelerator form of ``onebit_all_reduce`` (collectives layer).

``onebit_all_reduce`` cuts a bucket of d elements into pieces of n = N*m elements (``onebit_pieces``; N ranks,
m = ``piece_numel``), the last piece shorter, and runs the error-compensated 1-bit exchange on every piece
with chunks of c = ceil(n/N) elements. The per-piece reference (``sign_collective._ReferencePhases``) costs a
fixed set of torch ops per piece: on a GPU, where each op is a kernel launch, a 124M-parameter bucket at N = 1
is 475 pieces and the host, not the device, bounds the step. Here the pieces are grouped by shape: all K full
pieces (n = N*m, c = m) are one group and the shorter last piece, if any, a second one. A group of K pieces
runs every phase as one set of multi-row ops over a (K, N, c) view, so the number of ops per call does not
depend on K::

    worker:  Y = X + E_w                       (K, N*c)  the pieces' inputs, zero-padded to N*c each
             S = C(rows of Y)                  (K*N) payloads; E_w <- Y - C(Y) where finite (first n of each piece)
             send S as (N, K, P): row j (rank j) holds chunk j of every piece, in piece order
    server:  Z = (1/N) sum_r C_r + E_s         (K, c)  rank order; E_s = this rank's chunks, piece order
             Z[:, valid:] = 0                  (valid = real elements of this rank's chunk)
             payloads C(rows of Z); E_s <- Z - C(Z) where finite (padding set to 0); all-gather as (N, K, P)
    all:     X[piece k] = concat_j C(Z_j[k])[:n]

with C the ``sign1`` codec per chunk (or per block of ``block_numel``), ``codecs.encode_rows`` and
``decode_rows`` for the rows. Row j of a batched encode is the codec's encode of row j alone, bit for bit, and
every other step is element-wise, so the values (outputs, E_w, E_s, wire bytes per piece) are the per-piece
reference's bit for bit (tests/test_onebit_batched.py); only the number and size of the collective calls
differ (one all-to-all and one all-gather per group instead of per piece), so every rank must take the same
path. The error buffers move on where the new residual is finite, a group's elements as soon as the group no
longer reads them (``codecs.feedback_rows`` with no correction: y - C(y) written where finite, C(y) decoded from
the payloads just encoded inside the one launch on CUDA); the reference keeps the residuals apart and writes them
at the end (``chunked._update_error``), the same values.

Launches: a group of one piece (the one group of a bucket ``OneBitMomentumSync`` sends as one piece off the CPU)
sums the received rows with ``codecs.decode_rows_sum(avg=True, rank_order=True)``, one launch on CUDA at any N:
received[0] + received[1] + ... from row 0, one rounding per addition, then ``/= N``, the reference's own loop
(the eager ops off CUDA; on CUDA the kernel multiplies by fl(1/N) as CUDA's ``/=`` by a Python number does, the
reference's division on a GPU). Several pieces sum in an eager rank-order loop. With ``sign1`` blocks the rows
kernels take, a one-piece group is 8 launches on CUDA (encode 2, the worker's residual from the payloads 1, the
sum 1, the server's encode 2, its residual 1, the final decode 1, straight into the output, padding dropped), two
torch ops (Y = X + E_w, Z += E_s; one more for Y's zero padding, and two on a rank whose chunk is short: Z's and
E_s's padding) and the two collectives: 12.

No value is read on the host: no ``.item()``, no tensor made from Python data, no data-dependent shape. Memory
beside the codec's temporaries: Y (d fp32, during the worker phase), Z (d/N fp32), the decoded received chunks
(d fp32, during the server phase; not with the sum kernel), C(Y) and C(Z) where ``feedback_rows`` runs the eager
ops (not on CUDA), and the payloads (about d/8 bytes, three times).

``PATH`` selects the form ``onebit_all_reduce`` runs (tests and benchmarks force it):

* ``"auto"``: the fused CPU kernels where they apply, else this batched form off the CPU, else the reference;
* ``"batched"``: this form on any device (the accelerator form on CPU tensors);
* ``"reference"``: the per-piece reference on any device.

Example::

    sign_batched.PATH = "batched"                 # CPU tensors take the accelerator form
    onebit_all_reduce(m, ew, es, piece_numel=m_per_rank)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_qcomm.codecs import Codec, Packed, decode_rows_sum, feedback_rows, packing
from lightning_qcomm.codecs.rows import decode_rows, decode_rows_into, encode_rows, row_bucketed
from lightning_qcomm.collectives.chunked import _chunk_len

PATHS = ("auto", "batched", "reference")
PATH = "auto"  # module switch: see the module docstring


def selected_path(x: torch.Tensor, fused: bool) -> str:
    """The form ``onebit_all_reduce`` runs for ``x``: ``"fused"``, ``"batched"`` or ``"reference"``.

    ``fused``: whether the fused CPU sign kernels apply to this call. ValueError if ``PATH`` is not in ``PATHS``.

    Example::

        selected_path(torch.zeros(8, device="cuda"), fused=False)   # "batched"
    """
    if PATH not in PATHS:
        raise ValueError(f"sign_batched.PATH={PATH!r}: allowed {PATHS}")
    if PATH != "auto":
        return PATH
    if fused:
        return "fused"
    return "batched" if x.device.type != "cpu" else "reference"


@dataclass(frozen=True)
class PieceGroup:
    """``count`` consecutive pieces of ``numel`` elements each from element ``offset``, chunks of ``chunk``
    elements; their server-error elements start at ``es_offset`` (``count * chunk`` of them)."""

    offset: int
    count: int
    numel: int
    chunk: int
    es_offset: int


def piece_groups(pieces: list[tuple[int, int]], world: int) -> list[PieceGroup]:
    """``pieces`` (``onebit_pieces``) merged into groups of consecutive pieces of equal length: at most two, the
    full pieces and the shorter last one.

    Example::

        piece_groups([(0, 6), (6, 6), (12, 4)], 2)   # [PieceGroup(0, 2, 6, 3, 0), PieceGroup(12, 1, 4, 2, 6)]
    """
    groups: list[PieceGroup] = []
    es = 0
    for o, n in pieces:
        c = _chunk_len(n, world)
        last = groups[-1] if groups else None
        if last is not None and last.numel == n and last.offset + last.count * n == o:
            groups[-1] = PieceGroup(last.offset, last.count + 1, n, c, last.es_offset)
        else:
            groups.append(PieceGroup(o, 1, n, c, es))
        es += c
    return groups


def _unaligned_rows(sign: Codec, c: int) -> bool:
    """Whether rows of c elements take ``_decode_rows``'s shortcut: one scale per chunk, c not a multiple of 8."""
    return sign.bucket_size is None and c % 8 != 0 and sign.bits == 1


def _decode_rows(sign: Codec, wire: torch.Tensor, c: int) -> torch.Tensor:
    """(R, c) fp32 values of R payloads of c elements (``codecs.decode_rows``, bit for bit; may be a view).

    With one scale per chunk and c not a multiple of 8, ``decode_rows`` moves every row's codes onto a byte
    boundary first (some 30 ops). A row's ceil(c/8) code bytes already hold c8 = 8 ceil(c/8) codes, the last
    c8 - c of them 0, and decoding is element-wise under the row's one scale: the rows are decoded as buckets of
    c8 elements and the padding cut away, in a handful of ops."""
    p = sign.nbytes(c)
    if not _unaligned_rows(sign, c) or wire.numel() == p:
        return decode_rows(sign, wire, c)
    ncode = packing.packed_nbytes(c, 1)
    rows = wire.reshape(-1, p)
    r, c8 = rows.shape[0], 8 * ncode
    codes = rows[:, :ncode].contiguous().view(-1)
    scales = rows[:, ncode:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(r, 1)
    packed = Packed(codes, scales, torch.Size((r * c8,)), torch.float32)
    return row_bucketed(sign, c8).decode(packed).view(r, c8)[:, :c]


def _decode_rows_into(sign: Codec, wire: torch.Tensor, c: int, out: torch.Tensor) -> None:
    """out (R, c) <- ``_decode_rows(sign, wire, c)``; straight into a contiguous fp32 ``out`` where
    ``codecs.decode_rows_into`` can."""
    if _unaligned_rows(sign, c) and wire.numel() != sign.nbytes(c):
        out.copy_(_decode_rows(sign, wire, c))
    else:
        decode_rows_into(sign, wire, c, out)


class BatchedPhases:
    """The three phases of every group of pieces (module docstring): ``collectives.engine``'s reducer, the units
    being ``piece_groups``; one instance per call.

    ``x``: the input, read whole by ``encode`` before ``decode`` writes ``out_flat`` (which may be its storage).
    The residuals go straight into the error buffers (``codecs.feedback_rows``, no correction term: err <-
    y - C(y) where finite, C(y) read from the payloads), each group's own elements once that group no longer
    reads them; a buffer that is not contiguous is worked on in a flat copy, copied back by ``finish``.
    """

    def __init__(
        self,
        sign: Codec,
        x: torch.Tensor,
        out_flat: torch.Tensor,
        worker_error: torch.Tensor,
        server_error: torch.Tensor,
        rank: int,
        world: int,
    ) -> None:
        self.sign, self.rank, self.world = sign, rank, world
        self.x_flat, self.out_flat = x.detach().reshape(-1), out_flat
        self.worker_error, self.server_error = worker_error, server_error
        self.flat_ew = worker_error.detach().reshape(-1)  # a view where the buffer is contiguous, else a copy
        self.flat_es = server_error.detach().reshape(-1)

    def chunk_nbytes(self, g: PieceGroup) -> int:
        return g.count * self.sign.nbytes(g.chunk)

    def encode(self, g: PieceGroup) -> torch.Tensor:
        """Payloads of every piece's chunks, (N, K, P) uint8 (row j for rank j); E_w <- Y - C(Y) of the group's
        elements where finite."""
        k, n, c, w = g.count, g.numel, g.chunk, self.world
        span = slice(g.offset, g.offset + k * n)
        x, ew = self.x_flat[span].view(k, n), self.flat_ew[span].view(k, n)
        if n == w * c:
            y = torch.add(x, ew, out=torch.empty(k, n, dtype=torch.float32, device=x.device))
        else:  # the pieces' zero padding to N*c (a short piece is a group of its own: K = 1)
            y = torch.zeros(k, w * c, dtype=torch.float32, device=x.device)
            torch.add(x, ew, out=y[:, :n])
        send = encode_rows(self.sign, y.view(k * w, c), [0] * (k * w))  # (K*N, P)
        _feedback(self.sign, y[:, :n], send, c, self.flat_ew[span])  # after Y, the group's last read of E_w
        p = send.shape[1]
        return send.view(k, w, p).transpose(0, 1).contiguous() if k > 1 else send

    def reduce(self, g: PieceGroup, recv: torch.Tensor) -> torch.Tensor:
        """Z of this rank's chunk of every piece from the received (N, K, P) payloads; its (K, P) payloads;
        E_s <- Z - C(Z) of the group's elements where finite (padding 0)."""
        k, c, w = g.count, g.chunk, self.world
        valid = max(min(c, g.numel - self.rank * c), 0)  # real (unpadded) elements of this rank's chunks
        es = self.flat_es[g.es_offset : g.es_offset + k * c].view(k, c)
        if k == 1:  # one launch on CUDA, the rank-order sum and /N of the loop below
            z = decode_rows_sum(self.sign, recv, c, avg=True, rank_order=True).view(1, c)
        else:
            received = _decode_rows(self.sign, recv, c).reshape(w, k, c)
            z = received[0].clone()
            for r in range(1, w):  # in rank order, as the reference sums
                z += received[r]
            z.div_(w)
        z += es
        if valid < c:  # K = 1 here: a full piece has no padding
            z[:, valid:].zero_()
        mine = encode_rows(self.sign, z, [0] * k)  # (K, P)
        if valid:
            _feedback(self.sign, z[:, :valid], mine, c, es[:, :valid].view(-1))
        if valid < c:
            es[:, valid:].zero_()
        return mine

    def decode(self, g: PieceGroup, gathered: torch.Tensor) -> None:
        """out[group] <- concat_j C(Z_j[k])[:n] for every piece k, from the gathered (N, K, P) payloads."""
        k, n, c, w = g.count, g.numel, g.chunk, self.world
        p = gathered.numel() // (w * k)
        rows = gathered.view(w, k, p).transpose(0, 1).contiguous() if k > 1 else gathered  # (K, N, P): piece order
        out = self.out_flat[g.offset : g.offset + k * n]
        if n == w * c:
            _decode_rows_into(self.sign, rows, c, out.view(k * w, c))
        elif k == 1 and (w - 1) * c < n and not _unaligned_rows(self.sign, c):  # padding dropped by the codec op
            decode_rows_into(self.sign, rows, c, out)
        else:
            out.view(k, n).copy_(_decode_rows(self.sign, rows, c).reshape(k, w * c)[:, :n])

    def finish(self) -> None:
        for buf, flat in ((self.worker_error, self.flat_ew), (self.server_error, self.flat_es)):
            if not buf.is_contiguous():  # worked on in a copy
                buf.copy_(flat.view(buf.shape))


def _feedback(sign: Codec, y: torch.Tensor, wire: torch.Tensor, c: int, err: torch.Tensor) -> None:
    """err (flat, y's elements in row order) <- y - C(y) where finite, C(y) the first y.numel() values of the
    payloads ``wire`` (rows of c elements) decoded: ``codecs.feedback_rows`` with no correction (an empty reduced
    chunk), one launch on CUDA for fp32 buffers, the decode in its registers. ``y`` (K, L) is contiguous when
    K = 1 or L is a whole row (a group of several pieces has no padding); else it is copied."""
    y = y.reshape(-1)
    feedback_rows(sign, y, wire, c, y[:0], y, 0, 1.0, torch.float32, err)


__all__ = ["PATH", "PATHS", "BatchedPhases", "PieceGroup", "piece_groups", "selected_path"]
