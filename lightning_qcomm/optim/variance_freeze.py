"""The variance freeze of 1-bit Adam on the optimizer state (docs/design.md, "1-bit Adam", "Freeze").

``freeze_variance`` replaces v by its bias-corrected value v̂ = v / (1-β2^t) in place (held from then on
in ``state["exp_avg_sq"]``); ``relative_variance_change`` is the auto-freeze measure
r = ‖v̂_t - v̂_ref‖₂ / ‖v̂_t‖₂ over all parameters, on this rank (the caller takes the max over ranks), and
moves the reference on (v̂_ref <- v̂_t). A non-finite or empty variance gives r = 1: it never counts as stable.
``auto_freeze_count`` counts the consecutive checks with r < τ and says when ``auto_freeze_patience`` is reached.

Example::

    r = relative_variance_change(opt.param_groups, opt.state)   # 1.0 the first time (no reference yet)
    if r < 0.05:
        freeze_variance(opt.param_groups, opt.state)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch


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


__all__ = ["auto_freeze_count", "freeze_variance", "relative_variance_change"]
