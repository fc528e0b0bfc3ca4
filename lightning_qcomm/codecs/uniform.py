"""Uniform min-max stochastic rounding (QSDP weights and gradients), 1..8 bits.

Per bucket: lo = min, hi = max, unit = (hi - lo) / (2^b - 1). With u ~ U[0, 1):

    code = clamp(floor((x - lo) * (1/unit) + u), 0, 2^b - 1),    decode = lo + code * unit

floor(t + u) is t rounded up with probability frac(t), so E[decode] = x (unbiased), and
``|decode - x| < unit``. A constant bucket (hi == lo) has unit 0 and decodes exactly to lo.
Wire: 2 fp32 scales (lo, unit) per bucket.
"""

from __future__ import annotations

import torch

from lightning_qcomm._checks import check_bool
from lightning_qcomm.codecs.base import Codec


class UniformCodec(Codec):
    name = "uniform"
    scales_per_bucket = 2
    min_bits = 1
    max_bits = 8

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
        unit = (hi - lo) / self.levels
        return torch.stack([lo, unit], dim=1)

    def _encode_params(self, scales: torch.Tensor) -> torch.Tensor:
        lo, unit = scales[:, 0], scales[:, 1]
        inv = torch.where(unit > 0, 1.0 / unit, torch.zeros_like(unit))
        inv = torch.where(torch.isfinite(unit), inv, unit)  # keep NaN buckets NaN
        return torch.stack([lo, inv], dim=1)

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        t = (x - params[:, 0]) * params[:, 1]
        t = t + u if u is not None else t + 0.5
        t = torch.nan_to_num(t, nan=0.0)
        return torch.floor(t).clamp_(0, self.levels).to(torch.int64)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return params[:, 0] + codes.to(torch.float32) * params[:, 1]

    def kernel_config(self) -> dict:
        return {"LEVELS": self.levels, "STOCHASTIC": self.stochastic}
