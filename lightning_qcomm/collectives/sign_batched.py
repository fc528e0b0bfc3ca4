"""The 1-bit all-reduce's pieces as one batch: the accelerator form of ``onebit_all_reduce`` (collectives layer;
docs/design.md, "1-bit all-reduce").

``onebit_all_reduce`` cuts a bucket into pieces of n = N*m elements and runs the error-compensated 1-bit exchange
on each; the per-piece reference costs a fixed set of torch ops per piece, which on a GPU bounds the step by the
host. Here the pieces are grouped by shape (all full pieces, then the short last one) and each group runs every
phase as one set of multi-row ops over a (K, N, c) view, so the number of ops does not depend on K; the rows are
coded with ``codecs.encode_rows`` / ``decode_rows`` and the sums with ``codecs.decode_rows_sum``.

Invariants: outputs, error buffers and wire bytes are the per-piece reference's bit for bit
(tests/test_onebit_batched.py); only the number of collective calls differs, so every rank takes the same path;
no value is read on the host. ``PATH`` selects the form: ``"auto"`` (fused CPU kernels, else this form off the
CPU, else the reference), ``"batched"`` or ``"reference"``. The phases, launch counts and memory:
docs/design.md, "Module notes".

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
