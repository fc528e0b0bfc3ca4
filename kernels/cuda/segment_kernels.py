"""Triton kernels of the segmented rows: R rows of one layout, each row a concatenation of segments, each segment
quantized with the codec as a tensor of its own or carried raw in the rows' dtype, every segment of every row in
one launch (the kernels of ``qcomm::encode_segments`` / ``decode_segments_into`` / ``decode_segments_sum``;
``codecs.rows_segments`` states the wire format and is the door).

The layout travels as an int32 table, one line of ``F`` words per segment (``segment_table``; uploaded once per
layout), and each encode brings three words per (row, segment): the random key (k1, k2) and the counter of the
segment's first element (r n for a segment coded as one flat tensor of its R rows, else 0). A program finds its
segment by counting the lines whose first tile (or first scales program) is at or before its own index: a vector
compare over the ``KP2`` lines, no search loop. The element-wise work is the flat kernels' own (``quantize_tile``,
``pack_store``, ``_row_values``, ``bucket_math``), so every quantized segment gets the bits ``codec.encode`` /
``decode`` give it alone.

Raw segments move as their bytes (a float read through an integer view: bf16 and fp16 widen to fp32 by their
bits, never through the interpreter's truncating casts); values stored to a bf16 out round to nearest even by
the bits too, a NaN as its top 16 bits, made quiet (torch's CPU conversion; its CUDA one writes 0x7FFF).

Example::

    layout = segment_table(codec, (4096, 64), (True, False), 4)       # words, tiles, programs, buckets
    encode_segments(codec, rows, table, keys, layout, wire, out_max)   # (R, P) uint8 wire: two launches
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import layout
from lightning_qcomm.codecs.layout import redo_floor

from .codec_kernels import GROUPS_PER_PROGRAM, NUM_WARPS, _check_device, _load_params, _spec, pack_store
from .elementwise import quantize_tile
from .reduce_kernels import _row_values
from .wire_params import ROWS_ELEMENTS, bucket_math, store_params

# The table's columns: element offset in the row, numel, byte offset of the payload in the wire row, byte offset of
# its scales after it, first bucket (of the row's quantized buckets), first tile, first scales program, quantized.
OFF, NUMEL, CODE, SCALE, BBASE, TBASE, PBASE, QUANT = (tl.constexpr(c) for c in range(8))
F = 8
KEY_WORDS = 3  # k1, k2, counter of the first element, per (row, quantized segment)
TILE = GROUPS_PER_PROGRAM * 8
# dtypes by their bits: 0 fp32, 1 bf16, 2 fp16 (the integer view each is read and written through)
DTYPE_KINDS = {torch.float32: (0, torch.int32), torch.bfloat16: (1, torch.int16), torch.float16: (2, torch.int16)}


@triton.jit
def _segment(table_ptr, t, K, COL: tl.constexpr, KP2: tl.constexpr):
    """The last segment whose column ``COL`` (a first tile or program, non-decreasing) is <= t."""
    ks = tl.arange(0, KP2)
    base = tl.load(table_ptr + ks * 8 + COL, mask=ks < K, other=2147483647)
    return tl.sum((base <= t).to(tl.int32), axis=0) - 1


@triton.jit
def _to_f32(bits, DK: tl.constexpr):
    """fp32 values of the int32 / int16 bit patterns of dtype kind ``DK`` (exact)."""
    if DK == 0:
        return bits.to(tl.float32, bitcast=True)
    elif DK == 1:
        return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _from_f32(v, DK: tl.constexpr):
    """The bit pattern (int32 / int16) of fp32 ``v`` in dtype kind ``DK``, rounded to nearest even."""
    if DK == 0:
        return v.to(tl.int32, bitcast=True)
    elif DK == 1:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return (tl.where(v != v, (v.to(tl.int32, bitcast=True) >> 16) | 0x40, b) & 0xFFFF).to(tl.int16)
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True)


@triton.jit
def _raw_store(ptr, bits, idx, mask, ES: tl.constexpr):
    """The ES little-endian bytes of each element's bits at ``ptr + idx * ES``."""
    b32 = bits.to(tl.int32)
    for b in tl.static_range(ES):
        tl.store(ptr + idx * ES + b, ((b32 >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _raw_load(ptr, idx, mask, ES: tl.constexpr, DK: tl.constexpr):
    """fp32 values of the elements whose ES little-endian bytes lie at ``ptr + idx * ES`` (any alignment)."""
    v = tl.load(ptr + idx * ES, mask=mask, other=0).to(tl.int32)
    for b in tl.static_range(1, ES):
        v = v | (tl.load(ptr + idx * ES + b, mask=mask, other=0).to(tl.int32) << (8 * b))
    return _to_f32(v, DK)


@triton.jit
def _wire_kernel(
    x_ptr,
    table_ptr,
    keys_ptr,
    params_ptr,
    wire_ptr,
    K,
    x_stride,
    wire_stride,
    nbt,
    KP2: tl.constexpr,
    XK: tl.constexpr,
    KIND: tl.constexpr,
    BUCKET: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    LEVELS: tl.constexpr,
    FMAX: tl.constexpr,
    LOG2: tl.constexpr,
    NORM_L2: tl.constexpr,
    DIVISOR: tl.constexpr,
    OUT_MAX: tl.constexpr,
    REDO_FLOOR: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    line = table_ptr + _segment(table_ptr, pid, K, PBASE, KP2) * 8
    off, n = tl.load(line + OFF), tl.load(line + NUMEL)
    lb = (pid - tl.load(line + PBASE)) * ROWS + tl.arange(0, ROWS)  # the segment's buckets of this program
    cols = tl.arange(0, BLOCK)
    count = tl.minimum(n - lb * BUCKET, BUCKET)
    live = lb * BUCKET < n
    valid = (cols[None, :] < count[:, None]) & live[:, None]
    bits = tl.load(x_ptr + r * x_stride + off + (lb * BUCKET)[:, None] + cols[None, :], mask=valid, other=0)
    x = _to_f32(bits, XK)
    w0, w1, q0, q1, q2 = bucket_math(
        x, valid, count, ROWS, KIND, BLOCK, LEVELS, FMAX, LOG2, NORM_L2, DIVISOR, OUT_MAX, REDO_FLOOR
    )
    scales = wire_ptr + r * wire_stride + tl.load(line + CODE) + tl.load(line + SCALE) + lb * (4 * S)
    _raw_store(scales, w0.to(tl.int32, bitcast=True), 0, live, 4)
    if S >= 2:
        _raw_store(scales + 4, w1.to(tl.int32, bitcast=True), 0, live, 4)
    store_params(params_ptr + (r * nbt + tl.load(line + BBASE)) * P, lb, live, q0, q1, q2, P)


@triton.jit
def _encode_kernel(
    x_ptr,
    table_ptr,
    keys_ptr,
    params_ptr,
    wire_ptr,
    K,
    x_stride,
    wire_stride,
    nbt,
    KP2: tl.constexpr,
    XK: tl.constexpr,
    XES: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BITS_P2: tl.constexpr,
    P: tl.constexpr,
    BUCKET: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    GROUPS: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _segment(table_ptr, t, K, TBASE, KP2)
    line = table_ptr + k * 8
    off, n = tl.load(line + OFF), tl.load(line + NUMEL)
    g = (t - tl.load(line + TBASE)) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]
    inb = idx < n
    bits = tl.load(x_ptr + r * x_stride + off + idx, mask=inb, other=0)
    out = wire_ptr + r * wire_stride + tl.load(line + CODE)
    if tl.load(line + QUANT) != 0:
        x = _to_f32(bits, XK)
        p0, p1, p2 = _load_params(params_ptr + (r * nbt + tl.load(line + BBASE)) * P, idx, inb, P, BUCKET)
        key = keys_ptr + (r * K + k) * 3
        k1, k2, ctr = tl.load(key), tl.load(key + 1), tl.load(key + 2)
        code = quantize_tile(
            x, inb, p0, p1, p2, idx + ctr, k1, k2, KIND, STOCHASTIC, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FMAX
        )
        pack_store(out, code, g, lane, idx, n, BITS, BITS_P2)
    else:
        _raw_store(out, bits, idx, inb, XES)


@triton.jit
def _values(
    src, g, lane, idx, inb, n, scale_off, quant, WK, WES, KIND, BITS, BITS_P2, P, BUCKET, LEVELS, SIGN_BIT, EMIN,
    MBITS, FP8_BIAS, FP8_E4M3FN,
):  # fmt: skip
    """fp32 values of a tile of one segment's payload at ``src``: decoded, or the raw bytes widened."""
    if quant != 0:
        v = _row_values(
            src, g, lane, idx, inb, n, scale_off, KIND, BITS, BITS_P2, P, BUCKET, LEVELS, SIGN_BIT, EMIN, MBITS,
            FP8_BIAS, FP8_E4M3FN,
        )  # fmt: skip
    else:
        v = _raw_load(src, idx, inb, WES, WK)
    return v


@triton.jit
def _decode_kernel(
    wire_ptr,
    table_ptr,
    x_ptr,
    out_ptr,
    K,
    own,
    wire_stride,
    x_stride,
    out_stride,
    R: tl.constexpr,
    KP2: tl.constexpr,
    WK: tl.constexpr,
    WES: tl.constexpr,
    OK: tl.constexpr,
    SUM: tl.constexpr,
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
    """Rows decoded into out (row program_id(1); row ``own`` left as it is); ``SUM``: the rows summed in rank order
    into one out row, row ``own`` taken exact from ``x`` (its own input, never sent)."""
    t = tl.program_id(0)
    line = table_ptr + _segment(table_ptr, t, K, TBASE, KP2) * 8
    off, n, code = tl.load(line + OFF), tl.load(line + NUMEL), tl.load(line + CODE)
    scale_off, quant = tl.load(line + SCALE), tl.load(line + QUANT)
    g = (t - tl.load(line + TBASE)) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]
    inb = idx < n
    if SUM:
        mine = _to_f32(tl.load(x_ptr + own * x_stride + off + idx, mask=inb, other=0), WK)
        acc = mine
        for j in range(R):  # rank order: row 0 itself, then + row 1, + row 2, ... (not unrolled)
            v = _values(
                wire_ptr + j * wire_stride + code, g, lane, idx, inb, n, scale_off, quant, WK, WES, KIND, BITS,
                BITS_P2, P, BUCKET, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FP8_E4M3FN,
            )  # fmt: skip
            v = tl.where(j == own, mine, v)
            acc = tl.where(j == 0, v, acc + v)
        tl.store(out_ptr + off + idx, _from_f32(acc, OK), mask=inb)
    else:
        r = tl.program_id(1).to(tl.int64)
        inb = inb & ((idx.to(tl.int64) * 0 + r) != own)  # a vector compare: the interpreter wants a block mask
        v = _values(
            wire_ptr + r * wire_stride + code, g, lane, idx, inb, n, scale_off, quant, WK, WES, KIND, BITS, BITS_P2,
            P, BUCKET, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FP8_E4M3FN,
        )  # fmt: skip
        tl.store(out_ptr + r * out_stride + off + idx, _from_f32(v, OK), mask=inb)


# ---------------------------------------------------------------------------------------------- launchers
@functools.lru_cache(maxsize=256)
def segment_table(
    codec, numels: tuple[int, ...], quantized: tuple[bool, ...], raw_bytes: int
) -> tuple[tuple[int, ...], int, int, int]:
    """(the table's words, tiles, scales programs, quantized buckets per row) of one row layout, raw elements of
    ``raw_bytes`` bytes each."""
    words: list[int] = []
    code = tile = prog = bucket = off = 0
    rows = _scale_rows(codec)
    for n, q in zip(numels, quantized):
        nb = codec.num_buckets(n) if q else 0
        payload = codec.nbytes(n) if q else n * raw_bytes
        words += [off, n, code, layout.packed_nbytes(n, codec.bits) if q else 0, bucket, tile, prog, int(q)]
        off, code, bucket = off + n, code + payload, bucket + nb
        tile, prog = tile + triton.cdiv(n, TILE), prog + triton.cdiv(nb, rows)
    return tuple(words), tile, prog, bucket


def _scale_rows(codec) -> int:
    return max(1, ROWS_ELEMENTS // triton.next_power_of_2(codec.bucket_size))


def _bits(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    kind, view = DTYPE_KINDS[t.dtype]
    return kind, t.view(view)


def encode_segments(
    codec, rows: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, layout, out: torch.Tensor, out_max: float
) -> None:
    """Every segment of the (R, S) ``rows`` (fp32 / bf16 / fp16, unit stride along a row) into the (R, P) uint8
    ``out``: the quantized segments' scales and parameters in one launch, their codes and the raw segments' bytes in
    a second. ``table``: the device copy of ``segment_table``'s words, ``keys`` the (R, K, 3) int32 key words
    (k1, k2, counter of the first element) of every (row, segment); ``layout``: ``segment_table``'s value."""
    _check_device(rows, "rows")
    r = rows.shape[0]
    words, tiles, progs, nbt = layout
    k = len(words) // F
    spec, kspec = _spec(codec), codec.kernel_spec()
    xk, x = _bits(rows)
    params = torch.empty((max(1, r * nbt), kspec.enc_params), dtype=torch.float32, device=rows.device)
    block = triton.next_power_of_2(codec.bucket_size)
    kp2 = triton.next_power_of_2(k)
    common = (table, keys, params, out, k, x.stride(0), out.stride(0), nbt)
    if progs:
        _wire_kernel[(progs, r)](
            x, *common, KP2=kp2, XK=xk, KIND=spec["KIND"], BUCKET=codec.bucket_size, BLOCK=block,
            ROWS=_scale_rows(codec), LEVELS=spec["LEVELS"], FMAX=float(kspec.fmax), LOG2=block.bit_length() - 1,
            NORM_L2=getattr(codec, "scale_statistic", None) is None, DIVISOR=float(getattr(codec, "_divisor", 1)),
            OUT_MAX=float(out_max), REDO_FLOOR=redo_floor(codec.bucket_size), S=codec.scales_per_bucket,
            P=kspec.enc_params, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    _encode_kernel[(tiles, r)](
        x, *common, KP2=kp2, XK=xk, XES=rows.element_size(), **spec, P=kspec.enc_params,
        STOCHASTIC=kspec.stochastic, FMAX=float(kspec.fmax), GROUPS=GROUPS_PER_PROGRAM, num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip


def decode_segments(
    codec, wire: torch.Tensor, table: torch.Tensor, layout, wire_dtype: torch.dtype, out: torch.Tensor, own: int,
    x: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One launch. ``x`` None: the (R, P) ``wire`` rows decoded into the (R, S) ``out`` (any of the three dtypes,
    unit stride along a row), row ``own`` (-1: none) not written. ``x`` given: the rows summed in rank order into
    the (S,) ``out``, row ``own`` read exact from ``x`` (R, S) in ``wire_dtype``."""
    _check_device(wire, "wire")
    r = wire.shape[0]
    words, tiles, _progs, _nbt = layout
    k = len(words) // F
    wk, _ = DTYPE_KINDS[wire_dtype]
    ok, o = _bits(out)
    xs = x.stride(0) if x is not None else 0
    xv = _bits(x)[1] if x is not None else o
    grid = (tiles,) if x is not None else (tiles, r)
    _decode_kernel[grid](
        wire, table, xv, o, k, own, wire.stride(0), xs, o.stride(0) if o.dim() == 2 else 0,
        R=r if x is not None else 1,  # a constexpr: Triton 3.6's interpreter loops over no runtime bound
        KP2=triton.next_power_of_2(k), WK=wk, WES=torch.empty((), dtype=wire_dtype).element_size(), OK=ok,
        SUM=x is not None, **_spec(codec), P=codec.scales_per_bucket, FP8_E4M3FN=codec.kernel_spec().fp8_e4m3fn,
        GROUPS=GROUPS_PER_PROGRAM, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


__all__ = ["DTYPE_KINDS", "F", "KEY_WORDS", "decode_segments", "encode_segments", "segment_table"]
