"""Synchronization rules for Local SGD: how many local optimizer steps H to take before the next average.

Pure Python, no torch and no processes, so the schedule can be unit-tested and simulated (see
``benchmarks/qsr_schedule.py``). A rule maps (completed optimizer steps t, current learning rate η)
to a period H >= 1; ``SyncSchedule`` applies a rule round by round and holds the counters a Lightning
strategy checkpoints.

Rules:

* ``ConstantRule(period)``: H = period (Local SGD / Local AdamW with a fixed period).
* ``PostLocalRule(switch_step, period)``: H = 1 for t < switch_step (data-parallel phase), then
  H = period (Lin et al., "Don't use large mini-batches, use local SGD", 2020).
* ``QSRRule(h_base, alpha, power, warmup_steps, max_period)``: the Quadratic Synchronization Rule (Gu et al.,
  ICLR 2024), H = max(h_base, floor((alpha / η)^power)) with power 2; power 1 gives the linear and
  power 3 the cubic variant the paper compares against. H = h_base while t < warmup_steps (lr warmup);
  H <= max_period when one is set. The rule's H at a learning rate η is (α/η)², so α = η·√H gives period H
  at η: the paper's α = 0.0175 means H ≈ 4.8 at its peak lr 8e-3 but H = 306 at AdamW's 1e-3 and 3,402 at
  3e-4 (``qsr_alpha_for``).

Every rule's H is finally capped by the steps left, H <= total_steps - t, so training ends on a sync
(``cap_period``). The rule is evaluated once per round, when the round starts, exactly like the QSR
reference code (average -> lr scheduler step -> ``adjust_h``): the lr it reads is the one the first
step of the new round uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

SYNC_RULE_NAMES = ("qsr", "constant", "post_local")
QSR_LONG_PERIOD = 100
"""A QSR period above this many steps (with no ``max_period``) is warned about once: Local SGD studies average
every 2 to a few dozen steps, and hundreds of steps between averages usually mean ``alpha`` was tuned for a
larger (SGD-scale) learning rate than the one in use."""

# Larger than any step count a run can have; returned by QSR when lr == 0 (H is then set by the cap).
_UNBOUNDED_PERIOD = 2**62


@runtime_checkable
class SyncRule(Protocol):
    """Maps (completed optimizer steps, current lr) to the next period H >= 1 (before the cap)."""

    needs_lr: bool

    def next_period(self, step: int, lr: float | None) -> int: ...

    def data_parallel(self, step: int) -> bool:
        """True when the round starting at ``step`` is a data-parallel (gradient all-reduce) step."""
        ...


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float > 0, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {value}")
    return float(value)


@dataclass(frozen=True)
class ConstantRule:
    """H = period at every round."""

    period: int
    needs_lr = False

    def __post_init__(self) -> None:
        _check_int("period", self.period, 1)

    def next_period(self, step: int, lr: float | None = None) -> int:
        return self.period

    def data_parallel(self, step: int) -> bool:
        return False


@dataclass(frozen=True)
class PostLocalRule:
    """H = 1 (data-parallel: gradients are all-reduced every step) for t < switch_step, then H = period."""

    switch_step: int
    period: int
    needs_lr = False

    def __post_init__(self) -> None:
        _check_int("switch_step", self.switch_step, 0)
        _check_int("period", self.period, 1)

    def next_period(self, step: int, lr: float | None = None) -> int:
        return 1 if step < self.switch_step else self.period

    def data_parallel(self, step: int) -> bool:
        return step < self.switch_step


@dataclass(frozen=True)
class QSRRule:
    """Quadratic Synchronization Rule: H = max(h_base, floor((alpha / lr)^power)); h_base during warmup.

    ``lr == 0`` gives an unbounded H (the steps-left cap then ends training on one last sync).
    """

    h_base: int = 4
    alpha: float = 0.0175
    power: float = 2.0
    warmup_steps: int = 0
    max_period: int | None = None
    needs_lr = True

    def __post_init__(self) -> None:
        _check_int("h_base", self.h_base, 1)
        _check_positive_float("alpha", self.alpha)
        _check_positive_float("power", self.power)
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.max_period is not None:
            _check_int("max_period", self.max_period, self.h_base)

    def uncapped_period(self, lr: float) -> int:
        """max(h_base, floor((alpha / lr)^power)) at ``lr`` > 0, before ``max_period`` and the steps-left cap."""
        ratio = (self.alpha / lr) ** self.power
        return max(self.h_base, math.floor(ratio) if ratio < _UNBOUNDED_PERIOD else _UNBOUNDED_PERIOD)

    def next_period(self, step: int, lr: float | None) -> int:
        if step < self.warmup_steps:
            return self.h_base
        if lr is None:
            raise ValueError("lr is required by the QSR rule (sync='qsr'), got None")
        lr = float(lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be a finite float >= 0 for the QSR rule, got {lr}")
        h = _UNBOUNDED_PERIOD if lr == 0.0 else self.uncapped_period(lr)
        return h if self.max_period is None else min(h, self.max_period)

    def data_parallel(self, step: int) -> bool:
        return False


def make_rule(
    sync: str,
    *,
    h_base: int = 4,
    alpha: float = 0.0175,
    power: float = 2.0,
    period: int = 8,
    switch_step: int | None = None,
    warmup_steps: int = 0,
    max_period: int | None = None,
) -> SyncRule:
    """Build the rule named ``sync`` (one of ``SYNC_RULE_NAMES``) from typed primitives."""
    if not isinstance(sync, str) or sync.lower() not in SYNC_RULE_NAMES:
        raise ValueError(f"sync must be one of {SYNC_RULE_NAMES}, got {sync!r}")
    sync = sync.lower()
    if sync == "qsr":
        return QSRRule(h_base=h_base, alpha=alpha, power=power, warmup_steps=warmup_steps, max_period=max_period)
    if sync == "constant":
        return ConstantRule(period)
    if switch_step is None:
        raise ValueError("switch_step is required for sync='post_local' (the step where local SGD starts), got None")
    return PostLocalRule(switch_step, period)


def cap_period(h: int, step: int, total_steps: int | float | None) -> int:
    """min(h, total_steps - step), at least 1; no cap when total_steps is None or infinite."""
    if total_steps is not None and math.isfinite(total_steps):
        left = int(total_steps) - int(step)
        if left >= 1:
            h = min(h, left)
    return max(1, int(h))


@dataclass
class SyncSchedule:
    """Round-by-round application of a rule; the counters are what a resume needs.

    Protocol per optimizer step: ``begin_step(lr)`` (evaluates H if a round starts here) -> the
    optimizer step -> ``end_step()`` (True when this step closes the round: average now).

    State: ``step`` (completed optimizer steps), ``h`` (current round's period, None = the next step
    starts a round), ``steps_since_sync``, ``num_syncs``, ``last_sync_step`` (``step`` value at the
    last sync, 0 before the first one).
    """

    rule: SyncRule
    total_steps: int | float | None = None
    step: int = 0
    h: int | None = None
    steps_since_sync: int = 0
    num_syncs: int = 0
    last_sync_step: int = 0
    round_data_parallel: bool = field(default=False)

    def begin_step(self, lr: float | None = None) -> int:
        """Start a round if none is open: H = cap(rule(step, lr)). Returns the current H."""
        if self.h is None:
            self.h = cap_period(self.rule.next_period(self.step, lr), self.step, self.total_steps)
            self.round_data_parallel = self.rule.data_parallel(self.step)
        return self.h

    def end_step(self) -> bool:
        """Count one completed optimizer step; True if the round is complete (the caller syncs)."""
        if self.h is None:
            raise RuntimeError("end_step() called before begin_step()")
        self.step += 1
        self.steps_since_sync += 1
        if self.steps_since_sync < self.h:
            return False
        self.num_syncs += 1
        self.last_sync_step = self.step
        self.steps_since_sync = 0
        self.h = None
        return True

    def state_dict(self) -> dict[str, int | bool | None]:
        return {
            "step": self.step,
            "h": self.h,
            "steps_since_sync": self.steps_since_sync,
            "num_syncs": self.num_syncs,
            "last_sync_step": self.last_sync_step,
            "round_data_parallel": self.round_data_parallel,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.h = None if state["h"] is None else int(state["h"])
        self.steps_since_sync = int(state["steps_since_sync"])
        self.num_syncs = int(state["num_syncs"])
        self.last_sync_step = int(state["last_sync_step"])
        self.round_data_parallel = bool(state.get("round_data_parallel", False))


def simulate(rule: SyncRule, total_steps: int, lr_at, start_step: int = 0) -> list[tuple[int, int]]:
    """Run a schedule over ``total_steps`` with ``lr_at(step) -> lr`` (the lr step ``step`` uses).

    Returns [(step at which the round started, H)] for every round; the syncs happen at
    start + H. Pure: used by tests and ``benchmarks/qsr_schedule.py``.
    """
    sched = SyncSchedule(rule, total_steps=total_steps, step=start_step)
    rounds: list[tuple[int, int]] = []
    while sched.step < total_steps:
        start = sched.step
        h = sched.begin_step(lr_at(start) if rule.needs_lr else None)
        rounds.append((start, h))
        while not sched.end_step():
            pass
    return rounds


def qsr_alpha_for(period: int, lr: float, power: float = 2.0) -> float:
    """The QSR ``alpha`` that gives period ``period`` at learning rate ``lr``: alpha = lr * period^(1/power).

    Example::

        qsr_alpha_for(8, 1e-3)     # 0.00283: H = 8 at AdamW's lr 1e-3 (the default 0.0175 gives H = 306 there)
    """
    return float(lr) * float(period) ** (1.0 / power)


def tell_qsr_period(owner: str, rule: QSRRule, schedule: SyncSchedule, lr: float, told: bool) -> bool:
    """Say once, when the QSR rule first reads the learning rate after its warmup, which period it gives there,
    and warn when that period reaches the end of the run (the replicas would be averaged only at the end) or
    exceeds ``QSR_LONG_PERIOD`` without a ``max_period``; with the ``alpha`` that gives a short period at this lr.
    Returns the new ``told``. Call it right after ``schedule.begin_step(lr)``.

    Example::

        told = tell_qsr_period("LocalSGD", rule, schedule, lr=1e-3, told=False)
    """
    start = schedule.step
    if start == 0 and schedule.h is not None and schedule.h > rule.h_base:
        rank_zero_warn(
            f"{owner}(sync='qsr') starts with H={schedule.h} from lr={lr:g} at step 0 (warmup_steps="
            f"{rule.warmup_steps}); if the lr schedule warms up from a small lr, set warmup_steps to "
            f"its length so H stays at h_base={rule.h_base} meanwhile"
        )
    if told or start < rule.warmup_steps or not lr > 0:
        return told
    h, raw = rule.next_period(start, lr), rule.uncapped_period(lr)
    bound = f"; max_period={rule.max_period} bounds it to {h}" if h < raw else ""
    rank_zero_info(
        f"{owner}(sync='qsr'): H = max(h_base, (alpha / lr)^{rule.power:g}) = {raw} steps at lr={lr:g}, "
        f"alpha={rule.alpha:g}{bound}"
    )
    total = schedule.total_steps
    left = int(total) - start if total is not None and math.isfinite(total) else None
    if (left is not None and h >= left) or (rule.max_period is None and h > QSR_LONG_PERIOD):
        where = (
            f"reaches the end of the run ({left} steps left): the replicas are averaged only at the end"
            if (left is not None and h >= left)
            else f"is longer than {QSR_LONG_PERIOD} steps"
        )
        rank_zero_warn(
            f"{owner}(sync='qsr', alpha={rule.alpha:g}): the period the rule gives at lr={lr:g}, H={h}, {where}. "
            f"H = (alpha / lr)^{rule.power:g}: alpha={qsr_alpha_for(8, lr, rule.power):.3g} gives H=8 at this lr "
            f"(alpha = lr * H^(1/{rule.power:g})); or set max_period"
        )
    return True


def check_optimizers_have_lr(optimizers: Sequence[Optimizer], sync: str) -> None:
    """A rule that reads the lr needs a numeric ``lr`` in every param group (ValueError naming the group)."""
    if not optimizers:
        raise ValueError(f"sync={sync!r} reads the learning rate of the optimizer, but there is no optimizer")
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            lr = group.get("lr")
            try:
                float(lr)
            except (TypeError, ValueError):
                raise ValueError(
                    f"sync={sync!r} sets H from the learning rate, but optimizer {i} ({type(opt).__name__}) "
                    f"param_groups[{j}] has lr={lr!r}; it needs a numeric 'lr' (or use sync='constant')"
                ) from None
