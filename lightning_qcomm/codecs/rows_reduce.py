"""The server step and the error-feedback tail of a compressed all-reduce as torch ops of the codec layer: the door
and the torch reference (schemas in ``codecs.ops``; docs/design.md, "Launches per bucket and host syncs")::

    decode_rows_sum(Tensor wire, int n, <codec>, bool avg, bool rank_order=False) -> Tensor           ((n,) fp32)
    feedback_update(Tensor y, Tensor dec, Tensor reduced, Tensor held, int start, float k,
                    ScalarType held_dtype, Tensor(a!) err) -> ()
    feedback_rows(Tensor y, Tensor wire, int n, <codec>, Tensor reduced, Tensor held, int start, float k,
                  ScalarType held_dtype, Tensor(a!) err) -> ()

``decode_rows_sum``: the sum of the R payloads' decodes (``avg``: over R), exactly the eager
``decode_rows(...).sum(dim=0)`` (then ``/= R``) on the device it runs on; ``rank_order``: row 0, + row 1, ..., one
rounding each. ``feedback_update``, with c = ``reduced.numel()``::

    new = y - dec;   new[start:start+c] += (reduced - held[start:start+c] rounded through held_dtype) * k
    err <- new where new is finite, else err unchanged

``feedback_rows``: ``feedback_update`` with dec the first m = y.numel() values of ``decode_rows(codec, wire, n)``,
(R - 1) n < m <= R n. The reference composes the rows ops, so each step runs on its device's kernel; on CUDA each op
is one Triton launch where it applies (``codecs.cuda``). The orders and limits: docs/design.md, "Module notes".

Example::

    >>> acc = decode_rows_sum(codec, recv, c, avg=True)                      # (c,) fp32
    >>> feedback_update(y, dec, acc, out_piece, rank * c, 4.0, torch.float32, err_piece)
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import registry
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import check_wire, decode_rows, decode_rows_body


# ---------------------------------------------------------------------------------------------- reference
def decode_rows_sum_body(
    codec: Codec, wire: torch.Tensor, n: int, avg: bool, rank_order: bool = False, eager: bool = False
) -> torch.Tensor:
    """(n,) fp32 sum (``avg``: mean) of the decoded payloads in ``wire`` (module docstring): the rows decoded by
    the ``decode_rows`` op (``eager``: by the torch reference), then summed by torch."""
    rows = wire.reshape(-1, check_wire(codec, wire, n))
    values = decode_rows_body(codec, rows, n) if eager else decode_rows(codec, rows, n)
    if rank_order:  # values[0] + values[1] + ..., one addition at a time
        acc = values[0].clone()
        for r in range(1, values.shape[0]):
            acc += values[r]
    else:
        acc = values.sum(dim=0)
    if avg:
        acc /= rows.shape[0]
    return acc


def check_feedback(y, dec, reduced, held, err) -> None:
    """ValueError unless ``dec``, ``held`` and ``err`` have y's element count and ``reduced`` is 1-D."""
    n = y.numel()
    for name, t in (("dec", dec), ("held", held), ("err", err)):
        if t.numel() != n:
            raise ValueError(f"feedback_update: {name} must have y.numel() = {n} elements, got {t.numel()}")
    if reduced.dim() != 1:
        raise ValueError(f"feedback_update: reduced must be 1-D, got shape {tuple(reduced.shape)}")


