"""Byte transport of the compressed collectives: all-to-all and all-gather of uint8 rows (comm layer).

This file owns how payload bytes reach the other ranks; what the bytes mean is the collectives' (codecs)
business. Only two torch primitives carry payloads: ``all_to_all_single`` (gloo has no list
``all_to_all``) and ``all_gather_single`` (called ``all_gather_into_tensor`` before torch 2.13); both run on
gloo and NCCL. The version shims look the function up on ``torch.distributed`` per call, so wrappers
installed there (tests, benchmarks) are seen.

On CPU/gloo a row longer than ``TRANSFER_PIECE_BYTES`` is cut into at most ``MAX_TRANSFER_PIECES`` column
ranges issued as concurrent exchanges (a blocking gloo exchange of a few MB leaves a shaped TCP link partly
idle: BENCHMARKS.md §3, "Why two blocking phases lose the link"); the bytes and the result are those of one
call. CUDA tensors go as one call (NCCL pipelines internally).

Those pieces cost a copy of every piece of the send rows and a receive buffer per piece, the size of the
wire buffers again. A caller that builds its rows itself avoids them with ``PieceLayout``: the rows stored
piece by piece (each piece's column range of all N rows one contiguous block), which
``all_to_all_pieces`` exchanges block by block with no temporaries (QSDP's gradient reduce-scatter).

Example::

    recv = torch.empty_like(send)            # send: N rows of equal length, row j for rank j
    all_to_all_bytes(recv, send, group)      # recv row r: what rank r sent to this rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# min bytes per rank per concurrent sub-exchange of all_to_all_bytes / all_gather_bytes (the choice is
# measured in BENCHMARKS.md §3, "Transfer pieces"); smaller pieces cost per-call overhead on fast links
TRANSFER_PIECE_BYTES = 1 << 17
MAX_TRANSFER_PIECES = 16  # ... and at most this many sub-exchanges per call


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


def _column_pieces(row_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[a, b) byte ranges of a row cut for ``all_to_all_bytes`` / ``all_gather_bytes``: pieces of at least
    ``piece_bytes``, at most ``MAX_TRANSFER_PIECES`` of them; one range if the row is short."""
    if row_bytes <= piece_bytes:
        return [(0, row_bytes)]
    size = max(piece_bytes, -(-row_bytes // MAX_TRANSFER_PIECES))
    return [(a, min(a + size, row_bytes)) for a in range(0, row_bytes, size)]


def _exchange_columns(dst: torch.Tensor, cols: list[tuple[int, int]], world: int, issue) -> None:
    """Issue ``issue(piece_out, a, b)`` (async) for every column range, then write each piece's N rows into
    ``dst`` (world, row) as it completes."""
    works = []
    for a, b in cols:
        piece_out = torch.empty(world * (b - a), dtype=dst.dtype, device=dst.device)
        works.append((a, b, piece_out, issue(piece_out, a, b)))
    for a, b, piece_out, work in works:
        work.wait()
        dst[:, a:b] = piece_out.view(world, b - a)


def all_to_all_bytes(
    recv: torch.Tensor,
    send: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    piece_bytes: int = TRANSFER_PIECE_BYTES,
) -> None:
    """``all_to_all_single`` of N equal rows of bytes (row j of ``send`` to rank j, row r of ``recv`` from
    rank r), issued on CPU/gloo as up to ``MAX_TRANSFER_PIECES`` concurrent exchanges of >= ``piece_bytes``
    per row. CUDA tensors go as one call. Same bytes, same result either way.

    Example::

        send = torch.arange(2 * 4, dtype=torch.uint8)    # 2 ranks: bytes 0..3 to rank 0, 4..7 to rank 1
        recv = torch.empty_like(send)
        all_to_all_bytes(recv, send)                     # world of one: recv == send
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
    src = send.view(world, row)

    def issue(piece_out: torch.Tensor, a: int, b: int):
        return dist.all_to_all_single(piece_out, src[:, a:b].contiguous().view(-1), group=group, async_op=True)

    _exchange_columns(recv.view(world, row), cols, world, issue)


@dataclass(frozen=True)
class PieceLayout:
    """N rows of ``row_bytes`` bytes stored piece-major in one flat uint8 buffer: the column range
    ``cols[p] = (a, b)`` of all N rows is the contiguous (N, b - a) block at offset N * a, so every concurrent
    exchange of ``all_to_all_pieces`` sends and receives contiguous memory. One range (plain row-major
    rows) for short rows and on CUDA, as ``all_to_all_bytes`` cuts them.

    Example::

        layout = PieceLayout.for_rows(world, row_bytes, device)
        send = layout.empty(device)
        layout.write(send, 0, rows_bytes)              # (world, w) bytes into columns 0..w of every row
        recv = layout.empty(device)
        all_to_all_pieces(recv, send, layout, group)
        layout.read_row(recv, j, scratch)              # what rank j sent, as one contiguous row
    """

    world: int
    row_bytes: int
    cols: tuple[tuple[int, int], ...]

    @classmethod
    def for_rows(cls, world: int, row_bytes: int, device: torch.device, piece_bytes: int | None = None) -> PieceLayout:
        """The rows cut as ``all_to_all_bytes`` cuts them (``piece_bytes`` default: ``TRANSFER_PIECE_BYTES``)."""
        piece_bytes = TRANSFER_PIECE_BYTES if piece_bytes is None else piece_bytes
        cols = _column_pieces(row_bytes, piece_bytes) if device.type == "cpu" else [(0, row_bytes)]
        return cls(world, row_bytes, tuple(cols))

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.world * self.row_bytes, dtype=torch.uint8, device=device)

    def block(self, buf: torch.Tensor, p: int) -> torch.Tensor:
        """Piece p of all rows, (N, b - a)."""
        a, b = self.cols[p]
        return buf[self.world * a : self.world * b].view(self.world, b - a)

    def _overlaps(self, c0: int, c1: int):
        for p, (a, b) in enumerate(self.cols):
            lo, hi = max(a, c0), min(b, c1)
            if lo < hi:
                yield p, a, lo, hi

    def write(self, buf: torch.Tensor, c0: int, src: torch.Tensor) -> None:
        """Columns c0 .. c0 + w of every row <- ``src`` (N, w), any strides."""
        for p, a, lo, hi in self._overlaps(c0, c0 + src.shape[1]):
            self.block(buf, p)[:, lo - a : hi - a].copy_(src[:, lo - c0 : hi - c0])

    def span(self, buf: torch.Tensor, j: int, c0: int, c1: int) -> torch.Tensor | None:
        """Columns c0 .. c1 of row j as a contiguous view, or None when they cross a piece boundary."""
        for p, a, lo, hi in self._overlaps(c0, c1):
            return self.block(buf, p)[j, c0 - a : c1 - a] if (lo, hi) == (c0, c1) else None
        return None

    def write_row(self, buf: torch.Tensor, j: int, c0: int, src: torch.Tensor) -> None:
        """Columns c0 .. c0 + len(src) of row j <- ``src``."""
        for p, a, lo, hi in self._overlaps(c0, c0 + src.numel()):
            self.block(buf, p)[j, lo - a : hi - a].copy_(src[lo - c0 : hi - c0])

    @property
    def pieced(self) -> bool:
        """Whether the rows are cut into more than one piece (else ``buf`` is plain (N, row_bytes) rows)."""
        return len(self.cols) > 1

    def read_row(self, buf: torch.Tensor, j: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Row j as one contiguous tensor: a view of ``buf`` when not ``pieced``, else copied into ``scratch``
        (``row_bytes`` uint8)."""
        if not self.pieced:
            return self.block(buf, 0)[j]
        for p, (a, b) in enumerate(self.cols):
            scratch[a:b].copy_(self.block(buf, p)[j])
        return scratch


def all_to_all_pieces(
    recv: torch.Tensor, send: torch.Tensor, layout: PieceLayout, group: dist.ProcessGroup | None = None
) -> None:
    """``all_to_all_bytes`` of rows stored in ``layout`` (``send`` and ``recv`` flat, piece-major): one
    ``all_to_all_single`` per piece, all in flight at once, none copied."""
    _, world = _rank_world(group)
    if world == 1:
        recv.copy_(send)
        return
    if not layout.pieced:
        dist.all_to_all_single(recv, send, group=group)
        return
    works = [
        dist.all_to_all_single(
            layout.block(recv, p).view(-1), layout.block(send, p).view(-1), group=group, async_op=True
        )
        for p in range(len(layout.cols))
    ]
    for work in works:
        work.wait()


def all_gather_pieces(
    out: torch.Tensor, inp: torch.Tensor, layout: PieceLayout, group: dist.ProcessGroup | None = None
) -> None:
    """``all_gather_bytes`` into N rows stored in ``layout`` (``out`` flat, piece-major; ``inp`` one row of
    ``layout.row_bytes``): one gather per piece, all in flight at once, each straight into its block of ``out``
    (no piece buffers beside ``out``, no copies)."""
    _, world = _rank_world(group)
    if world == 1:
        out.copy_(inp.view(-1))
        return
    if not layout.pieced:
        _all_gather_single(out, inp.view(-1), group)
        return
    fn, src = _all_gather_fn(), inp.view(-1)
    works = [
        fn(layout.block(out, p).view(-1), src[a:b], group=group, async_op=True) for p, (a, b) in enumerate(layout.cols)
    ]
    for work in works:
        work.wait()


def all_gather_bytes(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    piece_bytes: int = TRANSFER_PIECE_BYTES,
) -> None:
    """``all_gather_single`` (rank r's ``inp`` into row r of ``out``), issued on CPU/gloo as up to
    ``MAX_TRANSFER_PIECES`` concurrent gathers of >= ``piece_bytes`` per rank (see ``all_to_all_bytes``).

    Example::

        mine = torch.full((4,), 7, dtype=torch.uint8)
        out = torch.empty(world_size * 4, dtype=torch.uint8)
        all_gather_bytes(out, mine)                      # out row r: rank r's four bytes
    """
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
    src = inp.view(-1)

    def issue(piece_out: torch.Tensor, a: int, b: int):
        return fn(piece_out, src[a:b], group=group, async_op=True)

    _exchange_columns(out.view(world, row), cols, world, issue)


# ------------------------------------------------------------------ world-size-aware forms the collectives call
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


__all__ = [
    "MAX_TRANSFER_PIECES",
    "TRANSFER_PIECE_BYTES",
    "PieceLayout",
    "all_gather_bytes",
    "all_gather_pieces",
    "all_to_all_bytes",
    "all_to_all_pieces",
]
