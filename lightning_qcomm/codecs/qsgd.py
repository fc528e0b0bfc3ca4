"""QSGD, QSGDinf and NUQSGD: norm-scaled sign/magnitude stochastic quantizers, 2..8 bits; sign1 (``SignCodec``).

A b-bit code is a sign bit (bit b-1, set for x < 0) and a (b-1)-bit magnitude index. Per bucket the
only scale on the wire is a norm n (4 bytes). With ``r = |x| / n`` in [0, 1] and u ~ U[0, 1):

QSGD / QSGDinf (Alistarh et al. 2017), ``n = ||x||_2`` or ``||x||_inf``, s = 2^(b-1) - 1 uniform levels::

    l = floor(r s),  level = l + [u < r s - l],   decode = sign * level * n / s
    E[decode] = x;  E||Q(x) - x||^2 <= min(B / s^2, sqrt(B) / s) ||x||^2   (QSGD, bucket length B)

NUQSGD (Ramezani-Kebrya et al. 2019), ``n = ||x||_2``, L = 2^(b-1) levels {0} U {2^-k : k = 0..L-2}::

    l_j <= r < l_{j+1}  ->  round up with probability (r - l_j) / (l_{j+1} - l_j)

The bracketing level comes from r's binary exponent (exact bit arithmetic), and every division is by a
power of two, so the torch reference and the Triton kernel agree bit for bit.

Extreme buckets (``codecs.scaling``): a norm whose encode factor k/n or decode factor n/k (k = s, or 1 for
NUQSGD) leaves fp32's normal range (norms above 2^126, where 1/n is subnormal, or below 2^-126 k) travels
flagged and scaled, ``n_s = n sigma`` (from the fp64 norm, rounded once); then ``r = (|x| sigma) (k / n_s)`` and
decode = level n_s / k * m. Unbiased decoding can exceed the output's largest finite value where n > FLT_MAX
(or the fp16 / bf16 maximum): the encoder caps the level per bucket at the largest one whose decode is at
most that value, which only moves elements within one level gap of it to the level below (the error stays
below one gap).
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import KernelKind, KernelSpec, redo_floor
from lightning_qcomm.codecs.registry import register_codec

# The C kernel's clamp of qsgd's scaled magnitude |x| s / n: above s + 1 (s <= 127), so it changes no level.
_QSGD_CLAMP = 256.0


def float_exponent(r: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """floor(log2 r) for positive normal fp32 r, read from the exponent bits (-127 for 0/subnormal)."""
    return ((r.view(torch.int32) >> 23) & 0xFF).to(dtype) - 127


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32, exactly, for integer e in [-126, 127], built from the exponent bits."""
    return ((e + 127).to(torch.int32) << 23).view(torch.float32)


def tree_norm(xb: torch.Tensor) -> torch.Tensor:
    """fp32 ``||row||_2`` of each row of fp32 ``xb`` in one fixed order, the Triton kernel's: the squares, zero-padded
    to a power-of-two width, are summed pairwise (columns 2i and 2i + 1, level by level), and the square root is
    the correctly rounded one (taken in fp64: exact enough that rounding it to fp32 is). Any device and any
    backend that follows this order gets the same bits (torch's own norm reduces in an order of its choosing).
    The op ``qcomm::tree_norm``: the dispatcher runs the C kernel on CPU (``codecs.cpu``), else the reference."""
    return torch.ops.qcomm.tree_norm(xb)


def tree_norm_reference(xb: torch.Tensor) -> torch.Tensor:
    """``tree_norm`` in torch ops: the reference, and the kernel on every device but the CPU."""
    sq = xb * xb
    width = sq.shape[1]
    pow2 = 1 << max(width - 1, 0).bit_length()
    if pow2 != width:
        sq = torch.nn.functional.pad(sq, (0, pow2 - width))
    while sq.shape[1] > 1:
        sq = sq[:, 0::2] + sq[:, 1::2]
    return sq[:, 0].double().sqrt().to(torch.float32)