def feedback_update_body(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_update`` in eager torch ops (module docstring)."""
    check_feedback(y, dec, reduced, held, err)
    new = y.reshape(-1) - dec.reshape(-1)
    a, b = max(start, 0), min(start + reduced.numel(), new.numel())
    if b > a:
        h = held.reshape(-1)[a:b]
        if held_dtype != torch.float32:
            h = h.to(held_dtype).to(torch.float32)
        mine = new[a:b]
        mine += (reduced[a - start : b - start] - h).mul_(k)
    new = new.reshape(err.shape)
    finite = new - new == 0  # x - x == 0 iff x is finite
    if err.dtype == new.dtype:
        torch.where(finite, new, err, out=err)
    else:
        err.copy_(torch.where(finite, new, err.to(new.dtype)))


def feedback_rows_prefix(codec: Codec, wire: torch.Tensor, n: int, y: torch.Tensor) -> torch.Tensor:
    """``wire`` as (R, P) rows; ValueError unless y's m elements satisfy (R - 1) n < m <= R n."""
    rows = wire.reshape(-1, check_wire(codec, wire, n))
    m, r = y.numel(), rows.shape[0]
    if not (r - 1) * n < m <= r * n:
        raise ValueError(f"feedback_rows: y must have (R - 1) * {n} < numel <= R * {n} for R = {r}, got {m}")
    return rows


def feedback_rows_body(
    codec: Codec, y, wire, n: int, reduced, held, start: int, k: float, held_dtype, err, eager: bool = False
) -> None:
    """``feedback_update`` with dec = the first y.numel() values of the payloads ``wire`` (rows of n) decoded: the
    ``decode_rows`` and ``feedback_update`` ops (``eager``: the torch reference of both)."""
    rows = feedback_rows_prefix(codec, wire, n, y)
    m = y.numel()
    if eager:
        feedback_update_body(y, decode_rows_body(codec, rows, n).view(-1)[:m], reduced, held, start, k, held_dtype, err)
    else:
        dec = decode_rows(codec, rows, n).view(-1)[:m]
        torch.ops.qcomm.feedback_update(y, dec, reduced, held, int(start), float(k), held_dtype, err)


# ---------------------------------------------------------------------------------------------- the door
def decode_rows_sum(
    codec: Codec, wire: torch.Tensor, n: int, avg: bool = False, rank_order: bool = False
) -> torch.Tensor:
    """(n,) fp32: ``decode_rows(codec, wire, n).sum(dim=0)`` (``avg``: then ``/= R``) as the eager ops compute it
    on ``wire``'s device, one launch on CUDA (module docstring). ``rank_order``: the sum is
    ``rows[0] + rows[1] + ... + rows[R-1]``, one addition at a time, instead (any R; one launch on CUDA). ValueError
    unless ``wire`` holds whole payloads.

    Example::

        >>> s = decode_rows_sum(codec, recv, c, avg=True)     # the server step of a quantized all-reduce
    """
    if registry.is_registered(codec):
        return torch.ops.qcomm.decode_rows_sum(wire, n, *codec.op_args(), avg, rank_order)
    return decode_rows_sum_body(codec, wire, n, avg, rank_order)


def feedback_update(
    y: torch.Tensor,
    dec: torch.Tensor,
    reduced: torch.Tensor,
    held: torch.Tensor,
    start: int,
    k: float,
    held_dtype: torch.dtype,
    err: torch.Tensor,
) -> torch.Tensor:
    """``err`` <- the residual ``y - dec`` plus, on ``[start, start + reduced.numel())``, ``(reduced - held) * k``
    (``held`` rounded through ``held_dtype``), where that is finite (module docstring); returns ``err``.

    Example::

        >>> feedback_update(y, dec, s, out_piece, rank * c, float(world), torch.float32, err_piece)
    """
    torch.ops.qcomm.feedback_update(y, dec, reduced, held, int(start), float(k), held_dtype, err)
    return err


def feedback_rows(
    codec: Codec,
    y: torch.Tensor,
    wire: torch.Tensor,
    n: int,
    reduced: torch.Tensor,
    held: torch.Tensor,
    start: int,
    k: float,
    held_dtype: torch.dtype,
    err: torch.Tensor,
) -> torch.Tensor:
    """``feedback_update(y, dec, reduced, held, start, k, held_dtype, err)`` with ``dec`` the first m = y.numel()
    values of ``decode_rows(codec, wire, n)`` (row-major; (R - 1) n < m <= R n): the residual of what was just
    encoded, read from its payloads. On CUDA one launch that decodes in registers (the rows decode's operations,
    the same bits), no decoded tensor; returns ``err``.

    Example::

        >>> send = encode_rows(codec, y.view(world, c), seeds)
        >>> feedback_rows(codec, y[:n], send, c, y[:0], y[:n], 0, 1.0, torch.float32, err)   # err <- y - C(y)
    """
    if registry.is_registered(codec):
        args = (reduced, held, int(start), float(k), held_dtype, err)
        torch.ops.qcomm.feedback_rows(y, wire, n, *codec.op_args(), *args)
    else:
        feedback_rows_body(codec, y, wire, n, reduced, held, start, k, held_dtype, err)
    return err


__all__ = ["decode_rows_sum", "feedback_rows", "feedback_update"]
