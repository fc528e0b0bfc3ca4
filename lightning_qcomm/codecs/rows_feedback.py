"""The error-feedback tail of a compressed all-reduce read from the payloads just encoded, a torch op of the codec
layer (docs/design.md, "Launches per bucket and host syncs")::

    feedback_rows(Tensor y, Tensor wire, int n, <codec>, Tensor reduced, Tensor held, int start, float k,
                  ScalarType held_dtype, Tensor(a!) err) -> ()

Exactly ``feedback_update(y, dec, reduced, held, start, k, held_dtype, err)`` (``codecs.rows_reduce``) with
``dec = decode_rows(codec, wire, n).view(-1)[:m]``, m = y.numel(), (R - 1) n < m <= R n; with c = ``reduced.numel()``::

    new[i] = y[i] - D(wire)[i]                                   (i < m, row i // n, element i % n)
    new[start:start+c] += (reduced - held[start:start+c] rounded through held_dtype) * k      (clipped to m)
    err <- new where new is finite, else err unchanged

CPU (and any device but CUDA): the eager decode and ``feedback_update_reference``. CUDA: one Triton launch
(``kernels.cuda.reduce_kernels.feedback_rows``) where the rows decode kernel takes the codec and every operand is
contiguous 1-D fp32, each element decoded in registers with the rows decode's own operations (the same bits, no
decoded tensor); else the rows decode then ``feedback_update`` (two launches). Checked once per (codec, device)
against the eager ops before first use (``codecs.triton_probe``).

Example::

    >>> send = encode_rows(codec, y.view(world, c), seeds)                   # (N, P) payloads of y's chunks
    >>> feedback_rows(codec, y[:n], send, c, y[:0], y[:n], 0, 1.0, torch.float32, err)   # err <- y - C(y)
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import registry
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import _check_wire, decode_rows_body
from lightning_qcomm.codecs.rows_encode import _INT32_COUNTERS
from lightning_qcomm.codecs.rows_reduce import (
    _EAGER,
    FEEDBACK_BLOCK,
    HELD_DTYPES,
    _feedback_triton,
    feedback_update_cuda,
    feedback_update_reference,
)


def _rows_and_prefix(codec: Codec, wire: torch.Tensor, n: int, y: torch.Tensor) -> torch.Tensor:
    """``wire`` as (R, P) rows; ValueError unless y's m elements satisfy (R - 1) n < m <= R n."""
    rows = wire.reshape(-1, _check_wire(codec, wire, n))
    m, r = y.numel(), rows.shape[0]
    if not (r - 1) * n < m <= r * n:
        raise ValueError(f"feedback_rows: y must have (R - 1) * {n} < numel <= R * {n} for R = {r}, got {m}")
    return rows


def feedback_rows_body(codec: Codec, y, wire, n: int, reduced, held, start, k, held_dtype, err, triton: bool) -> None:
    """``feedback_update`` with dec = the first y.numel() values of the payloads ``wire`` (rows of n) decoded."""
    rows = _rows_and_prefix(codec, wire, n, y)
    m = y.numel()
    if triton and held_dtype in HELD_DTYPES and m + n + FEEDBACK_BLOCK < _INT32_COUNTERS:
        from lightning_qcomm.codecs import ops

        tensors = (y, reduced, held, err)
        if ops.rows_kernel(codec, rows, encode=False) and _feedback_triton(tensors, y.device):
            if _feedback_rows_kernel_works(codec, y.device):
                from lightning_qcomm.codecs import triton_probe
                from lightning_qcomm.kernels.cuda import reduce_kernels

                with triton_probe.on_device(y.device):
                    reduce_kernels.feedback_rows(codec, y, rows, n, reduced, held, start, k, held_dtype, err)
                return
    dec = decode_rows_body(codec, rows, n, triton=triton).view(-1)[:m]
    update = feedback_update_cuda if triton else feedback_update_reference
    update(y, dec, reduced, held, start, k, held_dtype, err)


def _feedback_rows_kernel_works(codec: Codec, device: torch.device) -> bool:
    """The wire-reading feedback kernel on ``device`` equals the decode then ``feedback_update_reference`` (bit
    for bit) on a probe of three rows of 347 elements with NaN, infinities and subnormals, the last row cut
    short, this rank's chunk inside: checked once per (codec, device), else the eager ops, with one warning."""
    from lightning_qcomm.codecs import rows_encode, triton_probe

    def check() -> None:
        from lightning_qcomm.kernels.cuda import reduce_kernels

        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, 347, generator=g) * 3
        x[0, 3], x[2, 7], x[1, 8] = float("nan"), float("inf"), -1e-41
        wire = rows_encode.encode_rows_body(codec, x, [0, 1, 2], triton=False)
        y, held, err = (torch.randn(3 * 347 - 5, generator=g) * 3 for _ in range(3))
        y[9], y[400], held[500] = float("nan"), 1e-41, float("-inf")
        red = torch.randn(200, generator=g)
        for held_dtype in (torch.float32, torch.bfloat16):
            want = err.clone()
            feedback_rows_body(codec, y, wire, 347, red, held, 380, 3.0, held_dtype, want, triton=False)
            ops = [t.to(device) for t in (y, wire, red, held, err)]
            with triton_probe.on_device(device):
                reduce_kernels.feedback_rows(codec, ops[0], ops[1], 347, *ops[2:4], 380, 3.0, held_dtype, ops[4])
            difference = triton_probe._difference("errors", want, ops[4].cpu())
            if difference:
                raise RuntimeError(f"the wire-reading error-feedback kernel differs from the eager ops: {difference}")

    key = ("feedback_rows", tuple(sorted(codec.config().items())), str(device))
    what = f"the wire-reading error-feedback kernel of {codec.config()}"
    return triton_probe.first_use(key, what, device, check, _EAGER)


def feedback_rows_reference(
    y,
    wire,
    n: int,
    codec: str,
    bits: int,
    bucket_size,
    stochastic: bool,
    reduced,
    held,
    start: int,
    k: float,
    held_dtype,
    err,
) -> None:
    """``qcomm::feedback_rows`` on any device but CUDA: the eager decode, then ``feedback_update_reference``."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    feedback_rows_body(c, y, wire, n, reduced, held, start, k, held_dtype, err, triton=False)


def feedback_rows_cuda(
    y,
    wire,
    n: int,
    codec: str,
    bits: int,
    bucket_size,
    stochastic: bool,
    reduced,
    held,
    start: int,
    k: float,
    held_dtype,
    err,
) -> None:
    """``qcomm::feedback_rows`` on CUDA: one Triton launch where the rows and feedback kernels apply, else the
    rows decode and ``feedback_update_cuda``."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    feedback_rows_body(c, y, wire, n, reduced, held, start, k, held_dtype, err, triton=True)


def feedback_rows_fake(
    y,
    wire,
    n: int,
    codec: str,
    bits: int,
    bucket_size,
    stochastic: bool,
    reduced,
    held,
    start: int,
    k: float,
    held_dtype,
    err,
) -> None:
    _rows_and_prefix(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n, y)
    return None


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
        feedback_rows_body(codec, y, wire, n, reduced, held, start, k, held_dtype, err, triton=False)
    return err


__all__ = ["feedback_rows"]
