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


def may_branch_on(t: torch.Tensor) -> bool:
    """Whether the codec layer may branch on the values of ``t`` on the host: only on the CPU, where reading a
    value waits for nothing. On an accelerator each data-dependent branch becomes a select (both sides
    computed), so encode and decode queue without a host sync; the results are the same either way."""
    return t.device.type == "cpu" and _HOST_BRANCHES


_HOST_BRANCHES = True  # tests set it False to run the accelerator form on CPU tensors


def none_needed(mask: torch.Tensor) -> bool:
    """True when no bucket of ``mask`` needs the pre-scaling and skipping its per-bucket ops is free: on CPU
    this data-dependent branch only reads host memory, so ordinary tensors skip a few dozen small ops; on an
    accelerator it is False without looking (the ops run branch-free, no host sync). Either way the
    parameters are the same: sigma = m = 1 and the full level range for every bucket not flagged."""
    return may_branch_on(mask) and not bool(mask.any())


def unflag(wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(magnitude, sigma, m) of flagged-or-plain fp32 wire scales: ``sigma`` multiplies x before
    quantizing, ``m = 1 / sigma`` the decoded values; both 1 for a plain (or NaN) scale."""
    flagged = wire < 0
    if none_needed(flagged):
        one = torch.ones_like(wire)
        return wire, one, one
    mag = wire.abs()
    sigma = torch.full_like(wire, WIDE_SIGMA).masked_fill_(mag < 1, TINY_SIGMA).masked_fill_(~flagged, 1.0)
    return mag, sigma, sigma.reciprocal()  # exact: powers of two


def sigma64(wide: torch.Tensor, tiny: torch.Tensor) -> torch.Tensor:
    """fp64 sigma per bucket from the two (disjoint) flags."""
    one = torch.ones(wide.shape, dtype=torch.float64, device=wide.device)
    return one.masked_fill_(wide, WIDE_SIGMA).masked_fill_(tiny, TINY_SIGMA)


def flagged(plain: torch.Tensor, value64: torch.Tensor, wide: torch.Tensor, tiny: torch.Tensor) -> torch.Tensor:
    """Wire scales: ``plain`` (fp32) where not flagged, ``-(value64 * sigma)`` rounded once to fp32 where
    ``wide`` (sigma = 2^-64) or ``tiny`` (sigma = 2^64)."""
    flag = wide | tiny
    if none_needed(flag):
        return plain
    return torch.where(flag, -(value64 * sigma64(wide, tiny)).to(torch.float32), plain)


def round_down(v64: torch.Tensor) -> torch.Tensor:
    """The largest fp32 <= v64 for non-negative fp64 ``v64`` (torch's cast rounds to nearest)."""
    f = v64.to(torch.float32)
    return torch.where(f.double() > v64, torch.nextafter(f, torch.zeros_like(f)), f)


def output_max(dtype: torch.dtype) -> float:
    """Largest finite value of a decode cast to ``dtype``: the codecs compute in fp32, so FLT_MAX for fp32 and
    fp64, the dtype's own maximum for fp16 / bf16 (a decoded value above it would cast to inf)."""
    return min(FLT_MAX, torch.finfo(dtype).max)
