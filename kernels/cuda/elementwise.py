"""Element-wise device functions of the codec kernels: counter-based uniforms, finiteness, exponent
bit tricks, and each codec's quantize / dequantize map on fp32, in the same operations and order as
the torch reference (``Codec._quantize`` / ``_dequantize``), so results are bit-identical.

The uniform for element ``i`` is ``u = (mix32(mix32(i ^ k1) ^ k2) >> 8) * 2**-24`` in uint32
arithmetic (``codecs/rng.py``), with (k1, k2) = ``rng.seed_to_key(seed)`` computed in Python.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_qcomm.codecs.layout import KernelKind

# fp32 quiet NaN and +Inf as bits: a NaN constexpr global would fail Triton's check that globals did not change
# since compile (it compares with !=, and NaN != NaN), on every launch after the first compile
_NAN_BITS = tl.constexpr(0x7FC00000)
_INF_BITS = tl.constexpr(0x7F800000)
# The kinds, as the C kernels number them (one enum: codecs.layout.KernelKind).
_UNIFORM = tl.constexpr(int(KernelKind.UNIFORM))
_QSGD = tl.constexpr(int(KernelKind.QSGD))
_NUQSGD = tl.constexpr(int(KernelKind.NUQSGD))
_SIGN = tl.constexpr(int(KernelKind.SIGN))


# ---------------------------------------------------------------------------------------------- helpers
@triton.jit
def _mix32(x):
    """lowbias32 finaliser on uint32 (wrapping multiply, logical shifts), as in ``codecs/rng.py``."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def uniform(idx, k1, k2):
    """fp32 uniform in [0, 1) on the 2**-24 grid for element index ``idx`` (any int type; taken mod 2**32)."""
    h = _mix32(_mix32(idx.to(tl.uint32) ^ k1) ^ k2)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def is_finite(v):
    """Exponent field not all ones: neither +-Inf nor NaN."""
    return (v.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _nan_to_zero(v):
    return tl.where(v != v, 0.0, v)


@triton.jit
def _float_exponent(r):
    """floor(log2 r) of a non-negative fp32 from its exponent bits (-127 for 0 / subnormals)."""
    return ((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _exp2_int(e):
    """2**e as fp32, exact, for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _sign_of(c, SIGN_BIT: tl.constexpr):
    return 1.0 - 2.0 * ((c & SIGN_BIT) != 0).to(tl.float32)


# ---------------------------------------------------------------------------------------------- quantize
@triton.jit
def quantize(
    x,
    p0,
    p1,
    p2,
    u,
    KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FMAX: tl.constexpr,
):
    """int32 codes in [0, 2**BITS) of fp32 x; the same operations, in the same order, as each codec's
    ``_quantize`` (LEVELS: uniform 2^b-1, QSGD s, NUQSGD L-1; EMIN: NUQSGD's or FP8's smallest exponent).
    Parameters: uniform (sigma, lo, 1/unit); QSGD / NUQSGD (sigma, k/n, level cap); FP8 (sigma, 1/s)."""
    if KIND == _UNIFORM:  # uniform: floor((x sigma - lo) * inv + u), clamped to [0, LEVELS]
        t = (x * p0 - p1) * p2
        if STOCHASTIC:
            t = t + u
        else:
            t = t + 0.5
        t = _nan_to_zero(t)
        code = tl.minimum(tl.maximum(tl.floor(t), 0.0), LEVELS).to(tl.int32)
    elif KIND == _QSGD:  # QSGD / QSGDinf: r = |x| * s / n; level = floor(r) + [u < frac(r)], at most the cap
        r = _nan_to_zero(tl.abs(x) * p0 * p1)
        lower = tl.floor(r)
        if STOCHASTIC:
            up = u < (r - lower)
        else:
            up = (r - lower) >= 0.5
        level = tl.minimum(tl.minimum(tl.maximum(lower + up.to(tl.float32), 0.0), LEVELS), p2).to(tl.int32)
        code = tl.where(x < 0, level | SIGN_BIT, level)
    elif KIND == _NUQSGD:  # NUQSGD: levels {0} U {2^-k}; bracket from r's exponent, every factor a power of two
        r = _nan_to_zero(tl.abs(x) * p0 * p1)
        r = tl.minimum(tl.maximum(r, 0.0), 1.0)
        e = _float_exponent(r)
        below = e < EMIN
        e_floor = tl.minimum(tl.where(below, EMIN, e), 0)
        scaled = r * _exp2_int(-e_floor)
        p = tl.where(below, scaled, scaled - 1.0)
        idx_lower = tl.where(below, 0, e_floor - EMIN + 1)
        if STOCHASTIC:
            up = u < p
        else:
            up = p >= 0.5
        level = tl.minimum(tl.minimum(tl.maximum(idx_lower + up.to(tl.int32), 0), LEVELS), p2.to(tl.int32))
        code = tl.where(x < 0, level | SIGN_BIT, level)
    elif KIND == _SIGN:  # sign1: 1 for x < 0
        code = (x < 0).to(tl.int32)
    else:  # KernelKind.FP8: |v| = |x| / s on the fp8 grid, nearest-even or stochastic; bit pattern by integer arithmetic
        a = _nan_to_zero(tl.abs(x) * p0 * p1)
        a = tl.minimum(tl.maximum(a, 0.0), FMAX)
        e = tl.maximum(_float_exponent(a), EMIN)
        t = a * _exp2_int(MBITS - e)
        f = tl.floor(t)
        d = t - f
        fi = f.to(tl.int32)
        if STOCHASTIC:
            up = u < d
        else:
            up = (d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))
        m = fi + up.to(tl.int32)
        carry = m >> (MBITS + 1)
        m = m >> carry
        e = e + carry
        normal = m >= (1 << MBITS)
        exp_field = tl.where(normal, e + FP8_BIAS, 0)
        mant = tl.where(normal, m - (1 << MBITS), m)
        code = ((x < 0).to(tl.int32) << 7) | (exp_field << MBITS) | mant
    return code


@triton.jit
def dequantize(
    c,
    p0,
    p1,
    p2,
    KIND: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_E4M3FN: tl.constexpr,
):
    """fp32 values of int32 codes, as each codec's ``_dequantize`` (FP8 decoded from its bit fields).
    Parameters: uniform (lo, unit, m); QSGD / NUQSGD (n/k, m); sign1 (scale); FP8 (s, m)."""
    if KIND == _UNIFORM:
        val = (p0 + c.to(tl.float32) * p1) * p2
    elif KIND == _QSGD:
        level = (c & (SIGN_BIT - 1)).to(tl.float32)
        val = _sign_of(c, SIGN_BIT) * level * p0 * p1
    elif KIND == _NUQSGD:
        idx = c & (SIGN_BIT - 1)
        mag = tl.where(idx > 0, _exp2_int(tl.maximum(idx - LEVELS, -126)), 0.0)
        val = _sign_of(c, SIGN_BIT) * mag * p0 * p1
    elif KIND == _SIGN:
        val = (1.0 - 2.0 * c.to(tl.float32)) * p0
    else:
        exp_field = (c >> MBITS) & ((1 << (7 - MBITS)) - 1)
        mant = c & ((1 << MBITS) - 1)
        # subnormal: mant * 2^(EMIN - MBITS); normal: (2^MBITS + mant) * 2^(exp - bias - MBITS); all exact
        sig = tl.where(exp_field > 0, mant + (1 << MBITS), mant).to(tl.float32)
        mag = sig * _exp2_int(tl.maximum(exp_field - FP8_BIAS, EMIN) - MBITS)
        bits = mag.to(tl.int32, bitcast=True)
        if FP8_E4M3FN:  # e4m3fn: only S.1111.111 is NaN, no infinities
            special = (exp_field == 15) & (mant == 7)
            bits = tl.where(special, _NAN_BITS, bits)
        else:  # e5m2 (IEEE-like): exponent 31 is Inf (mantissa 0) or NaN
            special = exp_field == 31
            bits = tl.where(special, tl.where(mant == 0, _INF_BITS, _NAN_BITS), bits)
        # the sign by its bit, not -mag: Triton <= 3.6 lowers unary minus to 0 - x, which turns -0.0 into +0.0
        sign = (c & 0x80).to(tl.int32) << 24
        val = (bits | sign).to(tl.float32, bitcast=True)
        val = val * p0 * p1
    return val


@triton.jit
def quantize_tile(
    x,
    inb,
    p0,
    p1,
    p2,
    ctr,
    k1,
    k2,
    KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FMAX: tl.constexpr,
):
    """int32 codes of the fp32 tile ``x`` given each element's bucket parameters; the random bits of element i
    from counter ``ctr[i]`` under key (k1, k2). A non-finite x or bucket parameter, and padding (``~inb``): code 0."""
    ok = inb & is_finite(x) & is_finite(p0) & is_finite(p1) & is_finite(p2)
    if STOCHASTIC:
        u = uniform(ctr, k1.to(tl.uint32, bitcast=True), k2.to(tl.uint32, bitcast=True))
    else:
        u = x  # unused
    code = quantize(x, p0, p1, p2, u, KIND, STOCHASTIC, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FMAX)
    return tl.where(ok, code, 0)
