"""Per-bucket work of the codecs in Triton: wire scales and encode parameters in one launch, and the decode
parameters computed from the wire scales inside the decode kernel (docs/design.md, "Extreme finite values").

Encode (every codec, buckets of at most ``MAX_BUCKET`` elements): ``_wire_kernel`` reads each bucket once, reduces
it (min and max, max ``|x|``, or the L2 norm of ``qsgd.tree_norm``'s fixed order, ``norms``), and writes the wire
scales (``Codec.bucket_scales``) and encode parameters (``Codec._encode_params``) side by side, so an encode is
this launch plus the element-wise one. Decode: ``dec_params`` turns a bucket's wire scales into
``Codec._decode_params`` per element (the pre-scaling flag in the scale's sign gives ``m``), so a decode is one
launch.

Invariants: every formula is the torch reference's, operation for operation and in the same precision (fp64 where
the reference widens, ``div_rn`` where it divides in fp32), so the scales are the reference's bit for bit,
including the ``wide`` / ``tiny`` pre-scaled buckets at the ends of fp32's range (``codecs.scaling``); a bucket
holding NaN or +-Inf gets NaN scales. The per-codec formulas: docs/design.md, "Module notes".

Example::

    scales, params = wire_encode_params(get_codec("uniform", 8), xf)   # one launch (CUDA, or the interpreter)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import layout
from lightning_qcomm.codecs.layout import KernelKind, redo_floor

from .elementwise import is_finite
from .norms import _finite64, _l2_norm64, _level_cap

FLT_MAX_PY = torch.finfo(torch.float32).max
MAX_BUCKET = 8192  # longest bucket one program reduces in registers; longer ones keep the torch reduction
ROWS_ELEMENTS = 4096  # elements per program of the per-bucket kernel (ROWS buckets of BLOCK)
FUSED_KINDS = (KernelKind.UNIFORM, KernelKind.FP8, KernelKind.QSGD, KernelKind.NUQSGD, KernelKind.SIGN)
FLT_MIN: tl.constexpr = tl.constexpr(2.0**-126)
FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX_PY)
WIDE_SIGMA: tl.constexpr = tl.constexpr(2.0**-64)
TINY_SIGMA: tl.constexpr = tl.constexpr(2.0**64)

_UNIFORM: tl.constexpr = tl.constexpr(int(KernelKind.UNIFORM))
_QSGD: tl.constexpr = tl.constexpr(int(KernelKind.QSGD))
_NUQSGD: tl.constexpr = tl.constexpr(int(KernelKind.NUQSGD))
_SIGN: tl.constexpr = tl.constexpr(int(KernelKind.SIGN))
_FP8: tl.constexpr = tl.constexpr(int(KernelKind.FP8))


@triton.jit
def unflag(w):
    """(magnitude, sigma, m) of a flagged-or-plain wire scale (``scaling.unflag``): a negative scale is flagged,
    ``|w| >= 1`` wide (sigma 2^-64, m 2^64), else tiny (sigma 2^64, m 2^-64); plain and NaN: 1, 1."""
    flagged = w < 0
    mag = tl.where(flagged, 0.0 - w, w)
    tiny = mag < 1.0
    sigma = tl.where(flagged, tl.where(tiny, 18446744073709551616.0, 5.421010862427522e-20), 1.0)
    m = tl.where(flagged, tl.where(tiny, 5.421010862427522e-20, 18446744073709551616.0), 1.0)
    return mag, sigma, m


@triton.jit
def _load_scale(ptr, k, mask, BYTES: tl.constexpr):
    """fp32 scale number ``k`` at ``ptr``: an fp32 pointer, or (``BYTES``) a byte pointer to little-endian fp32
    values at any alignment (the scales behind the codes of a payload)."""
    if BYTES:
        b = ptr + k * 4
        v = tl.load(b, mask=mask, other=0).to(tl.int32)
        v = v | (tl.load(b + 1, mask=mask, other=0).to(tl.int32) << 8)
        v = v | (tl.load(b + 2, mask=mask, other=0).to(tl.int32) << 16)
        v = v | (tl.load(b + 3, mask=mask, other=0).to(tl.int32) << 24)
        return v.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + k, mask=mask, other=0.0)


@triton.jit
def dec_params(
    scales_ptr,
    idx,
    inb,
    KIND: tl.constexpr,
    S: tl.constexpr,
    BUCKET: tl.constexpr,
    LEVELS: tl.constexpr,
    BYTES: tl.constexpr,
):
    """Each element's decode parameters (p0, p1, p2) from its bucket's ``S`` wire scales, as
    ``Codec._decode_params``: uniform (lo, unit, m); QSGD (n / s, m); NUQSGD (n, m); sign1 (scale); FP8 (s, m).
    ``BYTES``: ``scales_ptr`` points at the scales' bytes (``_load_scale``)."""
    if BUCKET == 0:
        k = idx * 0
    else:
        k = (idx // BUCKET) * S
    w0 = _load_scale(scales_ptr, k, inb, BYTES)
    if KIND == _UNIFORM:
        w1 = _load_scale(scales_ptr, k + 1, inb, BYTES)
        unit, _s, m = unflag(w1)
        return w0, unit, m
    elif KIND == _SIGN:
        return w0, w0, w0
    else:
        mag, _s, m = unflag(w0)
        if KIND == _QSGD:
            mag = tl.math.div_rn(mag, tl.full(mag.shape, LEVELS, tl.float32))
        return mag, m, m


@triton.jit
def _store_scale(
    scales_ptr, wire_ptr, q, s, w, mask, S: tl.constexpr, nb_row, wire_stride, scale_off, WIRE: tl.constexpr
):
    """Scale ``s`` of bucket ``q``: into the (nb, S) fp32 ``scales``, or (``WIRE``) as its 4 little-endian bytes
    behind the codes of its row in the (R, ``wire_stride``) uint8 wire rows, where ``Packed.to_bytes`` puts it
    (byte ``scale_off + 4 (k S + s)`` of row q // nb_row, k = q % nb_row): the payload complete in this launch."""
    if WIRE:
        base = wire_ptr + (q // nb_row) * wire_stride + scale_off + ((q % nb_row) * S + s) * 4
        bits = w.to(tl.int32, bitcast=True)
        for b in tl.static_range(4):
            tl.store(base + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        tl.store(scales_ptr + q * S + s, w, mask=mask)


@triton.jit
def _round_down(v64):
    """The largest fp32 <= v64 (v64 >= 0), as ``scaling.round_down``."""
    f = v64.to(tl.float32)
    down = (f.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    return tl.where(f.to(tl.float64) > v64, down, f)


@triton.jit
def bucket_math(
    x,
    valid,
    count,
    ROWS: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    LEVELS: tl.constexpr,
    FMAX: tl.constexpr,
    LOG2: tl.constexpr,
    NORM_L2: tl.constexpr,
    DIVISOR: tl.constexpr,
    OUT_MAX: tl.constexpr,
    REDO_FLOOR: tl.constexpr,
):
    """The wire scales (w0, w1) and encode parameters (q0, q1, q2) of each bucket (row) of the (ROWS, BLOCK) fp32
    tile ``x`` (``valid``: its real elements, ``count`` of them per row), as the module docstring states them;
    the codec uses the first S = ``scales_per_bucket`` scales and P = ``enc_params`` parameters."""
    finite = tl.sum(tl.where(valid & ~is_finite(x), 1, 0), axis=1) == 0
    one = tl.full((ROWS,), 1.0, tl.float64)
    if KIND == _UNIFORM:
        L = tl.full((ROWS,), LEVELS, tl.float32)
        lo = tl.min(tl.where(valid, x, float("inf")), axis=1) + 0.0  # + 0.0: one zero, +0.0, whichever came first
        hi = tl.max(tl.where(valid, x, float("-inf")), axis=1) + 0.0
        unit = tl.math.div_rn(hi - lo, L)
        top = lo + L * unit
        wide = is_finite(lo) & is_finite(hi) & (~is_finite(top) | (unit > 8.507059173023462e37))  # 2^126
        tiny = (hi > lo) & (unit < FLT_MIN)
        special = wide | tiny
        sigma64 = tl.where(wide, WIDE_SIGMA * one, tl.where(tiny, TINY_SIGMA * one, one))
        lo64 = lo.to(tl.float64)
        unit_s = (hi.to(tl.float64) - lo64) * sigma64 / (LEVELS * one)  # fp64 division: div.rn
        unit_s32 = tl.where(wide, _round_down(unit_s / ((1.0 + 2.0**-23) * one)), unit_s.to(tl.float32))
        w0 = tl.where(special, (lo64 * sigma64).to(tl.float32), lo)
        w1 = tl.where(special, 0.0 - unit_s32, unit)
        w0 = tl.where(finite, w0, float("nan"))
        w1 = tl.where(finite, w1, float("nan"))
        # _encode_params: (sigma, lo, 1 / unit), NaN buckets NaN
        u, sigma, _m = unflag(w1)
        inv = tl.where(u > 0, tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), u), 0.0)
        inv = tl.where(is_finite(u), inv, u)
        return w0, w1, sigma, w0, inv
    elif KIND == _FP8:
        amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=1)
        s = tl.math.div_rn(amax, tl.full((ROWS,), FMAX, tl.float32))
        down = (s.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        s = tl.where(is_finite(FMAX * s) | ~is_finite(s), s, down)
        a64 = amax.to(tl.float64)
        tiny = (a64 > 0) & (a64 < FMAX * FLT_MIN * one)
        w0 = tl.where(tiny, 0.0 - (a64 / (FMAX * one) * (TINY_SIGMA * one)).to(tl.float32), s)
        w0 = tl.where(finite, w0, float("nan"))
        # _encode_params: (sigma, 1 / s)
        sm, sigma, _m = unflag(w0)
        inv = tl.where(sm > 0, tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), sm), tl.where(is_finite(sm), 0.0, sm))
        return w0, w0, sigma, inv, inv
    elif KIND == _SIGN:  # SignCodec._scales: the rms n / sqrt(count), from the fp64 norm where it leaves fp32
        n, n64 = _l2_norm64(x, valid, ROWS, BLOCK, LOG2, REDO_FLOOR)
        root = tl.sqrt(count.to(tl.float64))  # sqrt.rn.f64; to fp32 it is torch's fp32 sqrt (53 >= 2 * 24 + 2)
        scale = tl.math.div_rn(n, root.to(tl.float32))
        extreme = (n64 > 0) & _finite64(n64) & ~((scale >= FLT_MIN) & (scale <= FLT_MAX))
        rms = n64 / root  # fp64 division: div.rn
        rms = tl.where(rms > FLT_MAX, FLT_MAX, rms).to(tl.float32)  # clamp(max=FLT_MAX), NaN kept
        w0 = tl.where(extreme, rms, scale)
        w0 = tl.where(finite, w0, float("nan"))
        return w0, w0, w0, w0, w0  # _encode_params: the scale itself
    else:  # QSGD, QSGDinf, NUQSGD: one norm per bucket (_NormCodec._scales, l2_norm_rows64, _encode_params)
        if NORM_L2:
            n, n64 = _l2_norm64(x, valid, ROWS, BLOCK, LOG2, REDO_FLOOR)
        else:
            n = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=1)
            n64 = n.to(tl.float64)
        live = (n64 > 0) & _finite64(n64)
        wide = live & ((n64 > 8.507059173023462e37) | ~is_finite(n))  # 2^126
        tiny = live & (n64 < DIVISOR * FLT_MIN * one)
        sigma64 = tl.where(wide, WIDE_SIGMA * one, tl.where(tiny, TINY_SIGMA * one, one))
        w0 = tl.where(wide | tiny, 0.0 - (n64 * sigma64).to(tl.float32), n)
        w0 = tl.where(finite, w0, float("nan"))
        nm, sigma, m = unflag(w0)
        k = tl.full((ROWS,), DIVISOR, tl.float32)
        rec = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), nm) * k  # torch's k / n: k * (1 / n)
        p = tl.where(nm > 0, rec, tl.where(is_finite(nm), 0.0, nm))
        cap = _level_cap(tl.math.div_rn(nm, k), m, KIND, LEVELS, OUT_MAX)
        return w0, w0, sigma, p, cap