def l2_norm_rows64(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32, fp64) ``||row||_2`` of each row of fp32 ``xb``, with no fp32 underflow or overflow of the squares.

    One pass of ``tree_norm`` per row. Rows where that pass may be inaccurate are redone
    as ``amax * ||row / amax||_2``:

    - a sum of squares that overflowed (norm inf or NaN: ``|x| > ~1e19``);
    - a norm below sqrt(n) * 2^-51 (n = row length). Squares under 2^-126 (``|x| < 2^-63``) lose precision
      or flush to zero, at most 2^-126 each, n * 2^-126 in all. That is under 2^-24 of the sum of
      squares exactly when the sum is at least n * 2^-102, i.e. the norm at least sqrt(n) * 2^-51.

    Accepted rows are therefore within fp32 rounding of the exact norm, like the rescaled ones. The fp64
    norm is the fp32 one, except on rescaled rows, where the last product is exact in fp64: finite where
    the fp32 norm overflows, and with all its bits where the fp32 norm is subnormal.
    """
    norm = tree_norm(xb)
    floor = redo_floor(xb.shape[1])
    redo = ~(torch.isfinite(norm) & (norm >= floor))
    norm64 = norm.double()
    if not scaling.may_branch_on(redo):
        # Off the CPU, every row is rescaled and the redo rows picked by a select: no host sync.
        amax = xb.abs().amax(dim=1, keepdim=True)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        unit_norm = tree_norm(xb / amax)
        norm = torch.where(redo, unit_norm * amax[:, 0], norm)
        norm64 = torch.where(redo, unit_norm.double() * amax[:, 0].double(), norm64)
    elif bool(redo.any()):
        rows = redo.nonzero().reshape(-1)
        sub = xb[rows]
        amax = sub.abs().amax(dim=1, keepdim=True)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        unit_norm = tree_norm(sub / amax)
        norm[rows] = unit_norm * amax[:, 0]
        norm64[rows] = unit_norm.double() * amax[:, 0].double()
    return norm, norm64


class _NormCodec(Codec):
    """Shared layout: sign bit + magnitude index, one norm per bucket."""

    scales_per_bucket = 1

    def __init__(self, bits: int = 4, bucket_size: int | None = 512) -> None:
        super().__init__(bits, bucket_size)
        self.sign_bit = 1 << (bits - 1)

    def _norm64(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32, fp64) norm of each row."""
        return l2_norm_rows64(xb)

    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, n64 = self._norm64(xb)
        k = self._divisor
        live = (n64 > 0) & torch.isfinite(n64)
        # torch's k / n is k * (1 / n): subnormal (0 under flush-denormal) once n > 2^126, or n overflows
        wide = live & ((n64 > 2.0**126) | ~torch.isfinite(n))
        tiny = live & (n64 < k * scaling.FLT_MIN)  # n / k subnormal
        return scaling.flagged(n, n64, wide, tiny)[:, None]

    @property
    def _divisor(self) -> int:
        """k of the encode factor k / n and the decode factor n / k."""
        return 1

    @property
    def _top_level(self) -> int:
        """The largest magnitude index."""
        raise NotImplementedError

    def plain_norm_range(self, bucket_len: int, out_max: float = scaling.FLT_MAX) -> tuple[float, float]:
        """[lo, hi]: a bucket whose first-pass fp32 L2 norm n (``tree_norm`` of its row, as
        ``l2_norm_rows64`` starts) lies in it takes none of the special cases of ``_scales`` and
        ``_encode_params``: no redo (n >= ``redo_floor``, finite), no flag (k FLT_MIN <= n <= 2^126), no level
        cap (n <= out_max / 4: the top level decodes to at most n, below half of out_max as ``_level_cap``'s
        test asks). Only for the L2 codecs (``scale_statistic`` None)."""
        lo = max(redo_floor(bucket_len), self._divisor * scaling.FLT_MIN)
        return lo, min(2.0**126, out_max / 4)

    def plain_scales_params(self, n: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wire scales, encode params) of buckets whose first-pass norms ``n`` all lie in
        ``plain_norm_range``: the scale is n itself and the params (sigma, k / n, level cap) are
        (1, k / n, top level), what ``_scales`` and ``_encode_params`` give such buckets, bit for bit."""
        params = torch.stack([torch.ones_like(n), self._divisor / n, torch.full_like(n, self._top_level)], dim=1)
        return n[:, None], params

    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        """(sigma, k / n_s, level cap) per bucket; the cap is the largest level whose decode is <= out_max."""
        n, sigma, m = scaling.unflag(scales[:, 0])
        k = self._divisor
        p = torch.where(n > 0, k / n, torch.where(torch.isfinite(n), torch.zeros_like(n), n))
        return torch.stack([sigma, p, self._level_cap(n / k, m, out_max)], dim=1)

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        n, _, m = scaling.unflag(scales[:, 0])
        return torch.stack([n / self._divisor, m], dim=1)

    def plain_decode_params(self, scales: torch.Tensor) -> torch.Tensor | None:
        """``(n / k)`` alone, one column, when no bucket of ``scales`` is flagged (CPU only; else None): then
        m = 1 and ``value * (n / k) * m`` is ``value * (n / k)`` exactly, which a kernel given one
        parameter column computes."""
        if scaling.none_needed(scales < 0):
            return scales / self._divisor
        return None

    def _level_cap(self, p0: torch.Tensor, m: torch.Tensor, out_max: float) -> torch.Tensor:
        """Largest magnitude index whose decode (with decode factor p0 and multiplier m) is <= out_max."""
        raise NotImplementedError

    def _signed(self, x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 0, magnitude | self.sign_bit, magnitude)

    def _sign_of(self, codes: torch.Tensor) -> torch.Tensor:
        return 1.0 - 2.0 * ((codes & self.sign_bit) != 0).to(torch.float32)


# QSGD's variance bound min(B/s^2, sqrt(B)/s) grows with the bucket B: at 4 bits (s = 7) B = 512 gives 3.2x the
# squared norm and B = 128 gives 1.6x; from 5 bits (s >= 15) B = 512 is already at <= 1.5x. docs/choosing.md.
@register_codec("qsgd", bits=range(2, 9), kernels=True, bucket_size_by_bits={2: 128, 3: 128, 4: 128})
class QSGDCodec(_NormCodec):
    name = "qsgd"

    @property
    def s(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def _divisor(self) -> int:
        return self.s

    @property
    def _top_level(self) -> int:
        return self.s

    def _level_cap(self, p0: torch.Tensor, m: torch.Tensor, out_max: float) -> torch.Tensor:
        """Largest level l <= s with l * p0 * m <= out_max (exact in fp64: then the fp32 decode fl(l p0) m is
        <= out_max too, out_max / m being an fp32 number); s for every bucket of norm below ~out_max."""
        if scaling.none_needed(p0 * m > out_max / (2 * self.s)):  # then s * p0 * m < out_max: cap s
            return torch.full_like(p0, self.s)
        pm = p0.double() * m.double()
        q = torch.floor(out_max / pm).clamp(0, self.s)  # pm == 0: inf -> s; NaN stays NaN
        q = torch.where((q < self.s) & ((q + 1) * pm <= out_max), q + 1, q)  # the fp64 quotient may be one off
        q = torch.where(q * pm > out_max, q - 1, q)
        return q.to(torch.float32)

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        r = torch.nan_to_num(x.abs() * params[:, 0] * params[:, 1], nan=0.0)
        lower = torch.floor(r)
        up = (u < (r - lower)) if u is not None else (r - lower) >= 0.5
        level = torch.minimum((lower + up.to(torch.float32)).clamp_(0, self.s), params[:, 2]).to(torch.int64)
        return self._signed(x, level)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        level = (codes & (self.sign_bit - 1)).to(torch.float32)
        return self._sign_of(codes) * level * params[:, 0] * params[:, 1]

    def kernel_spec(self) -> KernelSpec:
        return self._spec(KernelKind.QSGD, 3, 2, levels=self.s, sign_bit=self.sign_bit, fmax=_QSGD_CLAMP)

    def variance_bound(self, bucket_len: int) -> float:
        """QSGD's bound on E||Q(x)-x||^2 / ||x||^2 for one bucket of length B (L2 norm only)."""
        s = self.s
        return min(bucket_len / s**2, bucket_len**0.5 / s)


