"""Triton encode / decode kernels for every codec: counter-based random bits, quantize, pack, unpack,
dequantize, fused so each element is read and written once.

The per-bucket reductions (min/max, norms, amax) stay in torch (``Codec._scales``, ``_encode_params``,
``_decode_params``); the kernels receive those per-bucket fp32 parameters and do only element-wise
work, in exactly the order of the torch reference, so codes are bit-identical to
``Codec.encode_reference`` and decodes equal ``Codec.decode_reference``.

Layout. Program ``pid`` owns ``GROUPS`` groups of 8 consecutive elements, as a (GROUPS, 8) tile.
Element ``i`` lies in bucket ``i // BUCKET`` (BUCKET = the codec's bucket_size; 0 = one bucket).
A group's 8 codes of ``BITS`` bits form ``v = sum_k code_k << (BITS*k)`` and are stored as the
``BITS`` little-endian bytes of ``v`` (``codecs/packing.py``). Byte ``j`` of a group collects from
code ``k`` the bits ``(code_k << (BITS*k - 8j)) & 0xFF`` (a right shift when negative); shifts are
clamped to [0, 8], which gives 0 exactly for the codes that do not touch byte j, so everything
stays in int32.

Random bits: ``u = (mix32(mix32(i ^ k1) ^ k2) >> 8) * 2**-24`` in uint32 arithmetic (``codecs/rng.py``),
with (k1, k2) = ``rng.seed_to_key(seed)`` computed in Python.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import packing, rng

# Element-wise maps (constexpr KIND of the kernels).
UNIFORM, QSGD, NUQSGD, SIGN, FP8 = 0, 1, 2, 3, 4
_KIND_OF_NAME = {
    "uniform": UNIFORM,
    "qsgd": QSGD,
    "qsgdinf": QSGD,  # same element-wise map; only the bucket norm (computed in torch) differs
    "nuqsgd": NUQSGD,
    "sign1": SIGN,
    "fp8_e4m3": FP8,
    "fp8_e5m2": FP8,
}

GROUPS_PER_PROGRAM = 128  # 1024 elements per program
NUM_WARPS = 4
# Element indices are int32 up to this many elements (padding of the last program included); int64 beyond.
INT32_INDEX_LIMIT = 2**31 - 1
_NAN = tl.constexpr(float("nan"))
_INF = tl.constexpr(float("inf"))


# ---------------------------------------------------------------------------------------------- helpers
@triton.jit
def _mix32(x):
    """lowbias32 finaliser on uint32 (wrapping multiply, logical shifts), as ``rng._mix32``."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform(idx, k1, k2):
    """fp32 uniform in [0, 1) on the 2**-24 grid for element index ``idx`` (any int type; taken mod 2**32)."""
    h = _mix32(_mix32(idx.to(tl.uint32) ^ k1) ^ k2)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _is_finite(v):
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
def _quantize(
    x,
    p0,
    p1,
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
    ``_quantize`` (LEVELS: uniform 2^b-1, QSGD s, NUQSGD L-1; EMIN: NUQSGD's or FP8's smallest exponent)."""
    if KIND == 0:  # uniform: floor((x - lo) * inv + u), clamped to [0, LEVELS]
        t = (x - p0) * p1
        if STOCHASTIC:
            t = t + u
        else:
            t = t + 0.5
        t = _nan_to_zero(t)
        code = tl.minimum(tl.maximum(tl.floor(t), 0.0), LEVELS).to(tl.int32)
    elif KIND == 1:  # QSGD / QSGDinf: r = |x| * s / n; level = floor(r) + [u < frac(r)]
        r = _nan_to_zero(tl.abs(x) * p0)
        lower = tl.floor(r)
        if STOCHASTIC:
            up = u < (r - lower)
        else:
            up = (r - lower) >= 0.5
        level = tl.minimum(tl.maximum(lower + up.to(tl.float32), 0.0), LEVELS).to(tl.int32)
        code = tl.where(x < 0, level | SIGN_BIT, level)
    elif KIND == 2:  # NUQSGD: levels {0} U {2^-k}; bracket from r's exponent, every factor a power of two
        r = _nan_to_zero(tl.abs(x) * p0)
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
        level = tl.minimum(tl.maximum(idx_lower + up.to(tl.int32), 0), LEVELS)
        code = tl.where(x < 0, level | SIGN_BIT, level)
    elif KIND == 3:  # sign1: 1 for x < 0
        code = (x < 0).to(tl.int32)
    else:  # FP8: |v| = |x| / s on the fp8 grid, nearest-even or stochastic; bit pattern by integer arithmetic
        a = _nan_to_zero(tl.abs(x) * p0)
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
def _dequantize(
    c,
    p0,
    p1,
    KIND: tl.constexpr,
    LEVELS: tl.constexpr,
    SIGN_BIT: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_E4M3FN: tl.constexpr,
):
    """fp32 values of int32 codes, as each codec's ``_dequantize`` (FP8 decoded from its bit fields)."""
    if KIND == 0:
        val = p0 + c.to(tl.float32) * p1
    elif KIND == 1:
        level = (c & (SIGN_BIT - 1)).to(tl.float32)
        val = _sign_of(c, SIGN_BIT) * level * p0
    elif KIND == 2:
        idx = c & (SIGN_BIT - 1)
        mag = tl.where(idx > 0, _exp2_int(tl.maximum(idx - LEVELS, -126)), 0.0)
        val = _sign_of(c, SIGN_BIT) * mag * p0
    elif KIND == 3:
        val = (1.0 - 2.0 * c.to(tl.float32)) * p0
    else:
        exp_field = (c >> MBITS) & ((1 << (7 - MBITS)) - 1)
        mant = c & ((1 << MBITS) - 1)
        # subnormal: mant * 2^(EMIN - MBITS); normal: (2^MBITS + mant) * 2^(exp - bias - MBITS); all exact
        sig = tl.where(exp_field > 0, mant + (1 << MBITS), mant).to(tl.float32)
        mag = sig * _exp2_int(tl.maximum(exp_field - FP8_BIAS, EMIN) - MBITS)
        if FP8_E4M3FN:  # e4m3fn: only S.1111.111 is NaN, no infinities
            special = (exp_field == 15) & (mant == 7)
            mag = tl.where(special, _NAN, mag)
        else:  # e5m2 (IEEE-like): exponent 31 is Inf (mantissa 0) or NaN
            special = exp_field == 31
            mag = tl.where(special, tl.where(mant == 0, _INF, _NAN), mag)
        val = tl.where((c & 0x80) != 0, -mag, mag)
        val = val * p0
    return val


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["k1", "k2"])
def _encode_kernel(
    x_ptr,
    params_ptr,
    out_ptr,
    n,
    k1,
    k2,
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
    INT64_INDEX: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        pid = pid.to(tl.int64)
        n = n.to(tl.int64)
    g = pid * GROUPS + tl.arange(0, GROUPS)  # group ids (GROUPS,)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]  # element ids (GROUPS, 8)
    inb = idx < n
    x = tl.load(x_ptr + idx, mask=inb, other=0.0)

    # Per-bucket parameters (fp32), gathered per element; a non-finite parameter zeroes the whole bucket.
    if BUCKET == 0:
        p0 = tl.load(params_ptr)
        ok = inb & _is_finite(x) & _is_finite(p0)
        if P == 2:
            p1 = tl.load(params_ptr + 1)
            ok = ok & _is_finite(p1)
        else:
            p1 = p0
    else:
        b = idx // BUCKET
        p0 = tl.load(params_ptr + b * P, mask=inb, other=0.0)
        ok = inb & _is_finite(x) & _is_finite(p0)
        if P == 2:
            p1 = tl.load(params_ptr + b * P + 1, mask=inb, other=0.0)
            ok = ok & _is_finite(p1)
        else:
            p1 = p0

    if STOCHASTIC:
        u = _uniform(idx, k1.to(tl.uint32, bitcast=True), k2.to(tl.uint32, bitcast=True))
    else:
        u = x  # unused

    code = _quantize(x, p0, p1, u, KIND, STOCHASTIC, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FMAX)
    code = tl.where(ok, code, 0)  # non-finite x or bucket, and padding past n: code 0

    ngroups = (n + 7) // 8
    if BITS == 8:
        tl.store(out_ptr + idx, code.to(tl.uint8), mask=idx < ngroups * 8)
    else:
        j = tl.arange(0, BITS_P2)
        s = lane[:, None] * BITS - j[None, :] * 8  # where code k's bits start relative to byte j
        shl = tl.minimum(tl.maximum(s, 0), 8)
        shr = tl.minimum(tl.maximum(-s, 0), 8)
        part = ((code[:, :, None] << shl[None, :, :]) >> shr[None, :, :]) & 0xFF  # (GROUPS, 8, BITS_P2)
        byte = tl.sum(part, axis=1)  # disjoint bit fields: sum == or
        dst = g[:, None] * BITS + j[None, :]
        tl.store(out_ptr + dst, byte.to(tl.uint8), mask=(j[None, :] < BITS) & (g[:, None] < ngroups))


@triton.jit
def _decode_kernel(
    codes_ptr,
    params_ptr,
    out_ptr,
    n,
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
    if BITS == 8:
        c = tl.load(codes_ptr + idx, mask=inb, other=0).to(tl.int32)
    else:
        ngroups = (n + 7) // 8
        j = tl.arange(0, BITS_P2)
        src = g[:, None] * BITS + j[None, :]
        byte = tl.load(codes_ptr + src, mask=(j[None, :] < BITS) & (g[:, None] < ngroups), other=0).to(tl.int32)
        s = j[None, :] * 8 - lane[:, None] * BITS  # where byte j starts relative to code k's bits
        shl = tl.minimum(tl.maximum(s, 0), 8)
        shr = tl.minimum(tl.maximum(-s, 0), 8)
        part = ((byte[:, None, :] << shl[None, :, :]) >> shr[None, :, :]) & ((1 << BITS) - 1)  # (GROUPS, 8, BITS_P2)
        c = tl.sum(part, axis=2)

    if BUCKET == 0:
        p0 = tl.load(params_ptr)
        if P == 2:
            p1 = tl.load(params_ptr + 1)
        else:
            p1 = p0
    else:
        b = idx // BUCKET
        p0 = tl.load(params_ptr + b * P, mask=inb, other=0.0)
        if P == 2:
            p1 = tl.load(params_ptr + b * P + 1, mask=inb, other=0.0)
        else:
            p1 = p0

    val = _dequantize(c, p0, p1, KIND, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FP8_E4M3FN)
    tl.store(out_ptr + idx, val, mask=inb)


# ---------------------------------------------------------------------------------------------- launchers
def _is_interpreted() -> bool:
    """True when this module was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors)."""
    return not isinstance(_encode_kernel, triton.runtime.JITFunction)


def _to_i32(word: int) -> int:
    """A uint32 key word as the int32 with the same bits (one kernel signature for every seed)."""
    return word - (1 << 32) if word >= (1 << 31) else word


def _spec(codec) -> dict:
    """Compile-time constants of ``codec`` (kind, widths, levels, exponents)."""
    name = getattr(codec, "name", None)
    kind = _KIND_OF_NAME.get(name)
    if kind is None:
        raise ValueError(f"codec name {name!r} has no Triton kernel; supported: {sorted(_KIND_OF_NAME)}")
    cfg = codec.kernel_config()
    bits = codec.bits
    spec = {
        "KIND": kind,
        "BITS": bits,
        "BITS_P2": triton.next_power_of_2(bits),
        "BUCKET": 0 if codec.bucket_size is None else codec.bucket_size,
        "LEVELS": 0,
        "SIGN_BIT": 0,
        "EMIN": 0,
        "MBITS": 0,
        "FP8_BIAS": 0,
    }
    if kind == UNIFORM:
        spec["LEVELS"] = cfg["LEVELS"]
    elif kind == QSGD:
        spec.update(LEVELS=codec.s, SIGN_BIT=codec.sign_bit)
    elif kind == NUQSGD:
        spec.update(LEVELS=cfg["NUM_LEVELS"] - 1, SIGN_BIT=codec.sign_bit, EMIN=cfg["EMIN"])
    elif kind == FP8:
        spec.update(MBITS=cfg["MBITS"], FP8_BIAS=cfg["BIAS"], EMIN=1 - cfg["BIAS"])
    return spec


def _check_device(t: torch.Tensor, arg: str) -> None:
    if not (t.is_cuda or _is_interpreted()):
        raise ValueError(
            f"{arg} is on {t.device}; the Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 set before "
            "lightning_qcomm.kernels is imported, for CPU tensors)"
        )


def _grid(numel: int) -> tuple[tuple[int], bool]:
    per_program = GROUPS_PER_PROGRAM * 8
    programs = triton.cdiv(numel, per_program)
    return (programs,), programs * per_program > INT32_INDEX_LIMIT


def encode(codec, xf: torch.Tensor, enc_params: torch.Tensor, seed: int) -> torch.Tensor:
    """Packed uint8 codes of flat fp32 ``xf``, bit-identical to ``codec.encode_reference(xf, enc_params, seed)``.

    ``enc_params`` is ``codec._encode_params(scales)``, shape (num_buckets, P), fp32.
    """
    spec = _spec(codec)
    if xf.dtype != torch.float32 or xf.dim() != 1:
        raise TypeError(f"xf must be a flat float32 tensor, got dtype {xf.dtype} and shape {tuple(xf.shape)}")
    _check_device(xf, "xf")
    n = xf.numel()
    if n == 0:
        raise ValueError("xf must be non-empty")
    params = enc_params.to(device=xf.device, dtype=torch.float32).contiguous()
    if params.dim() != 2 or params.shape[0] != codec.num_buckets(n):
        raise ValueError(
            f"enc_params must have shape ({codec.num_buckets(n)}, P) for {n} elements, got {tuple(params.shape)}"
        )
    xf = xf.contiguous()
    k1, k2 = rng.seed_to_key(seed)
    out = torch.empty(packing.packed_nbytes(n, spec["BITS"]), dtype=torch.uint8, device=xf.device)
    grid, int64_index = _grid(n)
    _encode_kernel[grid](
        xf,
        params,
        out,
        n,
        _to_i32(k1),
        _to_i32(k2),
        **spec,
        P=params.shape[1],
        STOCHASTIC=bool(codec.stochastic),
        FMAX=float(getattr(codec, "fmax", 0.0)),
        GROUPS=GROUPS_PER_PROGRAM,
        INT64_INDEX=int64_index,
        num_warps=NUM_WARPS,
        # No FMA contraction: (x - lo) * inv + u and friends must round after each operation, as the torch
        # reference does, or a code can differ by one where the sum lands exactly on an integer.
        enable_fp_fusion=False,
    )
    return out


def decode(codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat fp32 values of ``numel`` packed codes, equal to ``codec.decode_reference(codes, dec_params, numel)``."""
    spec = _spec(codec)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    _check_device(codes, "codes")
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    expected = packing.packed_nbytes(numel, spec["BITS"])
    codes = codes.reshape(-1)
    if codes.numel() != expected:
        raise ValueError(f"codes has {codes.numel()} bytes, expected {expected} for {numel} elements")
    params = dec_params.to(device=codes.device, dtype=torch.float32).contiguous()
    if params.dim() != 2 or params.shape[0] != codec.num_buckets(numel):
        raise ValueError(
            f"dec_params must have shape ({codec.num_buckets(numel)}, P) for {numel} elements, got "
            f"{tuple(params.shape)}"
        )
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    grid, int64_index = _grid(numel)
    _decode_kernel[grid](
        codes.contiguous(),
        params,
        out,
        numel,
        **spec,
        P=params.shape[1],
        FP8_E4M3FN=getattr(codec, "fmt", "") == "e4m3",
        GROUPS=GROUPS_PER_PROGRAM,
        INT64_INDEX=int64_index,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # see encode
    )
    return out
