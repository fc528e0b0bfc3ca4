"""The three phases of the error-compensated 1-bit all-reduce over a group of K pieces (``collectives.onebit_all_reduce``
runs them; docs/design.md, "1-bit all-reduce"), with C(v) the ``sign1`` codec of one chunk of c elements::

    worker(sign, y, n, c, err)               y (K, N*c) zero-padded: payloads (K*N, P) of C(y[k, chunk j]);
                                             err (K*n) <- y[:, :n] - C(y) where finite
    server(sign, recv, k, c, valid, es)      z = (1/N) sum_r C_r (rank order) + es, padding 0: payloads (K, P) of
                                             C(z); es (K, c) <- z - C(z) where finite, padding 0
    decode_into(sign, rows, n, c, out)       rows (K, N, P): out (K*n) <- concat_j C(z_j)[:n] per piece

``KERNELS`` runs them through the ops: the ``qcomm::sign_*`` ops (``codecs.sign_ops``, one pass per chunk; the C
kernels) where the fused CPU path applies (CPU, one scale per chunk, fp32 buffers, ``cpu_fused.use_fused``), else
the rows ops (``encode_rows``, ``feedback_rows``, ``decode_rows_sum``, ``decode_rows_into``: one multi-row op per
phase step, whatever K; Triton on CUDA). ``SPEC`` is the reference the tests compare against: piece by piece
through the codec's encode / decode. All three give the same bits (tests/collectives/test_onebit_batched.py,
tests/collectives/test_collectives.py); no value is read on the host off the CPU.

Example::

    send = KERNELS.worker(sign, y, n, c, err)    # then the all-to-all; KERNELS.server; the all-gather; decode_into
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_qcomm.codecs import cpu_fused, layout, sign_ops
from lightning_qcomm.codecs.base import Codec, Packed
from lightning_qcomm.codecs.rows import decode_rows, decode_rows_into, encode_rows, row_bucketed
from lightning_qcomm.codecs.rows_reduce import decode_rows_sum, feedback_rows


def _c_kernels(sign: Codec, c: int, *buffers: torch.Tensor) -> bool:
    """Whether the C sign kernels code chunks of c elements with these (contiguous) buffers: one scale per chunk,
    fp32 CPU buffers, the fused CPU path on for the sizes (``cpu_fused.use_fused``)."""
    return (
        sign.bucket_size is None
        and all(b.dtype == torch.float32 and b.is_contiguous() for b in buffers)
        and cpu_fused.use_fused(sign_ops._sign1(), buffers[0], c)
    )


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
    ncode = layout.packed_nbytes(c, 1)
    rows = wire.reshape(-1, p)
    r, c8 = rows.shape[0], 8 * ncode
    codes = rows[:, :ncode].contiguous().view(-1)
    scales = rows[:, ncode:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(r, 1)
    packed = Packed(codes, scales, torch.Size((r * c8,)), torch.float32)
    return row_bucketed(sign, c8).decode(packed).view(r, c8)[:, :c]


def _feedback(sign: Codec, y: torch.Tensor, wire: torch.Tensor, c: int, err: torch.Tensor) -> None:
    """err (flat, y's elements in row order) <- y - C(y) where finite, C(y) the first y.numel() values of the
    payloads ``wire`` (rows of c elements) decoded: ``feedback_rows`` with no correction (an empty reduced chunk),
    one launch on CUDA for fp32 buffers, the decode in its registers. ``y`` (K, L) is contiguous when K = 1 or L
    is a whole row (a group of several pieces has no padding); else it is copied. Only the rows that hold y's
    elements are read (the last chunks of a short piece may hold none)."""
    y = y.reshape(-1)
    wire = wire[: -(-y.numel() // c)]
    feedback_rows(sign, y, wire, c, y[:0], y, 0, 1.0, torch.float32, err)


def _chunks(n: int, c: int, world: int) -> list[int]:
    """Real (unpadded) elements of each of the N chunks of a piece of n elements."""
    return [max(min(c, n - j * c), 0) for j in range(world)]


# ---------------------------------------------------------------------------------------------- the ops' kernels
def worker(sign: Codec, y: torch.Tensor, n: int, c: int, err: torch.Tensor) -> torch.Tensor:
    """The worker's payloads and residuals (module docstring); ``err`` flat and contiguous."""
    k, w = y.shape[0], y.shape[1] // c
    if _c_kernels(sign, c, y, err):
        p = sign.nbytes(c)
        send = torch.empty(k * w, p, dtype=torch.uint8)
        for i in range(k):
            for j, length in enumerate(_chunks(n, c, w)):
                yj, e = y[i, j * c : (j + 1) * c], err[i * n + j * c : i * n + j * c + length]
                sign_ops.sign_encode_err(yj, sign_ops.sign_scale(yj), send[i * w + j], e, length, length)
        return send
    send = encode_rows(sign, y.view(k * w, c), [0] * (k * w))  # (K*N, P)
    _feedback(sign, y[:, :n], send, c, err)  # after Y, the group's last read of E_w
    return send


def server(sign: Codec, recv: torch.Tensor, k: int, c: int, valid: int, es: torch.Tensor) -> torch.Tensor:
    """The server's payloads of this rank's chunk of every piece and its residuals (module docstring): ``recv``
    the (N, K, P) received payloads, ``es`` the (K, c) server error, a view of a contiguous buffer."""
    p = sign.nbytes(c)
    w = recv.numel() // (k * p)
    if _c_kernels(sign, c, es):
        mine = torch.empty(k, p, dtype=torch.uint8)
        rows = recv.view(w, k, p)
        for i in range(k):
            z = torch.empty(c, dtype=torch.float32)
            sign_ops.sign_server_sum(rows[:, i].contiguous() if k > 1 else recv, w, c, es[i], valid, z)
            sign_ops.sign_encode_err(z, sign_ops.sign_scale(z), mine[i], es[i], valid, c)
        return mine
    if k == 1:  # one launch on CUDA, the rank-order sum and /N of the loop below
        z = decode_rows_sum(sign, recv, c, avg=True, rank_order=True).view(1, c)
    else:
        received = _decode_rows(sign, recv, c).reshape(w, k, c)
        z = received[0].clone()
        for r in range(1, w):  # in rank order, as the reference sums
            z += received[r]
        z.div_(w)
    z += es
    if valid < c:  # K = 1 here: a full piece has no padding
        z[:, valid:].zero_()
    mine = encode_rows(sign, z, [0] * k)  # (K, P)
    if valid:
        _feedback(sign, z[:, :valid], mine, c, es[:, :valid].view(-1))
    if valid < c:
        es[:, valid:].zero_()
    return mine


def decode_into(sign: Codec, rows: torch.Tensor, n: int, c: int, out: torch.Tensor) -> None:
    """out (K*n, flat) <- every piece's result from ``rows``, the gathered (K, N, P) payloads in piece order."""
    p = sign.nbytes(c)
    k = out.numel() // n
    w = rows.numel() // (k * p)
    if _c_kernels(sign, c, out):
        rows = rows.reshape(k * w, p)
        for i in range(k):
            for j, length in enumerate(_chunks(n, c, w)):
                if length:
                    sign_ops.sign_decode(rows[i * w + j], c, out[i * n + j * c : i * n + j * c + length])
    elif n == w * c:
        if _unaligned_rows(sign, c) and rows.numel() != p:
            out.view(k * w, c).copy_(_decode_rows(sign, rows, c))
        else:
            decode_rows_into(sign, rows, c, out.view(k * w, c))
    elif k == 1 and (w - 1) * c < n and not _unaligned_rows(sign, c):  # padding dropped by the codec op
        decode_rows_into(sign, rows, c, out)
    else:
        out.view(k, n).copy_(_decode_rows(sign, rows, c).reshape(k, w * c)[:, :n])


def wire_finite(sign: Codec, wire: torch.Tensor, c: int) -> torch.Tensor:
    """Whether payloads of chunks of c elements (``wire``, R rows of ``sign.nbytes(c)`` bytes, any shape) decode to
    finite values only: a 0-dim bool tensor, read from their scales (codes then scales, ``Packed.to_bytes``), with
    no decode and no host sync. C(v)'s values are ±scale, so they are all finite exactly when every scale is.

    Example::

        wire_finite(sign, gathered, c)   # tensor(True) unless some chunk's average was NaN or Inf
    """
    ncode = layout.packed_nbytes(c, sign.bits)
    rows = wire.reshape(-1, sign.nbytes(c))
    scales = rows[:, ncode:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # byte offsets: copy
    return scales.isfinite().all()


# ---------------------------------------------------------------------------------------------- the spec
def _update_error(err: torch.Tensor, new: torch.Tensor) -> None:
    """err <- new where new is finite (keeps the previous residual where a step was non-finite); branch-free."""
    new = new.reshape(err.shape)
    finite = new - new == 0  # x - x == 0 iff x is finite: two launches where torch.isfinite takes four
    if err.dtype == new.dtype:
        torch.where(finite, new, err, out=err)
    else:
        err.copy_(torch.where(finite, new, err.to(new.dtype)))


def _payload_values(sign: Codec, wire: torch.Tensor, c: int) -> torch.Tensor:
    """(R, c) fp32 values of R payloads, through the codec's decode of each."""
    return decode_rows(sign, wire, c).view(-1, c)


def worker_spec(sign: Codec, y: torch.Tensor, n: int, c: int, err: torch.Tensor) -> torch.Tensor:
    """``worker`` piece by piece: the codec's payloads, decoded, subtracted, kept where finite."""
    k, w = y.shape[0], y.shape[1] // c
    sends = []
    for i in range(k):
        send = encode_rows(sign, y[i].view(w, c), [0] * w)
        decoded = _payload_values(sign, send, c).reshape(-1)[:n]
        _update_error(err[i * n : (i + 1) * n], torch.sub(y[i, :n], decoded))
        sends.append(send.view(w, -1))
    return torch.cat(sends)


def server_spec(sign: Codec, recv: torch.Tensor, k: int, c: int, valid: int, es: torch.Tensor) -> torch.Tensor:
    """``server`` piece by piece: the received chunks decoded and summed in rank order, the codec's payload."""
    p = sign.nbytes(c)
    w = recv.numel() // (k * p)
    rows, mine = recv.view(w, k, p), []
    for i in range(k):
        received = _payload_values(sign, rows[:, i].contiguous(), c)
        z = received[0].clone()
        for r in range(1, w):  # in rank order
            z += received[r]
        z.div_(w)
        z += es[i].to(torch.float32)
        if valid < c:
            z[valid:] = 0.0
        payload = sign.encode(z, seed=0).to_bytes()
        new = z - sign.decode(sign.from_bytes(payload, (c,), torch.float32))
        if valid < c:
            new[valid:] = 0.0
        _update_error(es[i], new)
        mine.append(payload)
    return torch.stack(mine)


def decode_spec(sign: Codec, rows: torch.Tensor, n: int, c: int, out: torch.Tensor) -> None:
    """``decode_into`` piece by piece."""
    k = out.numel() // n
    pieces = rows.reshape(k, -1)
    for i in range(k):
        out[i * n : (i + 1) * n].copy_(_payload_values(sign, pieces[i], c).reshape(-1)[:n])


class Phases(NamedTuple):
    """One implementation of the three phases (module docstring)."""

    worker: Callable[..., torch.Tensor]
    server: Callable[..., torch.Tensor]
    decode_into: Callable[..., None]


KERNELS = Phases(worker, server, decode_into)
SPEC = Phases(worker_spec, server_spec, decode_spec)

__all__ = ["KERNELS", "SPEC", "Phases", "decode_into", "server", "wire_finite", "worker"]
