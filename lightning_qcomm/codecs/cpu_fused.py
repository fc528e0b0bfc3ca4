"""The fused C passes of the CPU backend (``codecs.cpu`` calls them for the ops' CPU kernels): a few compiled passes
instead of ~40 eager ops (docs/design.md, "Registry, ops and kernels"; the 1-bit sign passes: ``codecs.sign_ops``).

The torch reference (``Codec._scales`` + ``encode_reference`` / ``decode_reference``) stays the spec. On CPU tensors
of at least ``FUSED_MIN_NUMEL`` elements of a codec with native kernels the same arithmetic runs in the C kernels
(``kernels/cpu``, the ``torch.ops.qcomm.c_*`` ops): encode in two passes (per-bucket stats, then counter hash,
quantize and pack), decode in one (unpack, LUT, scale). Smaller tensors, other codecs and
``LIGHTNING_QCOMM_CPU_FUSED=0`` run the reference; so does everything when the library cannot be built
(``codecs.native``; logged once).

Invariants: bit-identical to the reference (tests/codecs/test_cpu_fused.py): the decode LUT comes from the codec's own
``_dequantize``; the scales are the codec's own ``_scales`` of exact per-bucket stats (min/max, ``max |x|``) or, for the
L2-norm codecs (qsgd, nuqsgd, sign1), of ``qsgd.tree_norm``'s fixed pairwise order (its C kernel on CPU), so no
scale depends on torch's summation order. Single-threaded, in the calling thread, under the caller's
floating-point environment.

Example::

    >>> codec = get_codec("qsgd", bits=4)
    >>> use_fused(codec, x, x.numel())     # CPU, >= FUSED_MIN_NUMEL elements, library built
    True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref

import torch

from lightning_qcomm._log import log_once
from lightning_qcomm.codecs import layout, native, registry, rng, scaling
from lightning_qcomm.codecs.layout import KernelKind
from lightning_qcomm.codecs.qsgd import tree_norm

log = logging.getLogger(__name__)
FLT_MAX = torch.finfo(torch.float32).max

# Smallest tensor (elements) that goes to the fused path. Below it the eager reference's fixed costs are
# small anyway, and keeping small tensors on the reference keeps the spec path exercised by the tests.
# 2^14 puts QSDP's per-parameter shards and DDP buckets of real models on the fused path.
FUSED_MIN_NUMEL = 1 << 14
ENV_SWITCH = native.ENV_SWITCH  # "0" disables the fused path


def supports(codec) -> bool:
    """True when ``codec`` is exactly the class registered under its name with native kernels."""
    return registry.has_kernels(codec)


def use_fused(codec, t: torch.Tensor, numel: int) -> bool:
    """True when the fused CPU path should do the work of ``codec`` on ``numel`` elements of ``t``'s device."""
    if t.device.type != "cpu" or numel < FUSED_MIN_NUMEL or not supports(codec):
        return False
    if os.environ.get(ENV_SWITCH) == "0":
        return False
    if native.load() is None:
        log_once(
            log,
            "no-cpu-fused",
            f"lightning_qcomm: fused CPU codecs unavailable ({native.load_error()}); using the torch reference",
        )
        return False
    return True


def _require() -> None:
    if native.load() is None:
        raise RuntimeError(f"lightning_qcomm fused CPU codecs unavailable: {native.load_error()}")


def _fused_decode_params(codec, scales: torch.Tensor) -> torch.Tensor:
    """The C decode's params: the codec's ``plain_decode_params`` (one column: the kernel then multiplies by
    one parameter, the reference's product with m = 1 exactly) where it has them, else ``_decode_params``."""
    plain = getattr(codec, "plain_decode_params", None)
    params = None if plain is None else plain(scales)
    return codec._decode_params(scales) if params is None else params


