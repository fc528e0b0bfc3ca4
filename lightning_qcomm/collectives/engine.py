"""The pipelined two-phase exchange every compressed all-reduce runs (collectives layer; docs/design.md,
"Pieces, overlap and the consistency check").

Each unit of work goes through two collectives, its math in a *reducer*: ``reducer.encode(u)`` (row j for rank j;
``all_to_all_single``), ``reducer.reduce(u, recv)`` (this rank's reduced chunk; ``all_gather_single``),
``reducer.decode(u, gathered)`` (the unit's result, identical on every rank), and ``reducer.finish()`` once every
unit is decoded. The engine alone orders the collectives and the reducers' calls, so every rank issues the same
collectives in the same order: every all-to-all is issued as soon as its unit is encoded, unit k is reduced while
later units are on the wire, units decode in order, and the input is read whole before any result is written (a
reducer may decode into the input's storage). Reducers: ``collectives.quantized`` (fp32 sum with error feedback),
``collectives.sign_collective`` (the 1-bit average). ``run_reduce_scatter`` and
``run_all_gather`` run one half each (QSDP's collectives), their transfers cut into concurrent pieces on gloo
(``comm.transport``). Why two blocking phases lose the link: BENCHMARKS.md §3.

Example::

    total_p = run_pipelined(reducer, units, group, world)   # bytes of one chunk's payload, summed over units
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from lightning_qcomm.comm.transport import (
    PieceLayout,
    _all_gather,
    _all_gather_async,
    _all_to_all,
    _all_to_all_async,
    _wait,
    all_gather_pieces,
    all_to_all_pieces,
)

T = TypeVar("T")


class Reducer(Protocol):
    """The math of one compressed all-reduce's units (see the module docstring); one instance per call."""

    def encode(self, unit: Any) -> torch.Tensor:
        """uint8 payloads for every rank, row j for rank j (any shape whose flat order is row-major)."""

    def reduce(self, unit: Any, recv: torch.Tensor) -> torch.Tensor:
        """uint8 payload of this rank's reduced chunk, from ``recv`` (``encode``'s shape, row r from rank r)."""

    def decode(self, unit: Any, gathered: torch.Tensor) -> None:
        """Write the unit's result from ``gathered``: the N reduced payloads, flat, rank order."""

    def chunk_nbytes(self, unit: Any) -> int:
        """Bytes of one rank's payload of the unit (the ledger's P)."""

    def finish(self) -> None:
        """Once, after every unit is decoded."""


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


def run_pipelined(reducer: Reducer, units: Sequence[Any], group, world: int) -> int:
    """Run ``units`` through ``reducer`` pipelined (module docstring); returns sum over units of
    ``reducer.chunk_nbytes(u)``.

    Example::

        total_p = run_pipelined(reducer, pieces, group, dist.get_world_size(group))
    """
    total_p = 0
    phase1 = []
    for u in units:
        send = reducer.encode(u)
        recv = torch.empty_like(send)
        phase1.append((u, recv, send, _all_to_all_async(_flat(recv), _flat(send), group, world)))
        total_p += reducer.chunk_nbytes(u)
    phase2 = []
    for u, recv, _send, work in phase1:
        _wait(work)
        mine = reducer.reduce(u, recv)
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        phase2.append((u, gathered, mine, _all_gather_async(gathered, _flat(mine), group, world)))
    del phase1
    for u, gathered, _mine, work in phase2:
        _wait(work)
        reducer.decode(u, gathered)
    reducer.finish()
    return total_p


def run_reduce_scatter(
    encode: Callable[[], torch.Tensor],
    reduce: Callable[[torch.Tensor], T],
    group,
    world: int,
    layout: PieceLayout | None = None,
) -> T:
    """Phase 1 alone: ``reduce(recv)`` of the rows ``encode()`` sends (row j to rank j), returned.

    ``layout``: the rows are stored piece by piece (``transport.PieceLayout``, QSDP's reduce-scatter), exchanged
    block by block with no copies; else as N plain rows (``transport.all_to_all_bytes``). The send buffer is freed
    before ``reduce`` runs: beside the wire buffers the reducer's own temporaries are all the memory it takes.

    Example::

        out = run_reduce_scatter(lambda: encode_rows(codec, rows, seeds), lambda recv: decode_sum(recv), group, world)
    """
    send = encode()
    recv = torch.empty_like(send)
    if layout is not None:
        all_to_all_pieces(recv, send, layout, group)
    else:
        _all_to_all(recv, send, group, world)
    del send
    return reduce(recv)


def run_all_gather(
    encode: Callable[[], torch.Tensor],
    decode: Callable[[torch.Tensor], T],
    group,
    world: int,
    layout: PieceLayout | None = None,
    into: torch.Tensor | None = None,
) -> T:
    """Phase 2 alone: ``decode(gathered)`` of every rank's ``encode()`` payload, gathered flat in rank order.

    ``layout``: the N rows are gathered piece by piece (``transport.PieceLayout``, QSDP's all-gather; ``decode``
    then reads rows with ``layout.read_row``) into ``into`` when given (N * ``layout.row_bytes`` uint8; QSDP
    passes the last bytes of its output, ``adapters.fsdp2.gather_region``), else into a buffer of its own; without
    ``layout``, as N plain rows. ``encode`` runs before the transfer writes anything, and the own payload is freed
    before ``decode`` runs: beside the gathered rows the decoder's own temporaries are all the memory it takes.

    Example::

        run_all_gather(lambda: payload, lambda gathered: rc.decode(gathered.view(world, -1), out), group, world)
    """
    mine = encode()
    if layout is None:
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        _all_gather(gathered, _flat(mine), group, world)
    else:
        gathered = layout.empty(mine.device) if into is None else into
        all_gather_pieces(gathered, _flat(mine), layout, group)
    del mine
    return decode(gathered)


__all__ = ["Reducer", "run_all_gather", "run_pipelined", "run_reduce_scatter"]
