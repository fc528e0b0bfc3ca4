"""FP8 blockwise quantization (AGoQ's gradient storage and FP8 all-reduce), e4m3 and e5m2.

Per block: s = amax / fmax (fmax 448 for e4m3, 57344 for e5m2); v = x / s, so ``|v| <= fmax``; the code
is v rounded onto the fp8 grid, stored as the fp8 bit pattern; decode = fp8(code) * s.

Rounding, with ``e = max(floor(log2|v|), emin)`` and spacing q = 2^(e - mantissa_bits) (exact powers of
two, read from the exponent bits): ``t = |v| / q``, f = floor(t), d = t - f, then::

    nearest:     f + [d > 1/2 or (d == 1/2 and f odd)]   (round half to even, as torch's cast)
    stochastic:  f + [u < d]                              (unbiased: E = t)

The bit pattern is assembled with integer arithmetic, identically in the Triton kernel.

Extreme blocks (``codecs.scaling``): a subnormal s (amax < fmax * 2^-126) travels flagged as -(s * 2^64), from
fp64; then v = (x 2^64) / s_s and decode = fp8(code) * s_s * 2^-64. An s whose largest decode fmax * s
rounds past FLT_MAX (amax at FLT_MAX) is lowered by one ulp, which keeps fmax * s <= amax.
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import KernelKind, KernelSpec
from lightning_qcomm.codecs.qsgd import exp2_int, float_exponent
from lightning_qcomm.codecs.registry import register_codec

FP8_FORMATS = {
    # name: (torch dtype, mantissa bits, exponent bias, max finite)
    "e4m3": (torch.float8_e4m3fn, 3, 7, 448.0),
    "e5m2": (torch.float8_e5m2, 2, 15, 57344.0),
}
ROUNDINGS = ("nearest", "stochastic")


# Decorators apply bottom-up: e4m3 is registered first (the order of CODEC_NAMES).
@register_codec("fp8_e5m2", bits=range(8, 9), options={"rounding": ROUNDINGS}, kernels=True, fmt="e5m2")
@register_codec("fp8_e4m3", bits=range(8, 9), options={"rounding": ROUNDINGS}, kernels=True, fmt="e4m3")
class FP8Codec(Codec):
    scales_per_bucket = 1
    scale_statistic = "amax"

    def __init__(
        self, bits: int = 8, bucket_size: int | None = 512, fmt: str = "e4m3", rounding: str = "nearest"
    ) -> None:
        if fmt not in FP8_FORMATS:
            raise ValueError(f"fmt must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.name = f"fp8_{fmt}"
        super().__init__(bits, bucket_size)
        self.fmt = fmt
        self.rounding = rounding
        self.stochastic = rounding == "stochastic"
        self.torch_dtype, self.mbits, self.bias, self.fmax = FP8_FORMATS[fmt]
        self.emin = 1 - self.bias

    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        amax = xb.abs().amax(dim=1)
        s = amax / self.fmax
        s = torch.where(torch.isfinite(self.fmax * s) | ~torch.isfinite(s), s, torch.nextafter(s, torch.zeros_like(s)))
        a64 = amax.double()
        tiny = (a64 > 0) & (a64 < self.fmax * scaling.FLT_MIN)
        return scaling.flagged(s, a64 / self.fmax, torch.zeros_like(tiny), tiny)[:, None]

    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        s, sigma, _ = scaling.unflag(scales[:, 0])
        inv = torch.where(s > 0, 1.0 / s, torch.where(torch.isfinite(s), torch.zeros_like(s), s))
        return torch.stack([sigma, inv], dim=1)

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        s, _, m = scaling.unflag(scales[:, 0])
        return torch.stack([s, m], dim=1)

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        a = torch.nan_to_num(x.abs() * params[:, 0] * params[:, 1], nan=0.0).clamp_(0.0, self.fmax)
        # Integer work in int32 (exponents, significands < 2^5): the same values as int64, half the bytes.
        e = float_exponent(a, torch.int32).clamp_(min=self.emin)
        t = a * exp2_int(self.mbits - e)  # |v| / spacing, exact
        f = torch.floor(t)
        d = t - f
        fi = f.to(torch.int32)
        if u is None:
            odd = (fi & 1) == 1
            up = (d > 0.5) | ((d == 0.5) & odd)
        else:
            up = u < d
        m = fi + up.to(torch.int32)  # significand in units of the spacing
        # Normal numbers have m in [2^mbits, 2^(mbits+1)]; m == 2^(mbits+1) carried into the next binade.
        carry = m >> (self.mbits + 1)
        m = m >> carry
        e = e + carry
        normal = m >= (1 << self.mbits)
        exp_field = torch.where(normal, e + self.bias, torch.zeros_like(e))
        mant = torch.where(normal, m - (1 << self.mbits), m)
        sign = (x < 0).to(torch.int64) << 7
        return sign | (exp_field << self.mbits) | mant

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        v = codes.to(torch.uint8).view(self.torch_dtype).to(torch.float32)
        return v * params[:, 0] * params[:, 1]

    @classmethod
    def op_options(cls, stochastic: bool) -> dict[str, object]:
        return {"rounding": "stochastic" if stochastic else "nearest"}

    def kernel_spec(self) -> KernelSpec:
        consts = {"mbits": self.mbits, "bias": self.bias, "emin": self.emin, "fmax": self.fmax}
        return self._spec(KernelKind.FP8, 2, 2, fp8_e4m3fn=self.fmt == "e4m3", **consts)