# ------------------------------------------------------------------ the fused passes
def encode(
    codec, xf: torch.Tensor, enc_params: torch.Tensor, seed: int, out: torch.Tensor | None = None, offset: int = 0
) -> torch.Tensor:
    """Fused ``codec.encode_reference(xf, enc_params, seed)``: packed uint8 codes of flat fp32 ``xf``, written
    into ``out`` (contiguous uint8, ``packed_nbytes`` long) when given. ``offset``: the random counter of
    element i is offset + i (0 in the reference; xf a run of whole buckets of a longer tensor, see
    ``codecs.rows.encode_flat_row_into``)."""
    _require()
    x = xf.reshape(-1).to(torch.float32).contiguous()
    n = x.numel()
    params = enc_params.to(torch.float32).contiguous()
    spec = kernel_spec(codec)
    if params.shape != (codec.num_buckets(n), spec.enc_params):
        raise ValueError(f"enc_params of shape {tuple(params.shape)} do not match codec {codec!r} on {n} elements")
    if out is None:
        out = torch.empty(layout.packed_nbytes(n, codec.bits), dtype=torch.uint8)
    k1, k2 = rng.seed_to_key(seed)
    torch.ops.qcomm.c_encode_codes.default(x, params, k1, k2, *_c_spec_args(codec), out, offset)
    return out


_LUTS: dict[tuple, torch.Tensor] = {}
_PER_CODEC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached(codec) -> dict:
    """Per-codec-instance cache (kernel spec, LUT), dropped if any attribute of the codec changed since."""
    state = tuple(vars(codec).items())
    entry = _PER_CODEC.get(codec)
    if entry is None or entry[0] != state:
        entry = _PER_CODEC[codec] = (state, {})
    return entry[1]


def kernel_spec(codec):
    """``codec.kernel_spec()``, built once per codec instance (the ops reuse their codecs)."""
    cache = _cached(codec)
    spec = cache.get("spec")
    if spec is None:
        spec = cache["spec"] = codec.kernel_spec()
    return spec


def _c_spec_args(codec) -> tuple:
    """``kernel_spec(codec).c_args()`` as positional arguments in ``C_SPEC_SCHEMA`` order, built once per codec."""
    cache = _cached(codec)
    args = cache.get("c_args")
    if args is None:
        args = cache["c_args"] = tuple(kernel_spec(codec).c_args().values())
    return args


def decode_lut(codec) -> torch.Tensor:
    """fp32 value of every code with unit params, from the codec's own ``_dequantize``: uniform
    ``(0 + c * 1) * 1``; the others ``v(c) * 1 * 1``. The fused decode computes ``(p0 + LUT[c] * p1) * p2``
    or ``LUT[c] * p0 * p1``, which is the reference's expression term by term. Cached per codec class and
    kernel spec (every field ``_dequantize`` reads is in it; the bucket size and rounding are not read)."""
    cache = _cached(codec)
    lut = cache.get("lut")
    if lut is None:
        key = (type(codec), dataclasses.replace(kernel_spec(codec), bucket=0, stochastic=False))
        lut = _LUTS.get(key)
        if lut is None:
            lut = _LUTS[key] = _decode_lut(codec)
        cache["lut"] = lut
    return lut


def _decode_lut(codec) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int64).remainder_(1 << codec.bits).view(1, 256)
    spec = kernel_spec(codec)
    if spec.kind == KernelKind.UNIFORM:
        unit = torch.tensor([[[0.0], [1.0], [1.0]]])
    else:
        unit = torch.ones(1, spec.dec_params, 1)
    return codec._dequantize(codes, unit).reshape(256).to(torch.float32).contiguous()