@triton.jit
def store_params(params_ptr, q, live, q0, q1, q2, P: tl.constexpr):
    """The P encode parameters of buckets ``q`` at ``params_ptr`` ((buckets, P) fp32)."""
    tl.store(params_ptr + q * P, q0, mask=live)
    if P >= 2:
        tl.store(params_ptr + q * P + 1, q1, mask=live)
    if P >= 3:
        tl.store(params_ptr + q * P + 2, q2, mask=live)


@triton.jit
def _wire_kernel(
    x_ptr,
    scales_ptr,
    params_ptr,
    wire_ptr,
    nb,
    row_len,
    nb_row,
    wire_stride,
    scale_off,
    KIND: tl.constexpr,
    BUCKET: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    LEVELS: tl.constexpr,
    FMAX: tl.constexpr,
    INT64_INDEX: tl.constexpr,
    LOG2: tl.constexpr,
    NORM_L2: tl.constexpr,
    DIVISOR: tl.constexpr,
    OUT_MAX: tl.constexpr,
    REDO_FLOOR: tl.constexpr,
    WIRE: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        pid = pid.to(tl.int64)
        row_len = row_len.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # bucket q is bucket q % nb_row of row q // nb_row (of row_len)
    cols = tl.arange(0, BLOCK)
    first = (rows % nb_row) * BUCKET
    count = tl.minimum(row_len - first, BUCKET)
    idx = ((rows // nb_row) * row_len + first)[:, None] + cols[None, :]
    valid = (cols[None, :] < count[:, None]) & (rows[:, None] < nb)
    x = tl.load(x_ptr + idx, mask=valid, other=0.0)
    live = rows < nb
    w0, w1, q0, q1, q2 = bucket_math(
        x, valid, count, ROWS, KIND, BLOCK, LEVELS, FMAX, LOG2, NORM_L2, DIVISOR, OUT_MAX, REDO_FLOOR
    )
    _store_scale(scales_ptr, wire_ptr, rows, 0, w0, live, S, nb_row, wire_stride, scale_off, WIRE)
    if S >= 2:
        _store_scale(scales_ptr, wire_ptr, rows, 1, w1, live, S, nb_row, wire_stride, scale_off, WIRE)
    store_params(params_ptr, rows, live, q0, q1, q2, P)


def fused_scales(codec, numel: int) -> bool:
    """Whether ``wire_encode_params`` computes this codec's scales: any codec with kernels whose buckets hold at
    most ``MAX_BUCKET`` elements (one bucket of the whole tensor counts as a bucket of ``numel``)."""
    spec = codec.kernel_spec()
    return spec.kind in FUSED_KINDS and codec.bucket_len(numel) <= MAX_BUCKET


def wire_encode_params(
    codec, xf: torch.Tensor, out_max: float = FLT_MAX_PY, wire: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(wire scales (nb, S), encode parameters (nb, P)) of flat fp32 ``xf``, one launch; bit for bit
    ``codec.bucket_scales(xf)`` and ``codec._encode_params(..., out_max)`` (``out_max``: the largest decode the
    norm codecs' level cap allows, ``scaling.output_max`` of the input's dtype). Needs ``fused_scales``.
    An (R, n) ``xf`` is R tensors of n elements (buckets restart at each row): (R * nb, S) and (R * nb, P).
    With ``wire`` (R, ``codec.nbytes(n)``) uint8, the scales go as bytes behind each row's codes instead (where
    ``Packed.to_bytes`` puts them) and None is returned in their place."""
    r, n = (1, xf.numel()) if xf.dim() == 1 else xf.shape
    if not fused_scales(codec, n):
        raise ValueError(f"codec {codec.name!r} with {codec.bucket_len(n)}-element buckets has no fused scales kernel")
    spec = codec.kernel_spec()
    blen = codec.bucket_len(n)
    nb_row = codec.num_buckets(n)
    nb = r * nb_row
    block = triton.next_power_of_2(blen)
    rows = max(1, ROWS_ELEMENTS // block)
    from . import codec_kernels  # its index limit (the tests lower it to force int64 indexing)

    programs = triton.cdiv(nb, rows)
    if wire is not None and (tuple(wire.shape) != (r, codec.nbytes(n)) or wire.dtype != torch.uint8):
        raise ValueError(f"wire must be ({r}, {codec.nbytes(n)}) uint8, got {tuple(wire.shape)} {wire.dtype}")
    wire_stride = 0 if wire is None else wire.stride(0)
    limit = codec_kernels.INT32_INDEX_LIMIT
    int64_index = r * n + rows * blen > limit or r * wire_stride > limit
    scales = (
        None if wire is not None else torch.empty((nb, codec.scales_per_bucket), dtype=torch.float32, device=xf.device)
    )
    params = torch.empty((nb, spec.enc_params), dtype=torch.float32, device=xf.device)
    _wire_kernel[(programs,)](
        xf,
        params if scales is None else scales,  # unused when the scales go to the wire
        params,
        params if wire is None else wire,  # unused without a wire
        nb,
        n,
        nb_row,
        wire_stride,
        layout.packed_nbytes(n, codec.bits),
        KIND=int(spec.kind),
        BUCKET=blen,
        BLOCK=block,
        ROWS=rows,
        LEVELS=spec.levels,
        FMAX=float(spec.fmax),
        INT64_INDEX=int64_index,
        LOG2=block.bit_length() - 1,
        NORM_L2=getattr(codec, "scale_statistic", None) is None,
        DIVISOR=float(getattr(codec, "_divisor", 1)),
        OUT_MAX=float(out_max),
        REDO_FLOOR=redo_floor(blen),
        WIRE=wire is not None,
        S=codec.scales_per_bucket,
        P=spec.enc_params,
        num_warps=4,
        enable_fp_fusion=False,  # round after each operation, as the reference
    )
    return scales, params


__all__ = ["FUSED_KINDS", "MAX_BUCKET", "dec_params", "fused_scales", "unflag", "wire_encode_params"]
