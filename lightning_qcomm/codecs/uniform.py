"""Uniform min-max stochastic rounding (QSDP weights and gradients), 1..8 bits.

Per bucket: lo = min, hi = max, unit = (hi - lo) / (2^b - 1). With u ~ U[0, 1):

    code = clamp(floor((x - lo) * (1/unit) + u), 0, 2^b - 1),    decode = lo + code * unit

floor(t + u) is t rounded up with probability frac(t), so E[decode] = x (unbiased), and
``|decode - x| < unit``. A constant bucket (hi == lo) has unit 0 and decodes exactly to lo.
Wire: 2 fp32 scales (lo, unit) per bucket.

Extreme buckets (``codecs.scaling``): a range that overflows fp32 (hi - lo, or the decode's top value
lo + (2^b - 1) unit, past FLT_MAX; or 1/unit subnormal) or a subnormal unit (a bucket of subnormals, or of
normal values whose differences are subnormal) is quantized as x * sigma with wire (lo * sigma, -unit * sigma):

    code = clamp(floor((x sigma - lo_s) * (1/unit_s) + u), 0, 2^b - 1),    decode = (lo_s + code * unit_s) * m

sigma = m = 1 elsewhere. lo_s and unit_s are computed in fp64 and rounded once; a wide bucket's unit_s is
rounded down from (hi_s - lo_s) / ((2^b - 1)(1 + 2^-23)), so lo_s + fl(L unit_s) <= hi_s <= FLT_MAX * 2^-64 and
no code decodes past FLT_MAX (the shrink moves the grid by 2^-23 of the range, within fp32 rounding).
"""

from __future__ import annotations

import torch

from lightning_qcomm._checks import check_bool
from lightning_qcomm.codecs import scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import KernelKind, KernelSpec
from lightning_qcomm.codecs.registry import register_codec


@register_codec("uniform", bits=range(1, 9), options={"stochastic": (True, False)}, kernels=True)
class UniformCodec(Codec):
    name = "uniform"
    scales_per_bucket = 2
    scale_statistic = "minmax"

    def __init__(self, bits: int = 8, bucket_size: int | None = 512, stochastic: bool = True) -> None:
        super().__init__(bits, bucket_size)
        self.stochastic = check_bool("UniformCodec", "stochastic", stochastic)

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Only the last bucket can hold zero padding: reduce all rows in one pass, then redo the last one
        # over its real elements.
        lo, hi = torch.aminmax(xb, dim=1)
        valid = torch.arange(xb.shape[1], device=xb.device) < counts[-1]
        last = xb[-1]
        lo[-1] = torch.where(valid, last, torch.full_like(last, float("inf"))).amin()
        hi[-1] = torch.where(valid, last, torch.full_like(last, float("-inf"))).amax()
        return self._wire_scales(lo, hi)

    def _wire_scales(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """(nb, 2) wire scales (lo, unit) of buckets with min ``lo`` and max ``hi``, flagged where extreme. A zero
        min or max is +0.0 (``+ 0.0``): which of +0.0 and -0.0 a reduction returns depends on its order, which
        differs between the torch reference, the C and the Triton kernels."""
        lo, hi = lo + 0.0, hi + 0.0
        L = self.levels
        unit = (hi - lo) / L
        top = lo + L * unit  # the decode of the largest code, in the decode's own fp32 operations
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        wide = finite & (~torch.isfinite(top) | (unit > 2.0**126))  # overflow, or 1/unit subnormal
        tiny = (hi > lo) & (unit < scaling.FLT_MIN)
        special = wide | tiny
        if scaling.none_needed(special):
            return torch.stack([lo, unit], dim=1)
        sigma = scaling.sigma64(wide, tiny)
        lo64 = lo.double()
        unit_s = (hi.double() - lo64) * sigma / L
        unit_s = torch.where(wide, scaling.round_down(unit_s / (1 + 2.0**-23)), unit_s.to(torch.float32))
        lo_s = torch.where(special, (lo64 * sigma).to(torch.float32), lo)
        return torch.stack([lo_s, torch.where(special, -unit_s, unit)], dim=1)

    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        lo = scales[:, 0]
        unit, sigma, _ = scaling.unflag(scales[:, 1])
        inv = torch.where(unit > 0, 1.0 / unit, torch.zeros_like(unit))
        inv = torch.where(torch.isfinite(unit), inv, unit)  # keep NaN buckets NaN
        return torch.stack([sigma, lo, inv], dim=1)

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        if scaling.none_needed(scales[:, 1] < 0):  # no bucket flagged: (lo, unit, m = 1), in one op
            return torch.nn.functional.pad(scales, (0, 1), value=1.0)
        unit, _, m = scaling.unflag(scales[:, 1])
        return torch.stack([scales[:, 0], unit, m], dim=1)

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        t = (x * params[:, 0] - params[:, 1]) * params[:, 2]
        t = t + u if u is not None else t + 0.5
        t = torch.nan_to_num(t, nan=0.0)
        return torch.floor(t).clamp_(0, self.levels).to(torch.int64)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return (params[:, 0] + codes.to(torch.float32) * params[:, 1]) * params[:, 2]

    @classmethod
    def op_options(cls, stochastic: bool) -> dict[str, object]:
        return {"stochastic": stochastic}

    def kernel_spec(self) -> KernelSpec:
        return self._spec(KernelKind.UNIFORM, 3, 3, levels=self.levels)
