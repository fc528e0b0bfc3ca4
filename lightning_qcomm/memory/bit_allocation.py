"""Bit-width policies for quantized activations: one width per *site*, a quantized save in forward order (memory
layer; docs/design.md, "Activation quantization").

* ``uniform``: every site at ``bits``.
* ``layer_aware``: the first and the last quantized save of the forward get ``edge_bits`` (8), every other site
  ``bits`` (AGoQ's layer-aware rule for one model; attention stays exact under every policy).
* ``budget``: widths from ``widths_for(bits)`` chosen to minimise the estimated gradient error subject to an
  average of at most ``budget_bits`` code bits per quantized element (AGoQ's DBCA, per layer), greedily on the
  marginal error reduction per added bit and element, with the per-site error model::

      E_l(b) = A_l / (2^b - 1)^2,     A_l = G_l · V_l,     V_l = Σ_blocks count_k · range_k² / 6

The measurements of one calibration forward live here too (``output_grad_energy``: G_l; ``norm_r2``;
``site_coefficient``: A_l); a non-finite output gradient gives no coefficient and ``budget_plan`` refuses
non-finite ones. The derivation: docs/design.md, "Module notes".

Example::

    plan = budget_plan(numels, coefficients, bits=4, budget_bits=5.0)   # one width per site
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from lightning_qcomm.codecs import scaling

POLICIES = ("uniform", "layer_aware", "budget")
BUDGET_WIDTHS = (4, 5, 6, 8)


def rounding_variance_sum(scales: torch.Tensor, bits: int, numel: int, block_size: int) -> float:
    """Σ_blocks count · range² / 6 from uniform-codec scales (lo, unit) at ``bits``: V_l of the module doc.

    range = unit · (2^bits - 1), with the unit of a pre-scaled block (the codec's flag for blocks at the ends of
    fp32's range, ``codecs.scaling``) taken back to the block's own units; non-finite blocks contribute nothing
    (their gradient is non-finite anyway).
    """
    magnitude, _sigma, m = scaling.unflag(scales[:, 1])
    rng = magnitude.double() * m.double() * ((1 << bits) - 1)
    counts = torch.full_like(rng, float(block_size))
    counts[-1] = numel - (rng.numel() - 1) * block_size
    terms = counts * rng.square() / 6.0
    return float(torch.where(torch.isfinite(terms), terms, torch.zeros_like(terms)).sum())


def output_grad_energy(g: torch.Tensor, elementwise: bool) -> float:
    """G_l = ‖g‖²_F / rows for the gradient g of a consuming op's output (module doc).

    rows = numel for an element-wise op (and for a 0-d g), numel / last dim otherwise. Non-finite when g holds
    Inf/NaN (the caller skips such a measurement).
    """
    rows = g.numel() if elementwise or g.dim() == 0 else g.numel() // max(g.shape[-1], 1)
    return float(g.detach().double().square().sum()) / max(rows, 1)


def norm_r2(x: torch.Tensor, normalized_ndim: int, eps: float, rms: bool) -> float:
    """Mean over rows of r² = 1/(σ² + eps) (layer norm; σ² the biased variance over the normalized dims) or
    1/(mean x² + eps) (RMS norm): the factor by which a norm's backward scales its input error, squared."""
    with torch.no_grad():
        xf = x.detach().double().flatten(-normalized_ndim)
        second = xf.square().mean(dim=-1) if rms else xf.var(dim=-1, unbiased=False)
        return float((1.0 / (second + eps)).mean())


def site_coefficient(grad_energy: float, r2: float, var_sum: float) -> float:
    """A_l contribution of one calibration forward: G_l · r² · V_l (r² = 1 for non-norm ops)."""
    return grad_energy * r2 * var_sum


def widths_for(bits: int) -> tuple[int, ...]:
    """Budget widths available above the base width ``bits``."""
    return tuple(sorted({bits, *(w for w in BUDGET_WIDTHS if w > bits)}))


def uniform_plan(n_sites: int, bits: int) -> list[int]:
    return [bits] * n_sites


def layer_aware_plan(n_sites: int, bits: int, edge_bits: int) -> list[int]:
    """``bits`` everywhere, ``edge_bits`` on the first and the last site."""
    plan = [bits] * n_sites
    if n_sites:
        plan[0] = plan[-1] = edge_bits
    return plan


def error_at(coef: float, bits: int) -> float:
    """E(b) = coef / (2^b - 1)^2."""
    return coef / float((1 << bits) - 1) ** 2


def budget_plan(numels: Sequence[int], coefs: Sequence[float], bits: int, budget_bits: float) -> list[int]:
    """Widths per site minimising Σ E_l(b_l) subject to Σ n_l b_l <= budget_bits · Σ n_l (greedy).

    Every site starts at ``bits``; the upgrade (to the next width of ``widths_for(bits)``) with the largest
    error reduction per added bit·element is applied while it fits; ties go to the earlier site.
    """
    if len(numels) != len(coefs):
        raise ValueError(f"numels and coefs differ in length: {len(numels)} != {len(coefs)}")
    bad = [i for i, c in enumerate(coefs) if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"coefs must be finite and >= 0; site {bad[0]} has {coefs[bad[0]]!r} ({len(bad)} such sites)")
    widths = widths_for(bits)
    plan = [bits] * len(numels)
    capacity = budget_bits * sum(numels) - bits * sum(numels)
    heap: list[tuple[float, int, int]] = []

    def push(site: int, level: int) -> None:
        if level + 1 < len(widths):
            b0, b1 = widths[level], widths[level + 1]
            cost = numels[site] * (b1 - b0)
            gain = error_at(coefs[site], b0) - error_at(coefs[site], b1)
            if cost > 0 and gain > 0:
                heapq.heappush(heap, (-gain / cost, site, level))

    for site in range(len(numels)):
        push(site, 0)
    while heap:
        _, site, level = heapq.heappop(heap)
        cost = numels[site] * (widths[level + 1] - widths[level])
        if cost <= capacity + 1e-9:
            capacity -= cost
            plan[site] = widths[level + 1]
            push(site, level + 1)
    return plan


def average_bits(numels: Sequence[int], plan: Sequence[int]) -> float:
    """Element-weighted mean code width of a plan."""
    total = sum(numels)
    return sum(n * b for n, b in zip(numels, plan)) / total if total else 0.0
