"""QSDP's weight all-gather gathers its wire rows into the output's own bytes (adapter layer; docs/design.md,
"QSDP").

FSDP2's all-gather output holds N rows of U bytes; the N wire rows take N P (P < U at every quantized width).
``region``: the output's last N P bytes from base, the largest address multiple of 16 at most N U - N P (the
decoders view fp32 scales in the wire bytes), stored as the all-gather's ``transport.PieceLayout`` stores them.
``decode_in_place`` never writes over a wire byte it has yet to read:

* rows j with (j + 1) U <= base touch no wire byte: decoded first, straight from the region (one call when the
  rows are whole, else a row at a time through one row's scratch);
* the k = N - base // U rows left, in row order: before row j is decoded, the wire rows i >= j with a byte in
  its span [j U, (j + 1) U) are copied out (row j's always), each copy freed once its row is decoded. Whole
  rows hold about one copy at a time (base >= N (U - P) - 15: with U - P >= 16 row j's span reaches no later
  wire row); rows cut into pieces spread over the whole region and may hold all k.

Extra memory beside the output: max(P, k P) (the encoded own row during the transfer, then the copies), not
(N + 1) P with a separate buffer. The decoder sees the same bytes per row: the output is bit-identical.

Example::

    into = gather_region.region(output, layout)         # None: no room (a wire as wide as the output)
    all_gather_pieces(into, mine, layout, group)
    decode_in_place(into, layout, rows, lambda wire, j0, j1: rc.decode(wire, rows[j0:j1]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_qcomm.comm.transport import PieceLayout

ALIGN = 16  # bytes: the region's start address is a multiple of this


def region(output: torch.Tensor, layout: PieceLayout) -> torch.Tensor | None:
    """The uint8 view of ``output``'s last bytes that holds the ``layout.world`` gathered rows, starting at an
    address that is a multiple of ``ALIGN``; None when ``output`` is not contiguous or the rows do not fit."""
    if not output.is_contiguous() or output.numel() == 0:
        return None
    flat = output.view(-1).view(torch.uint8)
    need = layout.world * layout.row_bytes
    base = flat.numel() - need
    base -= (flat.data_ptr() + base) % ALIGN
    if base < 0:
        return None
    return flat[base : base + need]


def _row_ranges(layout: PieceLayout, i: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of wire row i in a buffer stored in ``layout``."""
    n = layout.world
    return [(n * a + i * (b - a), n * a + (i + 1) * (b - a)) for a, b in layout.cols]


def _copy_row(buf: torch.Tensor, layout: PieceLayout, i: int) -> torch.Tensor:
    out = torch.empty(layout.row_bytes, dtype=torch.uint8, device=buf.device)
    if layout.pieced:
        return layout.read_row(buf, i, out)
    return out.copy_(layout.read_row(buf, i))


def decode_in_place(
    gathered: torch.Tensor,
    layout: PieceLayout,
    rows: torch.Tensor,
    decode: Callable[[torch.Tensor, int, int], None],
) -> None:
    """``decode(wire, j0, j1)`` for every row of ``rows`` (N, S), ``wire`` the (j1 - j0, P) wire rows j0 .. j1,
    where ``gathered`` (``region(rows, layout)``) lies inside ``rows``' bytes; in the order of the module
    docstring, so that no decode writes over a wire byte still to be read."""
    n, p = layout.world, layout.row_bytes
    u = rows.shape[1] * rows.element_size()
    base = gathered.data_ptr() - rows.data_ptr()
    if not (0 <= base and base + n * p <= n * u):
        raise ValueError(f"decode_in_place: gathered ({n} x {p} bytes at {base}) is not inside rows ({n} x {u})")
    first = min(n, base // u)  # rows [0, first) end at or before the region
    if first and not layout.pieced:
        decode(layout.block(gathered, 0)[:first], 0, first)
    elif first:
        scratch = torch.empty(p, dtype=torch.uint8, device=gathered.device)
        for j in range(first):
            decode(layout.read_row(gathered, j, scratch).view(1, -1), j, j + 1)
        del scratch
    ranges = [_row_ranges(layout, i) for i in range(n)]
    saved: dict[int, torch.Tensor] = {}
    for j in range(first, n):
        lo, hi = j * u - base, (j + 1) * u - base  # row j's span, in the region's offsets
        for i in range(j, n):
            if i not in saved and (i == j or any(s < hi and e > lo for s, e in ranges[i])):
                saved[i] = _copy_row(gathered, layout, i)
        wire = saved.pop(j)
        decode(wire.view(1, -1), j, j + 1)
        del wire


__all__ = ["ALIGN", "decode_in_place", "region"]
