"""Triton kernels of the compressed all-reduce's server and error-feedback steps: each one launch.

* ``decode_rows_sum``: the N payloads a rank receives, decoded and summed into one fp32 chunk (``op="avg"``:
  times 1/N), the kernel of ``qcomm::decode_rows_sum`` on CUDA. The additions are those of the eager ops it
  replaces on a GPU, ``decode_rows(...).sum(dim=0)`` then ``/= N``: torch's CUDA reduction sums the N values of a
  column (N <= ``MAX_SUM_ROWS``, one thread per column) in four running sums, row r into sum r % 4, each from
  +0.0 and in rank order, then ((s0 + s1) + s2) + s3 (rank order itself for N <= 4); a CUDA ``/=`` by a Python
  number multiplies by its fp32 reciprocal ``fl(1/N)``. ``rank_order``: row 0, then + row 1, + row 2, ..., one
  rounding each (the eager loop of the 1-bit sync's server), any N.
* ``feedback_update``: the error-feedback residual of one piece and its write where finite (the kernel of
  ``qcomm::feedback_update`` on CUDA), the same operations in the same order as the eager ops it replaces:

      new[i] = y[i] - dec[i]                                           outside this rank's chunk
      new[i] = (y[i] - dec[i]) + (S[i - start] - held[i]) * k          start <= i < start + c
      err[i] = new[i] if new[i] is finite else err[i]

  with ``held`` the final output rounded through x's dtype (bf16 / fp16: fp32 -> dtype -> fp32, round to nearest
  even) and no FMA contraction. ``feedback_rows``: the same with ``dec`` the payloads just encoded, decoded in
  registers by the rows decode's operations (``_row_values``, the same bits): no decode launch, no fp32 ``dec``.

Example::

    >>> acc = decode_rows_sum(codec, wire, n, avg=True)          # (n,) fp32, one launch
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import layout

from .codec_kernels import GROUPS_PER_PROGRAM, NUM_WARPS, _check_device, _grid, _spec, unpack_codes
from .elementwise import dequantize, is_finite
from .wire_params import dec_params

MAX_SUM_ROWS = 8  # rows whose CUDA sum(dim=0) order the sum kernel is known to reproduce (one thread per column)
HELD_DTYPES = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}  # fp32 -> dtype -> fp32


@triton.jit
def _row_values(
    codes_ptr,
    g,
    lane,
    idx,
    inb,
    n,
    scale_off,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BITS_P2: tl.constexpr,
    P: tl.constexpr,
    BUCKET: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_E4M3FN: tl.constexpr,
):
    """fp32 values of the (GROUPS, 8) tile ``idx`` of the payload at ``codes_ptr`` (codes, its scales at byte
    ``scale_off``): the rows decode's own operations (``codec_kernels._decode_kernel``), so the same bits."""
    c = unpack_codes(codes_ptr, g, lane, idx, inb, n, BITS, BITS_P2)
    p0, p1, p2 = dec_params(codes_ptr + scale_off, idx, inb, KIND, P, BUCKET, LEVELS, True)
    return dequantize(c, p0, p1, p2, KIND, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FP8_E4M3FN)


@triton.jit
def _decode_sum_kernel(
    wire_ptr,
    out_ptr,
    n,
    row_stride,
    scale_off,
    inv,
    R: tl.constexpr,
    AVG: tl.constexpr,
    RANK_ORDER: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BITS_P2: tl.constexpr,
    P: tl.constexpr,
    BUCKET: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_E4M3FN: tl.constexpr,
    GROUPS: tl.constexpr,
    INT64_INDEX: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        pid = pid.to(tl.int64)
        n = n.to(tl.int64)
    g = pid * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]
    inb = idx < n
    acc = tl.zeros((GROUPS, 8), dtype=tl.float32)
    s0 = tl.zeros((GROUPS, 8), dtype=tl.float32)
    s1 = tl.zeros((GROUPS, 8), dtype=tl.float32)
    s2 = tl.zeros((GROUPS, 8), dtype=tl.float32)
    s3 = tl.zeros((GROUPS, 8), dtype=tl.float32)
    for r in range(R):  # a loop, not unrolled: any R
        v = _row_values(
            wire_ptr + r * row_stride,
            g,
            lane,
            idx,
            inb,
            n,
            scale_off,
            KIND,
            BITS,
            BITS_P2,
            P,
            BUCKET,
            LEVELS,
            SIGN_BIT,
            EMIN,
            MBITS,
            FP8_BIAS,
            FP8_E4M3FN,
        )
        if RANK_ORDER:  # row 0 itself (not +0.0 + row 0), then rows 1, 2, ... added one by one
            acc = tl.where(r == 0, v, acc + v)
        else:  # row r into running sum r % 4, each from +0.0, in rank order
            q = r % 4
            s0 = tl.where(q == 0, s0 + v, s0)
            s1 = tl.where(q == 1, s1 + v, s1)
            s2 = tl.where(q == 2, s2 + v, s2)
            s3 = tl.where(q == 3, s3 + v, s3)
    if not RANK_ORDER:
        acc = ((s0 + s1) + s2) + s3
    if AVG:
        acc = acc * inv
    tl.store(out_ptr + idx, acc, mask=inb)


