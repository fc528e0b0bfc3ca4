"""Triton encode / decode kernels for every codec: counter-based random bits, quantize, pack, unpack,
dequantize, fused so each element is read and written once.

The encode kernel receives the per-bucket fp32 parameters (P = 1..3 per bucket, not the wire's
scales_per_bucket: ``Codec._encode_params``, from ``wire_params.wire_encode_params`` for the uniform and FP8
codecs, from torch for the norm codecs) and does only element-wise work, in exactly the order of the torch
reference, so codes are bit-identical to ``Codec.encode_reference``. The decode kernel takes either the decode
parameters or (``wire=True``) the wire scales, from which it makes them (``wire_params.dec_params``); its
values equal ``Codec.decode_reference``.

Layout. Program ``pid`` owns ``GROUPS`` groups of 8 consecutive elements, as a (GROUPS, 8) tile.
Element ``i`` lies in bucket ``i // BUCKET`` (BUCKET = the codec's bucket_size; 0 = one bucket).
A group's 8 codes of ``BITS`` bits form ``v = sum_k code_k << (BITS*k)`` and are stored as the
``BITS`` little-endian bytes of ``v`` (``codecs/layout.py``). Byte ``j`` of a group collects from
code ``k`` the bits ``(code_k << (BITS*k - 8j)) & 0xFF`` (a right shift when negative); shifts are
clamped to [0, 8], which gives 0 exactly for the codes that do not touch byte j, so everything
stays in int32.

The element-wise maps (random bits, quantize, dequantize) live in ``elementwise.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import layout, registry, rng
from lightning_qcomm.codecs.layout import KernelSpec

from .elementwise import dequantize, quantize_tile
from .wire_params import dec_params

GROUPS_PER_PROGRAM = 128  # 1024 elements per program
NUM_WARPS = 4
# Element indices are int32 up to this many elements (padding of the last program included); int64 beyond.
INT32_INDEX_LIMIT = 2**31 - 1


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _load_params(params_ptr, idx, inb, P: tl.constexpr, BUCKET: tl.constexpr):
    """The P (1..3) fp32 parameters of each element's bucket, as (p0, p1, p2); missing ones repeat the last."""
    if BUCKET == 0:
        base = params_ptr
        p0 = tl.load(base)
        p1 = tl.load(base + 1) if P >= 2 else p0
        p2 = tl.load(base + 2) if P >= 3 else p1
    else:
        base = params_ptr + (idx // BUCKET) * P
        p0 = tl.load(base, mask=inb, other=0.0)
        p1 = tl.load(base + 1, mask=inb, other=0.0) if P >= 2 else p0
        p2 = tl.load(base + 2, mask=inb, other=0.0) if P >= 3 else p1
    return p0, p1, p2


@triton.jit(do_not_specialize=["k1", "k2"])
def _encode_kernel(
    x_ptr,
    params_ptr,
    out_ptr,
    n,
    k1,
    k2,
    keys_ptr,
    out_stride,
    nb_row,
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
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        pid = pid.to(tl.int64)
        n = n.to(tl.int64)
    if ROWS:  # rows form: row program_id(1) of an (R, n) tensor is a tensor of its own, with its own key
        row = tl.program_id(1).to(tl.int64)
        x_ptr += row * n
        out_ptr += row * out_stride
        params_ptr += row * nb_row * P
        if STOCHASTIC:
            k1 = tl.load(keys_ptr + 2 * row)
            k2 = tl.load(keys_ptr + 2 * row + 1)
    g = pid * GROUPS + tl.arange(0, GROUPS)  # group ids (GROUPS,)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]  # element ids (GROUPS, 8)
    inb = idx < n
    x = tl.load(x_ptr + idx, mask=inb, other=0.0)
    p0, p1, p2 = _load_params(params_ptr, idx, inb, P, BUCKET)
    code = quantize_tile(
        x, inb, p0, p1, p2, idx, k1, k2, KIND, STOCHASTIC, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FMAX
    )
    pack_store(out_ptr, code, g, lane, idx, n, BITS, BITS_P2)


@triton.jit
def pack_store(out_ptr, code, g, lane, idx, n, BITS: tl.constexpr, BITS_P2: tl.constexpr):
    """The (GROUPS, 8) codes of groups ``g`` packed into bytes at ``out_ptr`` (module docstring); only the groups of
    the n elements are written."""
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
def unpack_codes(codes_ptr, g, lane, idx, inb, n, BITS: tl.constexpr, BITS_P2: tl.constexpr):
    """int32 codes of the (GROUPS, 8) element tile ``idx`` (groups ``g``, lanes ``lane``) from the packed bytes."""
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
    return c


@triton.jit
def _decode_kernel(
    codes_ptr,
    params_ptr,
    out_ptr,
    n,
    row_stride,
    scale_off,
    out_limit,
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
    WIRE: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64_INDEX:
        pid = pid.to(tl.int64)
        n = n.to(tl.int64)
    if ROWS:  # rows form: row program_id(1) is the payload at codes_ptr + row * row_stride, its scales behind
        row = tl.program_id(1).to(tl.int64)  # the codes at byte scale_off; values into out row `row` (n each)
        codes_ptr += row * row_stride
        out_ptr += row * n
        out_limit -= row * n  # the flat out holds the first out_limit values of the (R, n) rows
    g = pid * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    idx = g[:, None] * 8 + lane[None, :]
    inb = idx < n
    c = unpack_codes(codes_ptr, g, lane, idx, inb, n, BITS, BITS_P2)
    if ROWS:
        p0, p1, p2 = dec_params(codes_ptr + scale_off, idx, inb, KIND, P, BUCKET, LEVELS, True)
    elif WIRE:  # params_ptr holds the wire scales (P of them per bucket): the decode parameters are made here
        p0, p1, p2 = dec_params(params_ptr, idx, inb, KIND, P, BUCKET, LEVELS, False)
    else:
        p0, p1, p2 = _load_params(params_ptr, idx, inb, P, BUCKET)
    val = dequantize(c, p0, p1, p2, KIND, LEVELS, SIGN_BIT, EMIN, MBITS, FP8_BIAS, FP8_E4M3FN)
    tl.store(out_ptr + idx, val, mask=inb & (idx < out_limit))


# ---------------------------------------------------------------------------------------------- launchers
def _is_interpreted() -> bool:
    """True when this module was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors)."""
    return not isinstance(_encode_kernel, triton.runtime.JITFunction)


def _to_i32(word: int) -> int:
    """A uint32 key word as the int32 with the same bits (one kernel signature for every seed)."""
    return word - (1 << 32) if word >= (1 << 31) else word


def _kernel_spec(codec) -> KernelSpec:
    """The codec's ``KernelSpec`` (the one the C kernels read too); a ValueError for a codec without one."""
    name = getattr(codec, "name", None)
    supported = [n for n in registry.codec_names() if registry.codec_spec(n).kernels]
    if name not in supported or not callable(getattr(codec, "kernel_spec", None)):
        raise ValueError(f"codec name {name!r} has no Triton kernel; supported: {supported}")
    return codec.kernel_spec()


def _spec(codec) -> dict:
    """Compile-time constants of ``codec`` (kind, widths, levels, exponents), from its ``KernelSpec``; the
    kinds are ``layout.KernelKind``'s numbers (``elementwise.py`` switches on them)."""
    k = _kernel_spec(codec)
    return {
        "KIND": int(k.kind),
        "BITS": k.bits,
        "BITS_P2": triton.next_power_of_2(k.bits),
        "BUCKET": k.bucket,
        "LEVELS": k.levels,
        "SIGN_BIT": k.sign_bit,
        "EMIN": k.emin,
        "MBITS": k.mbits,
        "FP8_BIAS": k.bias,
    }


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
    out = torch.empty(layout.packed_nbytes(n, spec["BITS"]), dtype=torch.uint8, device=xf.device)
    grid, int64_index = _grid(n)
    _launch_encode(codec, grid, xf, params, out, n, (_to_i32(k1), _to_i32(k2)), None, 0, 0, int64_index, False)
    return out


def encode_rows(codec, rows: torch.Tensor, enc_params: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> None:
    """Codes of every row of contiguous fp32 ``rows`` (R, n), each coded as a tensor of its own with the key
    ``keys[j]`` ((R, 2) int32 words of ``rng.seed_to_key``; None for a deterministic codec), into
    ``out[j, :packed_nbytes(n)]`` of the (R, S) uint8 ``out``; ``enc_params``: (R * buckets per row, P). One launch."""
    r, n = rows.shape
    _check_device(rows, "rows")
    nb_row = codec.num_buckets(n)
    params = enc_params.to(device=rows.device, dtype=torch.float32).contiguous()
    if keys is None and codec.kernel_spec().stochastic:
        raise ValueError(f"codec {codec.name!r} is stochastic: encode_rows needs the rows' keys")
    keys_ok = keys is None or tuple(keys.shape) == (r, 2)
    if params.shape[0] != r * nb_row or not keys_ok or out.dim() != 2 or out.shape[0] != r:
        raise ValueError(
            f"rows {tuple(rows.shape)}: enc_params must have {r * nb_row} rows (got {tuple(params.shape)}), keys "
            f"shape ({r}, 2) (got {None if keys is None else tuple(keys.shape)}), out R rows (got {tuple(out.shape)})"
        )
    (programs,), int64_index = _grid(n)
    _launch_encode(codec, (programs, r), rows, params, out, n, (0, 0), keys, out.stride(0), nb_row, int64_index, True)


def decode_rows(codec, wire: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(R, n) fp32 values of the R payloads (codes, then the scales' bytes) of ``wire`` (R, ``codec.nbytes(n)``)
    uint8, row j equal to ``codec.decode(codec.from_bytes(wire[j], (n,), fp32))``. One launch. ``out``: a
    contiguous fp32 tensor of m elements, (R - 1) n < m <= R n, that takes the first m values of the rows
    (row-major; the rest are not written), returned instead."""
    spec = _spec(codec)
    _check_device(wire, "wire")
    r, p = wire.shape
    if p != codec.nbytes(n) or wire.dtype != torch.uint8:
        raise ValueError(f"wire must be (R, {codec.nbytes(n)}) uint8 for rows of {n} elements, got {tuple(wire.shape)}")
    wire = wire.contiguous()
    if out is None:
        out = torch.empty(r, n, dtype=torch.float32, device=wire.device)
    elif out.dtype != torch.float32 or not out.is_contiguous() or not (r - 1) * n < out.numel() <= r * n:
        raise ValueError(f"out must be contiguous fp32 with ({r} - 1) * {n} < numel <= {r} * {n}, got {out.numel()}")
    (programs,), int64_index = _grid(n)
    # the params pointer is unused: the rows form reads the scales behind each row's codes
    scale_off = layout.packed_nbytes(n, spec["BITS"])
    rows_layout, s = (p, scale_off, out.numel()), codec.scales_per_bucket
    _launch_decode(codec, (programs, r), wire, wire, out, n, rows_layout, s, int64_index, rows=True)
    return out


def _launch_encode(codec, grid, xf, params, out, n, k, keys, out_stride, nb_row, int64_index, rows) -> None:
    spec = _spec(codec)
    _encode_kernel[grid](
        xf,
        params,
        out,
        n,
        k[0],
        k[1],
        keys if keys is not None else params,  # read only by the rows form of a stochastic codec
        out_stride,
        nb_row,
        **spec,
        P=params.shape[1],
        STOCHASTIC=codec.kernel_spec().stochastic,
        FMAX=float(codec.kernel_spec().fmax),
        GROUPS=GROUPS_PER_PROGRAM,
        INT64_INDEX=int64_index,
        ROWS=rows,
        num_warps=NUM_WARPS,
        # No FMA contraction: (x - lo) * inv + u and friends must round after each operation, as the torch
        # reference does, or a code can differ by one where the sum lands exactly on an integer.
        enable_fp_fusion=False,
    )


def decode(codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int, wire: bool = False) -> torch.Tensor:
    """Flat fp32 values of ``numel`` packed codes, equal to ``codec.decode_reference(codes, dec_params, numel)``.

    ``wire=True``: ``dec_params`` are the wire scales (num_buckets, scales_per_bucket) and the kernel makes the
    decode parameters from them (``codec._decode_params``), so the decode is one launch.
    """
    spec = _spec(codec)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    _check_device(codes, "codes")
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    expected = layout.packed_nbytes(numel, spec["BITS"])
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
    rows_layout = (0, 0, numel)
    _launch_decode(
        codec, grid, codes.contiguous(), params, out, numel, rows_layout, params.shape[1], int64_index, wire=wire
    )
    return out


def _launch_decode(codec, grid, codes, params, out, n, rows_layout, p, int64_index, wire=True, rows=False) -> None:
    """One decode launch; ``rows_layout``: (payload stride, byte offset of the scales) of the rows form, and the
    values the flat ``out`` holds."""
    _decode_kernel[grid](
        codes,
        params,
        out,
        n,
        rows_layout[0],
        rows_layout[1],
        rows_layout[2],
        **_spec(codec),
        P=p,
        FP8_E4M3FN=codec.kernel_spec().fp8_e4m3fn,
        GROUPS=GROUPS_PER_PROGRAM,
        INT64_INDEX=int64_index,
        WIRE=wire,
        ROWS=rows,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # see _launch_encode
    )
