"""1-bit sign compression (1-bit Adam's compressor C).

    C(x) = (||x||_2 / sqrt(d)) * sign(x),   sign(0) = +1

per bucket of d real elements (one bucket = the whole tensor when ``bucket_size`` is None). Codes are
1 for x < 0, packed 8 per byte; the scale is one fp32 per bucket. Deterministic and biased: use it
with error feedback (``comm.onebit_all_reduce``).
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.qsgd import l2_norm_rows


class SignCodec(Codec):
    name = "sign1"
    scales_per_bucket = 1
    stochastic = False
    min_bits = 1
    max_bits = 1

    def __init__(self, bits: int = 1, bucket_size: int | None = None) -> None:
        super().__init__(bits, bucket_size)

    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return (l2_norm_rows(xb) / counts.sqrt())[:, None]

    def _encode_params(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        return (x < 0).to(torch.int64)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return (1.0 - 2.0 * codes.to(torch.float32)) * params[:, 0]
