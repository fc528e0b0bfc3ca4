"""The error-compensated 1-bit all-reduce (docs/design.md, "1-bit all-reduce"; comm layer).

The compressed collectives' engine (``collectives.engine.run_pipelined``: async all-to-all, server step, async
all-gather, decode) runs one of three reducers: ``_ReferencePhases`` per piece through the ``sign1`` codec's
encode/decode (the spec), ``_FusedPhases`` per piece through the codec layer's fused CPU sign phases
(``codecs.sign_fused``), bit-identical to it, or, off the CPU, ``collectives.sign_batched``'s groups of equal pieces as
one batch (the same values, one collective per group, no host sync). The engine alone decides the order of
reads, writes and collectives, so the per-piece paths issue the same collectives with the same bytes.

Example::

    ew = torch.zeros(m.numel())                               # worker error, d elements
    es = torch.zeros(onebit_server_error_numel(m.numel()))    # server error, ceil(d / N) elements
    onebit_all_reduce(m, ew, es)                              # m <- its 1-bit average, same on all ranks
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, get_codec, sign_fused
from lightning_qcomm.collectives.call_check import _check_consistent
from lightning_qcomm.collectives.chunked import (
    FP32_BYTES,
    _check_piece_numel,
    _check_tensor,
    _chunk_len,
    _copy_back,
    _decode_bytes,
    _decode_rows,
    _encode_bytes,
    _encode_rows,
    _fp32_output,
    _payload,
    _update_error,
)
from lightning_qcomm.collectives.engine import run_pipelined
from lightning_qcomm.collectives.sign_batched import BatchedPhases, piece_groups, selected_path
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.transport import _rank_world

DEFAULT_ONEBIT_PIECE_NUMEL = 1 << 18  # min elements per rank per pipelined piece (32 KB of signs per rank)

_SIGN1: dict[int | None, Codec] = {}


def _sign_codec(block_numel: int | None = None) -> Codec:
    """The sign1 codec with one scale per chunk (``block_numel`` None) or per block of ``block_numel`` elements."""
    if block_numel not in _SIGN1:
        _SIGN1[block_numel] = get_codec("sign1", bits=1, bucket_size=block_numel)
    return _SIGN1[block_numel]


def check_block_numel(block_numel: int | None, where: str = "onebit_all_reduce") -> None:
    """ValueError naming ``where`` unless ``block_numel`` is None or an int >= 8 (one scale per that many elements)."""
    if block_numel is not None and (
        not isinstance(block_numel, int) or isinstance(block_numel, bool) or block_numel < 8
    ):
        raise ValueError(f"{where}(block_numel={block_numel!r}): allowed None (one scale per chunk) or an int >= 8")


def onebit_pieces(numel: int, world_size: int, piece_numel: int = DEFAULT_ONEBIT_PIECE_NUMEL) -> list[tuple[int, int]]:
    """(offset, length) of the pieces ``onebit_all_reduce`` pipelines ``numel`` elements in: N*m each
    (m = ``piece_numel``), the last one shorter; at most N*m elements are one piece.

    Example::

        onebit_pieces(10, 2, piece_numel=3)   # [(0, 6), (6, 4)]
    """
    _check_piece_numel(piece_numel)
    step = world_size * piece_numel
    if numel <= step:
        return [(0, numel)]
    return [(o, min(step, numel - o)) for o in range(0, numel, step)]


def onebit_server_error_numel(numel: int, group: dist.ProcessGroup | None = None) -> int:
    """Length of ``server_error`` for ``onebit_all_reduce`` of a tensor of ``numel`` elements: ceil(numel/N)
    (the sum over pieces of each piece's chunk length, which adds up to the same).

    Example::

        es = torch.zeros(onebit_server_error_numel(m.numel(), group))
    """
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    return _chunk_len(numel, _rank_world(group)[1])


# ------------------------------------------------------------------ the phase kernels
class _PieceReducer:
    """``collectives.engine``'s reducer over the pieces, units (offset, length n, chunk c, server-error offset):
    encode builds y = x + e_w zero-padded to N*c and hands it to ``worker``; reduce hands the received chunks
    and the real length of this rank's chunk to ``server``; decode writes the piece's result through
    ``decode_into``. Subclasses are the phase kernels."""

    sign: Codec

    def __init__(self, x: torch.Tensor, out_flat: torch.Tensor, worker_error: torch.Tensor, rank: int, world: int):
        self.rank, self.world = rank, world
        self.flat_x, self.out_flat = x.detach().reshape(-1), out_flat
        self.flat_y_err = worker_error.detach().reshape(-1)

    def chunk_nbytes(self, unit) -> int:
        return self.sign.nbytes(unit[2])

    def encode(self, unit) -> torch.Tensor:
        o, n, c, _e = unit
        y = torch.empty(self.world * c, dtype=torch.float32, device=self.flat_x.device)
        torch.add(self.flat_x[o : o + n], self.flat_y_err[o : o + n], out=y[:n])
        y[n:].zero_()
        return self.worker(y, o, n, c)

    def reduce(self, unit, recv: torch.Tensor) -> torch.Tensor:
        _o, n, c, e_off = unit
        valid = max(min(c, n - self.rank * c), 0)  # real (unpadded) elements of this rank's chunk
        return self.server(recv, c, e_off, valid)

    def decode(self, unit, gathered: torch.Tensor) -> None:
        o, n, c, _e = unit
        self.decode_into(gathered, c, self.out_flat[o : o + n])


class _ReferencePhases(_PieceReducer):
    """The three per-piece steps through the sign1 codec's encode/decode (the spec). New residuals go to
    temporary buffers and enter the error buffers at the end where finite (``_update_error``)."""

    def __init__(self, x, out_flat, worker_error: torch.Tensor, server_error: torch.Tensor, rank, world, sign: Codec):
        super().__init__(x, out_flat, worker_error, rank, world)
        self.sign = sign
        self.worker_error, self.server_error = worker_error, server_error
        self.flat_es = server_error.detach().reshape(-1)
        self.new_ew = torch.empty(worker_error.numel(), dtype=torch.float32, device=x.device)
        self.new_es = torch.empty(self.flat_es.numel(), dtype=torch.float32, device=x.device)

    def worker(self, y: torch.Tensor, o: int, n: int, c: int) -> torch.Tensor:
        """Payloads C(y[chunk j]) for every rank j; e_w[o:o+n] <- y - C(y)."""
        send = _encode_rows(self.sign, y.view(self.world, c), [0] * self.world)
        decoded = _decode_rows(self.sign, send, self.world, c).view(-1)[:n]
        torch.sub(y[:n], decoded, out=self.new_ew[o : o + n])
        return send

    def server(self, recv: torch.Tensor, c: int, e_off: int, valid: int) -> torch.Tensor:
        """z = mean of the received chunks (rank order) + e_s, padding zeroed; payload C(z); e_s <- z - C(z)."""
        received = _decode_rows(self.sign, recv, self.world, c)
        z = received[0].clone()
        for r in range(1, self.world):  # in rank order, as the fused path sums (a decode-sum codec op would fuse this)
            z += received[r]
        z.div_(self.world)
        z += self.flat_es[e_off : e_off + c].to(torch.float32)
        if valid < c:
            z[valid:] = 0.0
        mine = _encode_bytes(self.sign, z, 0)
        es = torch.sub(z, _decode_bytes(self.sign, mine, c), out=self.new_es[e_off : e_off + c])
        if valid < c:
            es[valid:] = 0.0
        return mine

    def decode_into(self, gathered: torch.Tensor, c: int, out: torch.Tensor) -> None:
        """out <- concat_j C(z_j)[:len(out)]."""
        out.copy_(_decode_rows(self.sign, gathered, self.world, c).view(-1)[: out.numel()])

    def finish(self) -> None:
        _update_error(self.worker_error, self.new_ew)
        _update_error(self.server_error, self.new_es)


class _FusedPhases(_PieceReducer):
    """The same steps in fused CPU passes, bit for bit: per chunk one norm (torch) and one pass for the codes
    and the residual, written straight into the error buffers (finite residuals only) and the payloads; the
    server sum and the final decode are one pass each. Error buffers must be contiguous fp32 on the CPU."""

    def __init__(self, x, out_flat, worker_error: torch.Tensor, server_error: torch.Tensor, rank, world) -> None:
        super().__init__(x, out_flat, worker_error, rank, world)
        self.sign = _sign_codec()
        self.flat_ew = worker_error.detach().view(-1)
        self.flat_es = server_error.detach().view(-1)

    def worker(self, y: torch.Tensor, o: int, n: int, c: int) -> torch.Tensor:
        p = self.sign.nbytes(c)
        send = torch.empty(self.world * p, dtype=torch.uint8)
        for j in range(self.world):
            yj = y[j * c : (j + 1) * c]
            length = max(min(c, n - j * c), 0)
            ew_j = self.flat_ew[o + j * c : o + j * c + length] if length else self.flat_ew[:0]
            sign_fused.encode_with_error(yj, send[j * p : (j + 1) * p], ew_j, length, length)
        return send

    def server(self, recv: torch.Tensor, c: int, e_off: int, valid: int) -> torch.Tensor:
        es = self.flat_es[e_off : e_off + c]
        z = torch.empty(c, dtype=torch.float32)
        sign_fused.server_sum(recv, self.world, c, es, valid, z)
        mine = torch.empty(self.sign.nbytes(c), dtype=torch.uint8)
        sign_fused.encode_with_error(z, mine, es, valid, c)
        return mine

    def decode_into(self, gathered: torch.Tensor, c: int, out: torch.Tensor) -> None:
        p, n = self.sign.nbytes(c), out.numel()
        for j in range(self.world):
            length = max(min(c, n - j * c), 0)
            if length:
                sign_fused.decode(gathered[j * p : (j + 1) * p], c, out[j * c : j * c + length])

    def finish(self) -> None:
        pass  # the residuals are already in the error buffers


def _piece_units(pieces: list[tuple[int, int]], world: int) -> list[tuple[int, int, int, int]]:
    """(offset, n, c, server-error offset) of every piece: this rank's chunks of the pieces, in piece order."""
    units, es_off = [], 0
    for o, n in pieces:
        c = _chunk_len(n, world)
        units.append((o, n, c, es_off))
        es_off += c
    return units


def onebit_all_reduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tag: str = "momentum",
    check: bool = True,
    piece_numel: int = DEFAULT_ONEBIT_PIECE_NUMEL,
    block_numel: int | None = None,
) -> torch.Tensor:
    """Error-compensated 1-bit average over ranks (docs/design.md, "1-bit all-reduce"), in place on a flat fused buffer.

    The buffer is cut into pieces of N*m elements (``onebit_pieces``, m = ``piece_numel``); each piece,
    of length n, runs the algorithm below on its own, with chunks of c = ceil(n/N) elements.
    C(v) = (||v||_2 / sqrt(len v)) * sign(v), sign(0) = +1, applied per chunk (the ``sign1`` codec with one
    bucket per chunk; the zero tail padding of the last chunk counts in its length), or, with ``block_numel`` = B,
    per block of B consecutive elements of each chunk (the last block shorter): one fp32 scale per block. With e_w =
    ``worker_error`` (d elements) and e_s = ``server_error`` (this rank's chunk of every piece, in piece
    order: ceil(d/N) elements, see ``onebit_server_error_numel``)::

        worker r:  y = x + e_w (zero-padded to N*c); send C(y[chunk j]) to rank j; e_w <- y - C(y)  (n elements)
        server j:  z = (1/N) sum_r C(y_r[chunk j]) + e_s  (sum in rank order; padding positions of z set to 0);
                   send C(z) to all; e_s <- z - C(z)  (padding positions kept 0)
        all:       x <- concat_j C(z_j)[:n], identical on every rank.

    Pieces are pipelined as in ``quantized_all_reduce`` (async all-to-all per piece; each piece's
    all-gather issued once its all-to-all is done). Off the CPU (``collectives.sign_batched``; ``sign_batched.PATH``
    selects) all pieces of equal length run as one batch: one all-to-all and one all-gather per group of them,
    the same values and bytes, a number of torch ops that does not grow with the number of pieces. Wire per rank ~ 2(N-1)/N * d/8 bytes plus 8(N-1)
    bytes of scales per piece (1/32 of an fp32 ring all-reduce); with blocks, 4 bytes per B elements more
    (1/32 · (1 + 32/B)). The error buffers move on only where the new residual is finite.
    Ledger: all_reduce, collective = sum_k N*P_k with P_k = ceil(c_k/8) + 4 (+ 4 ceil(c_k/B) instead of 4
    with blocks), payload sum_k (N+1)*P_k,
    baseline 4*d.

    Example::

        ew, es = torch.zeros(d), torch.zeros(onebit_server_error_numel(d))
        onebit_all_reduce(momentum.view(-1), ew, es, tag="momentum")
    """
    _check_tensor("x", x)
    _check_tensor("worker_error", worker_error)
    _check_tensor("server_error", server_error)
    _check_piece_numel(piece_numel)
    check_block_numel(block_numel)
    sign = _sign_codec(block_numel)
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
            codec=None if block_numel is None else sign,
            aux=piece_numel,
            device=x.device,
        )
    pieces = onebit_pieces(d, world, piece_numel)
    fused = (  # the fused CPU kernels code one scale per chunk
        block_numel is None
        and worker_error.dtype == torch.float32
        and server_error.dtype == torch.float32
        and worker_error.is_contiguous()
        and server_error.is_contiguous()
        and worker_error.device.type == "cpu"
        and server_error.device.type == "cpu"
        and sign_fused.available(x, _chunk_len(pieces[0][1], world))
    )
    path = selected_path(x, fused)
    out_flat = _fp32_output(x)
    if path == "batched":  # every piece in one set of multi-row ops (collectives.sign_batched)
        reducer = BatchedPhases(sign, x, out_flat, worker_error, server_error, rank, world)
        units = piece_groups(pieces, world)
    else:
        if path == "fused":
            reducer = _FusedPhases(x, out_flat, worker_error, server_error, rank, world)
        else:
            reducer = _ReferencePhases(x, out_flat, worker_error, server_error, rank, world, sign)
        units = _piece_units(pieces, world)
    total_p = run_pipelined(reducer, units, group, world)  # x is read whole before out_flat is written
    _copy_back(x, out_flat)
    get_ledger().record(
        "all_reduce", world * total_p, d * FP32_BYTES, world, _payload((world + 1) * total_p, world), tag
    )
    return x


__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "check_block_numel",
    "onebit_all_reduce",
    "onebit_pieces",
    "onebit_server_error_numel",
]
