"""The per-site width plan of the activation quantizer: budget calibration across ranks and the plan's
checkpoint state (memory adapters).

A *site* is one quantized save, numbered in forward order; the plan lists each site's width
(``bit_allocation``). Before a plan exists every site is stored at ``CALIBRATION_BITS``. The budget policy
accumulates per site n_l (elements) and A_l = G_l · V_l (``bit_allocation`` module doc) while it
calibrates; ``agreed_budget_plan`` turns them into the same plan on every rank. A saved plan is used only
for the policy and widths it was made for.

Example::

    plan = agreed_budget_plan(calibration, config, reduce=sum_over_ranks)   # same list on every rank
    state = plan_state_dict(plan, config)
    assert plan_from_state(state, config, warn=print) == plan
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_qcomm.memory import bit_allocation as alloc
from lightning_qcomm.memory.config import ActivationQuantConfig

CALIBRATION_BITS = 8
STATE_VERSION = 2


@dataclass
class _SiteCalibration:
    numel: int = 0
    coef: float = 0.0  # accumulated A_l = G_l · V_l (bit_allocation module doc)


@dataclass
class _Watch:
    site: int
    kind: str
    numel: int  # elements of the quantized saved tensor (n_l)
    var_sum: float  # V_l of this save
    r2: float = 1.0


# kinds whose output gradient is read element by element (bit_allocation.output_grad_energy)
ELEMENTWISE_KINDS = frozenset({"gelu", "silu", "elementwise", "dropout"})


def watch_output(
    calibration: list[_SiteCalibration], y: torch.Tensor, watches: list[_Watch], on_nonfinite: Callable[[], None]
) -> None:
    """On y's gradient g, add ``alloc.site_coefficient`` (G·r²·V) to each watched site of ``calibration``
    (grown to hold them); a non-finite g (fp16 overflow) adds nothing and calls ``on_nonfinite``."""
    if not isinstance(y, torch.Tensor) or not y.requires_grad or not watches:
        return
    for w in watches:
        while len(calibration) <= w.site:
            calibration.append(_SiteCalibration())
        calibration[w.site].numel = max(calibration[w.site].numel, w.numel)
    elementwise = watches[0].kind in ELEMENTWISE_KINDS

    def on_grad(g: torch.Tensor) -> None:
        energy = alloc.output_grad_energy(g, elementwise=elementwise)
        if not math.isfinite(energy):
            on_nonfinite()
            return
        for w in watches:
            calibration[w.site].coef += alloc.site_coefficient(energy, w.r2, w.var_sum)

    y.register_hook(on_grad)


def agreed_budget_plan(
    calibration: list[_SiteCalibration],
    cfg: ActivationQuantConfig,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """The budget plan from the calibration statistics, the same on every rank.

    ``reduce`` sums a float64 tensor over ranks. Every rank must have measured the same number of sites
    (checked first, with one reduce of [1, n, n²]: Σn² · ranks = (Σn)² iff all n are equal, so every rank
    raises the same ``ValueError`` instead of hanging in a mismatched collective); then numels and
    coefficients are summed, so every rank computes the same plan (for the summed, i.e. mean, sizes).
    """
    n = len(calibration)
    numels = [float(c.numel) for c in calibration]
    coefs = [c.coef for c in calibration]
    if reduce is not None:
        ranks, total, total_sq = reduce(torch.tensor([1.0, n, n * n], dtype=torch.float64)).tolist()
        if total_sq * ranks != total * total:
            raise ValueError(
                f"budget calibration: the ranks measured different numbers of quantized sites (this rank {n}, "
                f"mean {total / ranks:g} over {ranks:g} ranks); the sites of a forward must not depend on the "
                "batch (e.g. a variable sequence length crossing min_numel): fix the shapes, raise min_numel, "
                "or use policy='layer_aware' or 'uniform'"
            )
        summed = reduce(torch.tensor(numels + coefs, dtype=torch.float64)).tolist()
        numels, coefs = summed[:n], summed[n:]
    return alloc.budget_plan([int(v) for v in numels], coefs, cfg.bits, cfg.budget_bits)


def plan_state_dict(plan: list[int] | None, cfg: ActivationQuantConfig) -> dict:
    """The plan with the policy and widths it was made for."""
    return {
        "version": STATE_VERSION,
        "plan": None if plan is None else list(plan),
        "policy": cfg.policy,
        "bits": cfg.bits,
        "edge_bits": cfg.edge_bits,
        "budget_bits": cfg.budget_bits,
    }


def plan_from_state(state: dict, cfg: ActivationQuantConfig, warn: Callable[..., None]) -> list[int] | None:
    """The saved plan if it was made for this policy and these widths; otherwise (or from a version-1 state,
    which did not record them) None after ``warn(...)``, and the policy calibrates anew. Widths outside 1..8
    or an unknown version raise ``ValueError``."""
    version = state.get("version", 1)
    if version not in (1, STATE_VERSION):
        raise ValueError(f"ActivationQuantizer state version={version!r} is not supported; allowed: 1, {STATE_VERSION}")
    plan = state.get("plan")
    if plan is not None and not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 8 for b in plan):
        raise ValueError(f"ActivationQuantizer state plan={plan!r} has widths outside the allowed 1..8")
    if plan is None or cfg.policy == "uniform":
        return None
    made_for = {k: state.get(k) for k in ("policy", "bits", "edge_bits", "budget_bits")}
    wanted = {"policy": cfg.policy, "bits": cfg.bits}
    wanted.update({"edge_bits": cfg.edge_bits} if cfg.policy == "layer_aware" else {"budget_bits": cfg.budget_bits})
    if version == 1 or any(made_for[k] != v for k, v in wanted.items()):
        warn(
            "ActivationQuantizer: the checkpoint's plan was made for %s, not %s; it is discarded and the %s "
            "policy calibrates again",
            "an unrecorded policy (state version 1)" if version == 1 else made_for,
            wanted,
            cfg.policy,
        )
        return None
    return list(plan)


__all__ = ["CALIBRATION_BITS", "STATE_VERSION", "agreed_budget_plan", "plan_from_state", "plan_state_dict"]
