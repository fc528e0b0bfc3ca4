"""The error-compensated 1-bit all-reduce (docs/design.md, "1-bit all-reduce"; collectives layer).

One algorithm on every device: the compressed collectives' engine (``collectives.engine.run_pipelined``: async
all-to-all, server step, async all-gather, decode) runs ``OneBitReducer`` over groups of equal pieces, whose three
phases are the codec layer's (``codecs.sign_phases.KERNELS``): the device of the tensors picks their kernels (the
C sign kernels on the CPU, the Triton rows kernels on CUDA), nothing here does. The schedule (``selected_path``)
runs every piece as a unit of its own on the CPU (gloo overlaps them) and the equal pieces as one unit off it (a
step bound by launches): the same values and wire bytes, only the number of collective calls differs.

Example::

    ew = torch.zeros(m.numel())                               # worker error, d elements
    es = torch.zeros(onebit_server_error_numel(m.numel()))    # server error, ceil(d / N) elements
    onebit_all_reduce(m, ew, es)                              # m <- its 1-bit average, same on all ranks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, get_codec
from lightning_qcomm.codecs.sign_phases import KERNELS, SPEC, Phases, wire_finite
from lightning_qcomm.collectives.call_check import _check_consistent
from lightning_qcomm.collectives.chunked import (
    FP32_BYTES,
    _check_piece_numel,
    _check_tensor,
    _chunk_len,
    _copy_back,
    _fp32_output,
    _payload,
)
from lightning_qcomm.collectives.engine import run_pipelined
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


# ------------------------------------------------------------------ the schedule and the reducer
PATHS = ("auto", "batched", "reference")
PATH = "auto"  # module switch: see ``selected_path``


def selected_path(x: torch.Tensor) -> str:
    """The schedule ``onebit_all_reduce`` runs for ``x``: ``"batched"`` (the equal pieces as one unit: off the
    CPU, where a step is bound by launches), ``"pieces"`` (one unit per piece: on the CPU, where gloo overlaps a
    piece's transfer with the next piece's phases) or ``"reference"`` (per piece, the phases of ``SPEC``). Both
    others run ``sign_phases.KERNELS``; the device picks their kernels. ``PATH`` forces ``"batched"`` or
    ``"reference"``; ValueError if it is not in ``PATHS``.

    Example::

        selected_path(torch.zeros(8, device="cuda"))   # "batched"
    """
    if PATH not in PATHS:
        raise ValueError(f"sign_collective.PATH={PATH!r}: allowed {PATHS}")
    if PATH != "auto":
        return PATH
    return "batched" if x.device.type != "cpu" else "pieces"


@dataclass(frozen=True)
class PieceGroup:
    """``count`` consecutive pieces of ``numel`` elements each from element ``offset``, chunks of ``chunk``
    elements; their server-error elements start at ``es_offset`` (``count * chunk`` of them)."""

    offset: int
    count: int
    numel: int
    chunk: int
    es_offset: int


def piece_groups(pieces: list[tuple[int, int]], world: int, batched: bool = True) -> list[PieceGroup]:
    """``pieces`` (``onebit_pieces``) merged into groups of consecutive pieces of equal length: at most two, the
    full pieces and the shorter last one (``batched`` False: one group per piece).

    Example::

        piece_groups([(0, 6), (6, 6), (12, 4)], 2)   # [PieceGroup(0, 2, 6, 3, 0), PieceGroup(12, 1, 4, 2, 6)]
    """
    groups: list[PieceGroup] = []
    es = 0
    for o, n in pieces:
        c = _chunk_len(n, world)
        last = groups[-1] if groups else None
        if batched and last is not None and last.numel == n and last.offset + last.count * n == o:
            groups[-1] = PieceGroup(last.offset, last.count + 1, n, c, last.es_offset)
        else:
            groups.append(PieceGroup(o, 1, n, c, es))
        es += c
    return groups


class OneBitReducer:
    """``collectives.engine``'s reducer of the 1-bit all-reduce, the units being ``piece_groups``; one instance per
    call. ``phases``: ``sign_phases.KERNELS`` (or ``SPEC``).

    ``x``: the input, read whole by ``encode`` before ``decode`` writes ``out_flat`` (which may be its storage);
    ``out_flat`` None: ``decode`` keeps each group's gathered payloads in ``kept`` instead (``OneBitWire``).
    The residuals go straight into the error buffers, each group's own elements once that group no longer reads
    them; a buffer that is not contiguous is worked on in a flat copy, copied back by ``finish``.
    """

    def __init__(self, phases: Phases, sign: Codec, x, out_flat, worker_error, server_error, rank: int, world: int):
        self.phases, self.sign, self.rank, self.world = phases, sign, rank, world
        self.x_flat, self.out_flat = x.detach().reshape(-1), out_flat
        self.kept: list[tuple[PieceGroup, torch.Tensor]] | None = None if out_flat is not None else []
        self.worker_error, self.server_error = worker_error, server_error
        self.flat_ew = worker_error.detach().reshape(-1)  # a view where reshape can make one, else a copy
        self.flat_es = server_error.detach().reshape(-1)

    def chunk_nbytes(self, g: PieceGroup) -> int:
        return g.count * self.sign.nbytes(g.chunk)

    def encode(self, g: PieceGroup) -> torch.Tensor:
        """Payloads of every piece's chunks, (N, K, P) uint8 (row j for rank j); E_w of the group's elements."""
        k, n, c, w = g.count, g.numel, g.chunk, self.world
        span = slice(g.offset, g.offset + k * n)
        x, ew = self.x_flat[span].view(k, n), self.flat_ew[span].view(k, n)
        if n == w * c:
            y = torch.add(x, ew, out=torch.empty(k, n, dtype=torch.float32, device=x.device))
        else:  # the pieces' zero padding to N*c (a short piece is a group of its own: K = 1)
            y = torch.zeros(k, w * c, dtype=torch.float32, device=x.device)
            torch.add(x, ew, out=y[:, :n])
        send = self.phases.worker(self.sign, y, n, c, self.flat_ew[span])  # (K*N, P)
        return send.view(k, w, -1).transpose(0, 1).contiguous() if k > 1 else send

    def reduce(self, g: PieceGroup, recv: torch.Tensor) -> torch.Tensor:
        """This rank's (K, P) payloads from the received (N, K, P) ones; E_s of the group's elements."""
        k, c = g.count, g.chunk
        valid = max(min(c, g.numel - self.rank * c), 0)  # real (unpadded) elements of this rank's chunks
        es = self.flat_es[g.es_offset : g.es_offset + k * c].view(k, c)
        return self.phases.server(self.sign, recv, k, c, valid, es)

    def decode(self, g: PieceGroup, gathered: torch.Tensor) -> None:
        """out[group] <- concat_j C(Z_j[k])[:n] for every piece k, from the gathered (N, K, P) payloads."""
        if self.kept is not None:
            self.kept.append((g, gathered))
            return
        _decode_group(self.phases, self.sign, self.world, g, gathered, self.out_flat)

    def finish(self) -> None:
        for buf, flat in ((self.worker_error, self.flat_ew), (self.server_error, self.flat_es)):
            if not buf.is_contiguous():  # worked on in a copy
                buf.copy_(flat.view(buf.shape))


def _decode_group(phases: Phases, sign: Codec, world: int, g: PieceGroup, gathered: torch.Tensor, out_flat) -> None:
    """out_flat[group] <- concat_j C(Z_j[k])[:n] for every piece k of ``g``, from its gathered (N, K, P) payloads."""
    k, n = g.count, g.numel
    p = gathered.numel() // (world * k)
    rows = gathered.view(world, k, p).transpose(0, 1).contiguous() if k > 1 else gathered  # (K, N, P): piece order
    phases.decode_into(sign, rows, n, g.chunk, out_flat[g.offset : g.offset + k * n])


class OneBitWire:
    """A finished 1-bit all-reduce whose average is still in its wire form: every group's gathered payloads
    (about d/8 bytes + 4 per scale, where the decoded average takes 4d). ``decode`` writes the values
    ``onebit_all_reduce`` leaves in x, bit for bit; ``finite`` says whether they are all finite, from the scales.

    Example::

        wire = onebit_all_reduce_wire(m, ew, es)    # the error buffers have moved on; m is not written
        if bool(wire.finite()):
            m.copy_(wire.decode())
    """

    def __init__(self, phases: Phases, sign: Codec, world: int, numel: int, kept) -> None:
        self.phases, self.sign, self.world, self.numel = phases, sign, world, numel
        self.kept: list[tuple[PieceGroup, torch.Tensor]] = kept

    def nbytes(self) -> int:
        """Bytes held: the gathered payloads."""
        return sum(gathered.numel() for _, gathered in self.kept)

    def finite(self) -> torch.Tensor:
        """0-dim bool tensor: every decoded value is finite (no decode, no host sync)."""
        flags = [wire_finite(self.sign, gathered, g.chunk) for g, gathered in self.kept]
        return torch.stack(flags).all()

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The average, flat fp32 (into ``out``, contiguous fp32 of ``numel`` elements, when given)."""
        device = self.kept[0][1].device
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=device)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != self.numel:
            raise ValueError(
                f"OneBitWire.decode(out={tuple(out.shape)} {out.dtype}): allowed a contiguous fp32 tensor of "
                f"{self.numel} elements"
            )
        for g, gathered in self.kept:
            _decode_group(self.phases, self.sign, self.world, g, gathered, out.view(-1))
        return out


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
    all-gather issued once its all-to-all is done). Off the CPU (``selected_path``; ``PATH`` forces a schedule)
    all pieces of equal length run as one batch: one all-to-all and one all-gather per group of them, the same
    values and bytes, a number of torch ops that does not grow with the number of pieces.
    Wire per rank ~ 2(N-1)/N * d/8 bytes plus 8(N-1)
    bytes of scales per piece (1/32 of an fp32 ring all-reduce); with blocks, 4 bytes per B elements more
    (1/32 · (1 + 32/B)). The error buffers move on only where the new residual is finite.
    Ledger: all_reduce, collective = sum_k N*P_k with P_k = ceil(c_k/8) + 4 (+ 4 ceil(c_k/B) instead of 4
    with blocks), payload sum_k (N+1)*P_k,
    baseline 4*d.

    Example::

        ew, es = torch.zeros(d), torch.zeros(onebit_server_error_numel(d))
        onebit_all_reduce(momentum.view(-1), ew, es, tag="momentum")
    """
    reducer = _run(x, worker_error, server_error, group, tag, check, piece_numel, block_numel, _fp32_output(x))
    _copy_back(x, reducer.out_flat)
    return x


def onebit_all_reduce_wire(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tag: str = "momentum",
    check: bool = True,
    piece_numel: int = DEFAULT_ONEBIT_PIECE_NUMEL,
    block_numel: int | None = None,
) -> OneBitWire:
    """``onebit_all_reduce`` with the average kept in its wire form (``OneBitWire``) instead of decoded into x: the
    same collectives, wire bytes, ledger entry and error buffers; x is only read, and may be freed on return. What
    a caller holds until it needs the values (1-bit Adam's overlapped buckets) is then 1/32 of x.

    Example::

        wire = onebit_all_reduce_wire(m.view(-1), ew, es)
        m.view(-1).copy_(wire.decode())      # the bits onebit_all_reduce(m.view(-1), ew, es) leaves in m
    """
    reducer = _run(x, worker_error, server_error, group, tag, check, piece_numel, block_numel, None)
    return OneBitWire(reducer.phases, reducer.sign, reducer.world, x.numel(), reducer.kept)


def _run(x, worker_error, server_error, group, tag, check, piece_numel, block_numel, out_flat) -> OneBitReducer:
    """Check the arguments, run the pipelined reducer (decoding into ``out_flat``, or keeping the wire when it is
    None), record the ledger entry; the reducer."""
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
    path = selected_path(x)
    phases = SPEC if path == "reference" else KERNELS
    reducer = OneBitReducer(phases, sign, x, out_flat, worker_error, server_error, rank, world)
    units = piece_groups(pieces, world, batched=path == "batched")
    total_p = run_pipelined(reducer, units, group, world)  # x is read whole before out_flat is written
    get_ledger().record(
        "all_reduce", world * total_p, d * FP32_BYTES, world, _payload((world + 1) * total_p, world), tag
    )
    return reducer


__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "PATH",
    "PATHS",
    "OneBitReducer",
    "PieceGroup",
    "check_block_numel",
    "OneBitWire",
    "onebit_all_reduce",
    "onebit_all_reduce_wire",
    "onebit_pieces",
    "onebit_server_error_numel",
    "piece_groups",
    "selected_path",
]