@triton.jit
def _round_bf16(v):
    """fp32 -> bf16 -> fp32, round to nearest even, by the bits (as torch's conversion; Triton's interpreter
    truncates a bf16 cast); NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def _write_residual(new, i, inb, red_ptr, held_ptr, err_ptr, start, c, k, HELD: tl.constexpr):
    """err[i] <- new[i] + (S[i - start] - held[i]) * k on this rank's chunk (start <= i < start + c), new[i]
    elsewhere, where that is finite (module docstring)."""
    j = i - start
    mine = inb & (j >= 0) & (j < c)
    held = tl.load(held_ptr + i, mask=mine, other=0.0)
    if HELD == 1:
        held = _round_bf16(held)
    elif HELD == 2:
        held = held.to(tl.float16).to(tl.float32)
    extra = (tl.load(red_ptr + j, mask=mine, other=0.0) - held) * k
    new = tl.where(mine, new + extra, new)
    tl.store(err_ptr + i, new, mask=inb & is_finite(new))


@triton.jit
def _feedback_kernel(
    y_ptr,
    dec_ptr,
    red_ptr,
    held_ptr,
    err_ptr,
    n,
    start,
    c,
    k,
    HELD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    new = tl.load(y_ptr + i, mask=inb, other=0.0) - tl.load(dec_ptr + i, mask=inb, other=0.0)
    _write_residual(new, i, inb, red_ptr, held_ptr, err_ptr, start, c, k, HELD)


@triton.jit
def _feedback_rows_kernel(
    wire_ptr,
    y_ptr,
    red_ptr,
    held_ptr,
    err_ptr,
    n,
    m,
    row_stride,
    scale_off,
    start,
    c,
    k,
    HELD: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BITS_P2: tl.constexpr,
    P: tl.constexpr,
    BUCKET: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_E4M3FN: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # the tile idx of payload row program_id(1), decoded in registers: flat element i = row * n + idx of m
    row = tl.program_id(1)
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]
    inrow = idx < n
    dec = _row_values(
        wire_ptr + row * row_stride,
        g,
        lane,
        idx,
        inrow,
        n,
        scale_off,
        KIND,
        BITS,
        BITS_P2,
        P,
        BUCKET,
        LEVELS,
        SIGN_BIT,
        EMIN,
        MBITS,
        FP8_BIAS,
        FP8_E4M3FN,
    )
    i = row * n + idx
    inb = inrow & (i < m)
    new = tl.load(y_ptr + i, mask=inb, other=0.0) - dec
    _write_residual(new, i, inb, red_ptr, held_ptr, err_ptr, start, c, k, HELD)


def decode_rows_sum(codec, wire: torch.Tensor, n: int, avg: bool, rank_order: bool = False) -> torch.Tensor:
    """(n,) fp32: the R payloads of ``wire`` (R, ``codec.nbytes(n)``), R <= ``MAX_SUM_ROWS`` (``rank_order``: any
    R), decoded and summed as the module docstring says (``avg``: times fl(1/R)). One launch."""
    spec = _spec(codec)
    _check_device(wire, "wire")
    r, p = wire.shape
    most = r if rank_order else MAX_SUM_ROWS
    if p != codec.nbytes(n) or wire.dtype != torch.uint8 or not 1 <= r <= most or wire.numel() >= 2**31:
        raise ValueError(
            f"wire must be (R, {codec.nbytes(n)}) uint8, 1 <= R <= {most}, fewer than 2^31 bytes, got "
            f"{tuple(wire.shape)} {wire.dtype}"
        )
    wire = wire.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=wire.device)
    grid, int64_index = _grid(n)
    _decode_sum_kernel[grid](
        wire,
        out,
        n,
        p,
        layout.packed_nbytes(n, spec["BITS"]),
        struct.unpack("f", struct.pack("f", 1.0 / r))[0],  # fl(1/R), as CUDA's division by a Python number
        R=r,
        AVG=avg,
        RANK_ORDER=rank_order,
        **spec,
        P=codec.scales_per_bucket,
        FP8_E4M3FN=codec.kernel_spec().fp8_e4m3fn,
        GROUPS=GROUPS_PER_PROGRAM,
        INT64_INDEX=int64_index,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # each operation rounded, as the eager ops
    )
    return out


def feedback_update(y, dec, reduced, held, start: int, k: float, held_dtype: torch.dtype, err) -> None:
    """err[i] <- the new residual where finite (module docstring); ``y``, ``dec``, ``held``, ``err``: (n,)
    contiguous fp32; ``reduced``: (c,) fp32, this rank's chunk at ``start``. One launch."""
    n = y.numel()
    _check_feedback(n, (("y", y), ("dec", dec), ("held", held), ("err", err), ("reduced", reduced)))
    if held_dtype not in HELD_DTYPES:
        raise ValueError(f"held_dtype must be one of {list(HELD_DTYPES)}, got {held_dtype}")
    block = 1024
    _feedback_kernel[(triton.cdiv(n, block),)](
        y,
        dec,
        reduced,
        held,
        err,
        n,
        start,
        reduced.numel(),
        float(k),
        HELD=HELD_DTYPES[held_dtype],
        BLOCK=block,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # (S - held) * k then the add: two roundings, as the eager ops
    )