def decode(
    codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused ``codec.decode_reference(codes, dec_params, numel)``: flat fp32 values, written into ``out``
    (a contiguous CPU fp32 tensor of ``numel`` elements) when given."""
    c, out = _decode_buffers(codec, codes, numel, out)
    params = dec_params.to(torch.float32).contiguous()
    spec = kernel_spec(codec)
    # one column: a norm codec's plain_decode_params (the (n / k, m) kinds only; uniform needs all three)
    if params.shape[1] != spec.dec_params and not (params.shape[1] == 1 and hasattr(codec, "plain_decode_params")):
        raise ValueError(f"dec_params of shape {tuple(params.shape)} do not match codec {codec!r}")
    lut = decode_lut(codec)
    torch.ops.qcomm.c_decode_codes(c, params, lut, numel, codec.bits, spec.bucket, out)
    return out


def _decode_buffers(
    codec, codes: torch.Tensor, numel: int, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat contiguous codes, fp32 output) of a fused decode of ``numel`` values, both checked."""
    _require()
    need = layout.packed_nbytes(numel, codec.bits)
    c = codes.reshape(-1)
    if c.numel() < need:
        raise ValueError(f"codes has {c.numel()} bytes, {numel} codes of {codec.bits} bits need {need}")
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    else:
        _check_f32("out", out, numel)
    return c.contiguous(), out


def decode_wire(
    codec, codes: torch.Tensor, scales: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused ``codec.decode_reference(codes, codec._decode_params(scales), numel)`` from the wire scales: the
    uniform codec's parameters are made per bucket inside the C kernel (``c_uniform_decode``), the others'
    by ``_fused_decode_params``; ``out`` as for ``decode``."""
    spec = kernel_spec(codec)
    if spec.kind != KernelKind.UNIFORM:
        return decode(codec, codes, _fused_decode_params(codec, scales), numel, out)
    c, out = _decode_buffers(codec, codes, numel, out)
    torch.ops.qcomm.c_uniform_decode.default(c, scales.contiguous(), numel, codec.bits, spec.bucket, out)
    return out


def _stats(x: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
    n = x.numel()
    blen = n if bucket == 0 else min(bucket, n)
    nb = -(-n // blen)
    lo, hi, amax = (torch.empty(nb, dtype=torch.float32) for _ in range(3))
    flags = torch.empty(nb, dtype=torch.uint8)
    torch.ops.qcomm.c_bucket_stats(x, bucket, lo, hi, amax, flags)
    return lo, hi, amax, flags


def _scales(codec, x: torch.Tensor) -> torch.Tensor:
    """The reference's wire scales (``Codec._scales`` then the non-finite-bucket NaN mask), bit for bit,
    from one C pass of per-bucket stats where the codec's scales are exact functions of them
    (``Codec.scale_statistic``):

    - min/max (uniform) and max |x| (qsgdinf, fp8) do not depend on the reduction order, so the codec's
      own ``_scales`` applied to the stats ((lo, hi) rows, or (amax,) rows) gives the reference's bits (a zero
      min or max becomes +0 there, whatever its sign in the stats);
    - L2-norm codecs (qsgd, nuqsgd, sign1): ``_scales`` runs on the bucketed tensor as in the reference (its norm
      is ``qsgd.tree_norm``'s fixed order, in one C pass); only the finiteness pass is fused.
    """
    n = x.numel()
    blen = codec.bucket_len(n)
    nb = -(-n // blen)
    lo, hi, amax, flags = _stats(x, kernel_spec(codec).bucket)
    counts = torch.full((nb,), blen, dtype=torch.float32)
    counts[-1] = n - (nb - 1) * blen
    if codec.scale_statistic == "minmax":
        stat_counts = counts.clone()
        stat_counts[-1] = 2
        scales = codec._scales(torch.stack([lo, hi], dim=1), stat_counts)
    elif codec.scale_statistic == "amax":
        scales = codec._scales(amax[:, None], counts)
    else:
        scales = _per_row_block(
            x, nb, blen, lambda rows, o: codec._scales(rows, counts[o : o + rows.shape[0]].expand(rows.shape[0]))
        )
    finite = (flags & 1).bool()[:, None]
    return torch.where(finite, scales, torch.full_like(scales, float("nan")))


def _per_row_block(x: torch.Tensor, nb: int, blen: int, fn) -> torch.Tensor:
    """``fn(rows, first_bucket)`` over the (buckets, blen) rows of flat ``x``, concatenated: the full buckets
    straight from x, only a short last one zero-padded (the reference pads a copy of all of x), in a two-row
    block that keeps the row reduction on the same (multi-row) kernel as the rest; its first row is kept."""
    n = x.numel()
    if nb * blen == n:
        return fn(x.view(nb, blen), 0)
    full = nb - 1
    tail = torch.zeros(2, blen, dtype=x.dtype)
    tail[0, : n - full * blen] = x[full * blen :]
    last = fn(tail, full)[:1]
    return torch.cat([fn(x[: full * blen].view(full, blen), 0), last]) if full else last


def _plain_scales_params(codec, x: torch.Tensor, out_max: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(wire scales, encode params) of contiguous fp32 ``x`` for an L2-norm codec whose every bucket is plain
    (its first-pass norm in ``codec.plain_norm_range``: see ``_NormCodec.plain_norm_range``), else None.

    Ordinary gradients are plain, and then the general path's finiteness pass and its few dozen small ops
    on per-bucket tensors change nothing: a finite norm means finite elements, and the scales and params are
    ``codec.plain_scales_params`` of the norms. The norms are the general path's first pass, row for row (the
    same reductions as ``_scales``'s L2 branch), so the result is the reference's bit for bit; one host read
    of the norms' min and max decides (CPU only)."""
    if codec.scale_statistic is not None or not hasattr(codec, "plain_norm_range") or not scaling.may_branch_on(x):
        return None
    n = x.numel()
    blen = codec.bucket_len(n)
    nb = -(-n // blen)
    norm = _per_row_block(x, nb, blen, lambda rows, o: tree_norm(rows))
    lo, hi = codec.plain_norm_range(blen, out_max)
    ends = torch.aminmax(norm)
    if not (lo <= float(ends.min) and float(ends.max) <= hi):  # NaN: neither holds
        return None
    counts = torch.full((nb,), blen, dtype=torch.float32)
    counts[-1] = n - (nb - 1) * blen
    return codec.plain_scales_params(norm, counts)


def encode_packed(
    codec, xf: torch.Tensor, seed: int, out_max: float = FLT_MAX, out: torch.Tensor | None = None, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``Codec.encode`` body: (packed codes, wire scales) of flat fp32 ``xf``, bit-identical to
    the reference's (``out_max``: see ``Codec._encode_params``); ``out``, ``offset``: see ``encode``."""
    _require()
    x = xf.reshape(-1).to(torch.float32).contiguous()
    spec = kernel_spec(codec)
    if spec.kind == KernelKind.UNIFORM:  # stats, scales, params and codes in one call
        n = x.numel()
        nb = codec.num_buckets(n)
        scales = torch.empty(nb, 2, dtype=torch.float32)
        params = torch.empty(nb, 3, dtype=torch.float32)
        if out is None:
            out = torch.empty(layout.packed_nbytes(n, codec.bits), dtype=torch.uint8)
        k1, k2 = rng.seed_to_key(seed)
        if torch.ops.qcomm.c_uniform_encode.default(x, k1, k2, *_c_spec_args(codec), scales, params, out, offset):
            return out, scales
        # a signed zero whose sign torch's reduction order decides, or a pre-scaled bucket: general path
    plain = _plain_scales_params(codec, x, out_max)
    if plain is not None:
        scales, params = plain
    else:
        scales = _scales(codec, x)
        params = codec._encode_params(scales, out_max)
    return encode(codec, x, params, seed, out, offset), scales.contiguous()


# ------------------------------------------------------------------ checks
def _check_f32(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(
            f"{name} must be a contiguous CPU fp32 tensor of >= {numel} elements, got "
            f"{t.dtype} {t.device.type} {tuple(t.shape)} contiguous={t.is_contiguous()}"
        )
