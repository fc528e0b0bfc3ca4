"""The variance freeze of 1-bit Adam on the optimizer state (docs/design.md, "1-bit Adam", "Freeze").

``freeze_variance`` replaces v by its bias-corrected value v̂ = v / (1-β2^t) in place (held from then on
in ``state["exp_avg_sq"]``); ``relative_variance_change`` is the auto-freeze measure
r = ‖v̂_t - v̂_ref‖₂ / ‖v̂_t‖₂ over all parameters, on this rank (the caller takes the max over ranks), and
moves the reference on (v̂_ref <- v̂_t). A non-finite or empty variance gives r = 1: it never counts as stable.
``auto_freeze_count`` counts the consecutive checks with r < τ and says when ``auto_freeze_patience`` is reached.

At the freeze, ``tracked_variance_change`` gives r against the last reference (None without one) and
``unusable_fraction`` the share of coordinates with √v̂ <= ε, which the compression phase leaves where they are
(``adam_math.frozen_weight``); ``warn_if_unstable`` warns once when r >= τ (``auto_freeze_threshold``, or
``UNSTABLE_CHANGE`` = 0.1 when auto-freeze is off): the variance still moved by more than that over the last
``auto_freeze_interval`` steps, so the warm-up was likely too short (docs/design.md, "1-bit Adam", "Freeze").

Example::

    r = relative_variance_change(opt.param_groups, opt.state)   # 1.0 the first time (no reference yet)
    if r < 0.05:
        freeze_variance(opt.param_groups, opt.state)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

UNSTABLE_CHANGE = 0.1  # r at or above this at the freeze: warned (when auto-freeze, its threshold, is off)
_warned: list[bool] = []


def _states_with_variance(param_groups: Iterable[dict], state: Mapping) -> Iterable[tuple[float, dict[str, Any]]]:
    """(β2, state) of every parameter that has a variance, in param_groups order."""
    for group in param_groups:
        beta2 = group["betas"][1]
        for p in group["params"]:
            st = state.get(p)
            if st and "exp_avg_sq" in st:
                yield beta2, st


def relative_variance_change(param_groups: Iterable[dict], state: Mapping) -> float:
    """r = ||v̂ - v̂_ref|| / ||v̂|| over all parameters of this rank; v̂_ref <- v̂."""
    diff2 = torch.zeros((), dtype=torch.float64)
    norm2 = torch.zeros((), dtype=torch.float64)
    for beta2, st in _states_with_variance(param_groups, state):
        vhat = st["exp_avg_sq"] / (1 - beta2 ** st["step"].item())
        ref = st.get("exp_avg_sq_ref")
        diff2 += (vhat - (ref if ref is not None else 0.0)).double().pow(2).sum().cpu()
        norm2 += vhat.double().pow(2).sum().cpu()
        st["exp_avg_sq_ref"] = vhat
    r = float((diff2 / norm2).sqrt()) if norm2 > 0 else 1.0
    if not math.isfinite(r):
        r = 1.0  # a non-finite variance never counts as stable
    return r


def tracked_variance_change(param_groups: Iterable[dict], state: Mapping) -> float | None:
    """``relative_variance_change`` if every parameter with a variance has a reference (``exp_avg_sq_ref``), else
    None (no reference was taken: nothing to compare)."""
    states = [st for _, st in _states_with_variance(param_groups, state)]
    if not states or any("exp_avg_sq_ref" not in st for st in states):
        return None
    return relative_variance_change(param_groups, state)


def unusable_fraction(param_groups: Iterable[dict], state: Mapping) -> float:
    """Share of the coordinates with a frozen variance whose √v̂ <= ε (their group's eps): they had no gradient, or
    one below ε, in the whole warm-up (call after ``freeze_variance``: v̂ is in ``exp_avg_sq``)."""
    bad = total = 0
    for group in param_groups:
        for p in group["params"]:
            st = state.get(p)
            if st and "exp_avg_sq" in st:
                bad += int((st["exp_avg_sq"].sqrt() <= group["eps"]).sum())
                total += st["exp_avg_sq"].numel()
    return bad / total if total else 0.0


def warn_if_unstable(r: float | None, threshold: float | None, unusable: float, step: int) -> bool:
    """Warn (once per process) when the variance change r at the freeze is >= ``threshold`` (None: ``UNSTABLE_CHANGE``);
    returns whether it is."""
    tau = UNSTABLE_CHANGE if threshold is None else threshold
    if r is None or r < tau:
        return False
    if not _warned:
        _warned.append(True)
        log.warning(
            "OneBitAdam: the variance froze after %d warm-up steps while still changing: r = ||v̂_t - v̂_(t-k)|| / "
            "||v̂_t|| = %.3f >= %.3f over the last auto_freeze_interval steps; %.1f%% of the coordinates had no "
            "gradient above eps and stay where they are. A longer warm-up (freeze_step) or auto_freeze_threshold "
            "gives 1-bit Adam a settled variance",
            step,
            r,
            tau,
            100 * unusable,
        )
    return True


def freeze_variance(param_groups: Iterable[dict], state: Mapping) -> None:
    """v <- v̂ = v / (1-β2^t) in place for every parameter with a variance; the auto-freeze reference is dropped."""
    for beta2, st in _states_with_variance(param_groups, state):
        st["exp_avg_sq"].div_(1 - beta2 ** st["step"].item())
        st.pop("exp_avg_sq_ref", None)


def auto_freeze_count(config: Any, below: int, r: float) -> tuple[int, bool]:
    """(consecutive checks with r < τ after this one, whether that reaches the patience) for an auto-freeze check
    with measure ``r``; ``config`` has ``auto_freeze_threshold`` (τ) and ``auto_freeze_patience``."""
    below = below + 1 if r < config.auto_freeze_threshold else 0
    return below, below >= config.auto_freeze_patience


__all__ = [
    "UNSTABLE_CHANGE",
    "auto_freeze_count",
    "freeze_variance",
    "relative_variance_change",
    "tracked_variance_change",
    "unusable_fraction",
    "warn_if_unstable",
]