def _check_feedback(n: int, tensors) -> None:
    for name, t in tensors:
        _check_device(t, name)
        if t.dtype != torch.float32 or not t.is_contiguous() or (name != "reduced" and t.numel() != n):
            raise ValueError(f"{name} must be contiguous fp32{'' if name == 'reduced' else f' of {n} elements'}")


def feedback_rows(codec, y, wire, n: int, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``feedback_update`` with ``dec`` the first m = y.numel() values of the R payloads of ``wire``
    (R, ``codec.nbytes(n)``) decoded, (R - 1) n < m <= R n, in registers: one launch, no decoded tensor."""
    spec = _spec(codec)
    _check_device(wire, "wire")
    r, p = wire.shape
    m = y.numel()
    if p != codec.nbytes(n) or wire.dtype != torch.uint8 or not (r - 1) * n < m <= r * n:
        raise ValueError(f"wire must be (R, {codec.nbytes(n)}) uint8 with (R - 1) * {n} < {m} <= R * {n}")
    if m + n + GROUPS_PER_PROGRAM * 8 >= 2**31 or wire.numel() >= 2**31:
        raise ValueError("feedback_rows indexes with int32: fewer than 2^31 elements and bytes")
    _check_feedback(m, (("y", y), ("held", held), ("err", err), ("reduced", reduced)))
    if held_dtype not in HELD_DTYPES:
        raise ValueError(f"held_dtype must be one of {list(HELD_DTYPES)}, got {held_dtype}")
    (programs,), _ = _grid(n)
    _feedback_rows_kernel[(programs, r)](
        wire.contiguous(),
        y,
        reduced,
        held,
        err,
        n,
        m,
        p,
        layout.packed_nbytes(n, spec["BITS"]),
        start,
        reduced.numel(),
        float(k),
        HELD=HELD_DTYPES[held_dtype],
        **spec,
        P=codec.scales_per_bucket,
        FP8_E4M3FN=codec.kernel_spec().fp8_e4m3fn,
        GROUPS=GROUPS_PER_PROGRAM,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # the decode's and the residual's operations each rounded, as the eager ops
    )


__all__ = ["HELD_DTYPES", "MAX_SUM_ROWS", "decode_rows_sum", "feedback_rows", "feedback_update"]