@register_codec("qsgdinf", bits=range(2, 9), kernels=True)
class QSGDInfCodec(QSGDCodec):
    name = "qsgdinf"
    scale_statistic = "amax"

    def _norm64(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = xb.abs().amax(dim=1)
        return amax, amax.double()


@register_codec("nuqsgd", bits=range(2, 9), kernels=True)
class NUQSGDCodec(_NormCodec):
    name = "nuqsgd"

    @property
    def num_levels(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def _top_level(self) -> int:
        return self.num_levels - 1

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest nonzero level, 2^-(L-2)."""
        return -(self.num_levels - 2)

    def _level_cap(self, p0: torch.Tensor, m: torch.Tensor, out_max: float) -> torch.Tensor:
        """Largest index i <= L - 1 with 2^(i - (L - 1)) * n * m <= out_max (exact in fp64), or 0."""
        top = self.num_levels - 1
        if scaling.none_needed(p0 * m > out_max / 2):  # then the top level 1 decodes below out_max
            return torch.full_like(p0, top)
        pm = p0.double() * m.double()
        j = torch.floor(torch.log2(out_max / pm)).clamp(-top, 0)  # exponent of the largest level that fits
        j = torch.where(torch.exp2(j) * pm > out_max, j - 1, j)  # log2 rounded across a power of two
        j = torch.where((j < 0) & (torch.exp2(j + 1) * pm <= out_max), j + 1, j)
        return (j + top).clamp(min=0).to(torch.float32)

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        r = torch.nan_to_num(x.abs() * params[:, 0] * params[:, 1], nan=0.0).clamp_(0.0, 1.0)
        emin = self.min_exponent
        e = float_exponent(r)
        below = e < emin  # r in [0, 2^emin): between level 0 and the smallest level
        e_floor = torch.where(below, torch.full_like(e, emin), e).clamp_(max=0)
        # p = (r - l_j) / (l_{j+1} - l_j): every factor is a power of two, so this is exact.
        p = torch.where(below, r * exp2_int(-e_floor), r * exp2_int(-e_floor) - 1.0)
        idx_lower = torch.where(below, torch.zeros_like(e), e_floor - emin + 1)
        up = (u < p) if u is not None else p >= 0.5
        level = (idx_lower + up.to(torch.int64)).clamp_(0, self.num_levels - 1)
        level = torch.minimum(level, params[:, 2].to(torch.int64))
        return self._signed(x, level)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        idx = codes & (self.sign_bit - 1)
        value = torch.where(
            idx > 0, exp2_int((idx - (self.num_levels - 1)).clamp(min=-126)), torch.zeros_like(idx, dtype=torch.float32)
        )
        return self._sign_of(codes) * value * params[:, 0] * params[:, 1]

    def kernel_spec(self) -> KernelSpec:
        consts = {"levels": self.num_levels - 1, "sign_bit": self.sign_bit, "emin": self.min_exponent}
        return self._spec(KernelKind.NUQSGD, 3, 2, **consts)


@register_codec("sign1", bits=range(1, 2), bucket_size=None, family="sign", kernels=True)
class SignCodec(Codec):
    """1-bit sign compression (1-bit Adam's compressor C).

        C(x) = (||x||_2 / sqrt(d)) * sign(x),   sign(0) = +1

    sqrt(d) is taken in fp64 and rounded to fp32, which is the correctly rounded fp32 root (53 >= 2 * 24 + 2 bits:
    the double rounding is innocuous); torch's fp32 ``sqrt`` on CPU is not always that (sqrt(37): one ulp low), and
    the scale must be the same bits on every backend.

    per bucket of d real elements (one bucket = the whole tensor when ``bucket_size`` is None). Codes are
    1 for x < 0, packed 8 per byte; the scale is one fp32 per bucket. Deterministic and biased: use it
    with error feedback (``collectives.onebit_all_reduce``). The scale is never flagged (``codecs.scaling``): it is at
    most ``max |x|``, and computed from the fp64 norm where the fp32 one overflows or is subnormal.
    """

    name = "sign1"
    scales_per_bucket = 1
    stochastic = False

    def __init__(self, bits: int = 1, bucket_size: int | None = None) -> None:
        super().__init__(bits, bucket_size)

    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, n64 = l2_norm_rows64(xb)
        root = counts.double().sqrt()
        scale = n / root.to(torch.float32)
        # Where that fp32 quotient leaves the normal range (n overflows, or a subnormal scale rounded twice), the
        # fp64 norm gives it rounded once; the rms is at most max |x|, so it is finite (clamped to FLT_MAX).
        extreme = (n64 > 0) & torch.isfinite(n64) & ~((scale >= scaling.FLT_MIN) & (scale <= scaling.FLT_MAX))
        rms = (n64 / root).clamp(max=scaling.FLT_MAX).to(torch.float32)
        return torch.where(extreme, rms, scale)[:, None]

    def plain_norm_range(self, bucket_len: int, out_max: float = scaling.FLT_MAX) -> tuple[float, float]:
        """[lo, hi] of the first-pass fp32 norms n with no special case in ``_scales``: no redo (n >=
        ``redo_floor``, finite), and then n / sqrt(count) is a normal fp32 number (at least 2^-51)."""
        return redo_floor(bucket_len), scaling.FLT_MAX

    def plain_scales_params(self, n: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wire scales, encode params) of buckets whose first-pass norms ``n`` lie in ``plain_norm_range``:
        both n / sqrt(count), as ``_scales`` computes them there."""
        scales = (n / counts.double().sqrt().to(torch.float32))[:, None]
        return scales, scales

    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        return scales

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        return (x < 0).to(torch.int64)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return (1.0 - 2.0 * codes.to(torch.float32)) * params[:, 0]

    def kernel_spec(self) -> KernelSpec:
        return self._spec(KernelKind.SIGN, 1, 1)
