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

from __future__ import annotations

import torch

from lightning_qcomm.codecs import scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import KernelKind, KernelSpec
from lightning_qcomm.codecs.qsgd import l2_norm_rows64, redo_floor
from lightning_qcomm.codecs.registry import register_codec


@register_codec("sign1", bits=range(1, 2), bucket_size=None, family="sign", kernels=True)
class SignCodec(Codec):
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
