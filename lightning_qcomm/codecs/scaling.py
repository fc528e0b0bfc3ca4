"""Power-of-two pre-scaling of the buckets at the ends of fp32's range (docs/design.md, "Codecs").

A bucket is *flagged* when one of the per-bucket parameters its codec would use leaves fp32's normal range
[FLT_MIN, FLT_MAX]: a range or norm that overflows (``hi - lo``, ``||x||_2`` of values near FLT_MAX), a
reciprocal that is subnormal (flushed to 0 under ``torch.set_flush_denormal``), a unit, norm or block scale
that is subnormal (buckets of subnormals: few significant bits, and ``1 / unit`` overflows). A flagged bucket
is quantized as ``x * sigma`` with an exact power of two

    sigma = 2^-64  ("wide": the parameters overflow)     or     sigma = 2^64  ("tiny": they are subnormal)

and decoded as ``value(code) * m`` with ``m = 1 / sigma``; its scaled parameters are normal fp32 numbers. The
wire format does not change: the scale that is otherwise non-negative (uniform's unit, the norm codecs' norm,
fp8's block scale) travels as ``-(scale * sigma)``. Its sign bit is the flag and its magnitude gives the
direction: a wide scale is >= 2^30 once scaled, a tiny one < 2^-48, so ``|wire| < 1`` means tiny.

Every other bucket has sigma = m = 1 (exact), so its codes and decoded bits are those of the unscaled
formulas. NaN scales (buckets with non-finite elements) are never flagged.

Example::

    >>> wire = torch.tensor([0.5, -(2.0**-100 * 2.0**64), -(1e38 * 2.0**-64)])  # plain, tiny, wide
    >>> mag, sigma, m = unflag(wire)
    >>> (mag * m).tolist()  # the unscaled scales
    [0.5, 7.888609052210118e-31, 9.999999680285692e+37]
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny  # smallest normal fp32, 2^-126
WIDE_SIGMA = 2.0**-64
TINY_SIGMA = 2.0**64


def unflag(wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(magnitude, sigma, m) of flagged-or-plain fp32 wire scales: ``sigma`` multiplies x before
    quantizing, ``m = 1 / sigma`` the decoded values; both 1 for a plain (or NaN) scale."""
    flagged = wire < 0
    mag = wire.abs()
    tiny = mag < 1
    one = torch.ones_like(wire)
    sigma = torch.where(flagged, torch.where(tiny, one * TINY_SIGMA, one * WIDE_SIGMA), one)
    m = torch.where(flagged, torch.where(tiny, one * (1 / TINY_SIGMA), one * (1 / WIDE_SIGMA)), one)
    return mag, sigma, m


def sigma64(wide: torch.Tensor, tiny: torch.Tensor) -> torch.Tensor:
    """fp64 sigma per bucket from the two (disjoint) flags."""
    one = torch.ones(wide.shape, dtype=torch.float64, device=wide.device)
    return torch.where(wide, one * WIDE_SIGMA, torch.where(tiny, one * TINY_SIGMA, one))


def flagged(plain: torch.Tensor, scaled64: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Wire scales: ``plain`` (fp32) where not flagged, ``-scaled64`` rounded to fp32 where flagged."""
    return torch.where(flag, -scaled64.to(torch.float32), plain)


def round_down(v64: torch.Tensor) -> torch.Tensor:
    """The largest fp32 <= v64 for non-negative fp64 ``v64`` (torch's cast rounds to nearest)."""
    f = v64.to(torch.float32)
    return torch.where(f.double() > v64, torch.nextafter(f, torch.zeros_like(f)), f)


def output_max(dtype: torch.dtype) -> float:
    """Largest finite value of a decode cast to ``dtype``: the codecs compute in fp32, so FLT_MAX for fp32 and
    fp64, the dtype's own maximum for fp16 / bf16 (a decoded value above it would cast to inf)."""
    return min(FLT_MAX, torch.finfo(dtype).max)
