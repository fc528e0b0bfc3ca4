"""OneBitAdam's checkpoint state (optim layer; docs/design.md, "1-bit Adam", "State").

``OneBitAdamCheckpoint`` is the part of ``optim.OneBitAdam`` that saves and restores: torch's optimizer state plus
``"onebit"`` (step count, freeze step, auto-freeze counters), loading plain Adam/AdamW states too, and each rank's
1-bit error buffers and variance-refresh window sums (``rank_state_dict`` / ``load_rank_state_dict``), which differ
per rank. The buffers hold
residuals of the preconditioned momentum u = m / (√v̂ + ε) (``MOMENTUM_SPACE``); buffers saved without that mark
(residuals of the raw momentum, an earlier version) restart at zero, with a warning.

Example::

    torch.save({"opt": opt.state_dict(), "rank": opt.rank_state_dict()}, f"ckpt.rank{rank}.pt")
    opt.load_state_dict(ck["opt"]); opt.load_rank_state_dict(ck["rank"])
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_qcomm.optim.adam_math import moment_dtype
from lightning_qcomm.optim.onebit_adam_config import check_no_amsgrad

log = logging.getLogger("lightning_qcomm.optim.onebit_adam")

MOMENTUM_SPACE = "preconditioned"  # what the error buffers are residuals of


class OneBitAdamCheckpoint:
    """Mixin of ``OneBitAdam``: ``state_dict`` / ``load_state_dict`` and the per-rank error buffers."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"onebit"``: step count, freeze step, auto-freeze counters, config."""
        sd = super().state_dict()
        sd["onebit"] = {
            "num_steps": self.num_steps,
            "frozen_at": self.frozen_at,
            "auto_below": self.auto_below,
            "last_variance_change": self.last_variance_change,
            "freeze_step": self.config.freeze_step,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a OneBitAdam (or torch Adam/AdamW) state; 1-bit error buffers reset unless a rank state follows.

        A state without ``"onebit"`` (plain Adam/AdamW) resumes at the largest per-parameter step count and
        freezes at once if that is already >= ``freeze_step``.
        """
        check_no_amsgrad(state_dict.get("param_groups", []), "OneBitAdam.load_state_dict")
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
        saved_state = state_dict.get("state", {})
        super().load_state_dict(state_dict)  # casts every floating state tensor to its parameter's dtype
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):  # torch's own id -> parameter mapping
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_ref"):
                value = saved_state.get(pid, {}).get(key)
                if value is not None and p in self.state and moment_dtype(p) != p.dtype:
                    self.state[p][key] = value.to(device=p.device, dtype=moment_dtype(p))
        for group in self.param_groups:  # Adam/AdamW groups lack our key; keep their semantics
            group.setdefault("decoupled_weight_decay", False)
        self._overlap.close()  # its launcher belongs to the old layout
        self._sync, self._layout = None, None
        self.variance_refresh.sums = {}  # this rank's window sums come with load_rank_state_dict
        if extra is not None:
            self.num_steps = int(extra["num_steps"])
            self.frozen_at = None if extra["frozen_at"] is None else int(extra["frozen_at"])
            self.auto_below = int(extra["auto_below"])
            self.last_variance_change = extra["last_variance_change"]
        else:
            steps = [int(s["step"].item()) for s in self.state.values() if "step" in s]
            self.num_steps = max(steps, default=0)
            self.frozen_at, self.auto_below, self.last_variance_change = None, 0, None
            if self.num_steps >= self.config.freeze_step:
                self.freeze()

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's 1-bit error buffers (worker and server, per bucket) and variance-refresh window sums
        (``"variance_window"``, one per parameter in param_groups order, None where there is none); CPU copies.
        Save it per rank."""
        window = self.variance_refresh.state_dict(self._all_params())
        if self._sync is None:
            errors = {"worker_error": None} if self._pending_rank_state is None else self._pending_rank_state
        else:
            errors = {**self._sync.rank_state_dict(), "momentum_space": MOMENTUM_SPACE}
        return {**errors, "variance_window": window}

    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's error buffers (from ``rank_state_dict`` on the same rank and layout).

        Applied when the momentum layout exists (now, or at the first compression step); if the layout or
        world size differs (another ``bucket_mb``, other parameters) the buffers restart at zero, with a warning.
        The variance-refresh window sums are restored at once (absent, e.g. saved by an earlier version: zero).
        """
        state = dict(state)
        window = state.pop("variance_window", None)
        self.variance_refresh.sums = {}
        if window is not None:
            try:
                self.variance_refresh.load_state_dict(self._all_params(), window)
            except ValueError as err:
                log.warning("OneBitAdam: %s; the variance-refresh window restarts at zero", err)
        if state.get("worker_error") is None:
            self._pending_rank_state = None
            return
        if self._sync is None:
            self._pending_rank_state = state
            return
        self._load_rank_state(state)

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        assert self._sync is not None and self._layout is not None
        if state.get("momentum_space") != MOMENTUM_SPACE:
            log.warning(
                "OneBitAdam: the saved 1-bit error buffers are residuals of the raw momentum (saved by an earlier "
                "version), not of the preconditioned one this version averages; they restart at zero"
            )
            self._sync.worker_error = self._sync.server_error = None  # zeros at the next sync
            return
        try:
            self._sync.load_rank_state_dict(state)
        except ValueError as err:  # e.g. another bucket_mb: the residuals do not fit this layout
            log.warning("OneBitAdam: %s; the 1-bit error buffers restart at zero", err)
            return
        self._sync.to(self._layout[0].device)


__all__ = ["MOMENTUM_SPACE", "OneBitAdamCheckpoint"]
