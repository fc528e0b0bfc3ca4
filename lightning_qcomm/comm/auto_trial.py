"""Auto widths by trial: ``QuantDDPConfig(codec="auto")`` and ``QSDPConfig(weight_bits="auto", grad_bits="auto")``
time a few optimizer steps at each candidate width and keep the fastest (comm layer; docs/design.md, "Auto widths").

A cost model cannot see what decides the choice on a fast link (DDP's overlap, FSDP2's prefetch, the codec's work
sharing the core with backward), so the trial measures whole steps. From step ``start`` each candidate (32 first,
then the widths down to ``min_bits``) runs ``warm_steps + measured_steps`` steps; a step's duration is the time
between the ends of consecutive steps; a candidate's figure is the minimum over its measured steps; the ranks agree
on the elementwise maximum of the figures (one all-reduce), and ``choose_measured`` takes the widest candidate
within ``tolerance`` of the fastest. After ``recheck_steps`` (0: never) the trial runs again.

Invariants: the width of step s depends only on s and the agreed figures, so every rank runs the same width;
``choose_measured`` is deterministic; the trial's state is checkpointed, so a resumed run keeps the choice.

Example::

    trial = WidthTrial((32, 8, 4))
    for step in range(steps):
        bits = trial.width(step)                 # what this step's all-reduce uses
        ...                                      # forward, backward, optimizer
        trial.step_done(step, agree)             # agree: comm.agree.max_over_ranks_each over the group
    trial.chosen                                  # 32, 8 or 4, the same on every rank
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from lightning_utilities.core.rank_zero import rank_zero_info

log = logging.getLogger(__name__)

TOLERANCE = 0.02  # a compressed width must be measured > 2% faster than the next wider one to be chosen
TRIAL_STEPS = 3  # timed steps per candidate width
RECHECK_STEPS = 2000  # steps at the choice before the trial runs again
UNCOMPRESSED = 32
WIDTHS = (8, 4, 2)
AUTO_CODEC = "uniform"  # QuantDDP's: min-max stochastic rounding, unbiased, contractive, the fastest fused CPU path


def candidate_widths(min_bits: int) -> tuple[int, ...]:
    """32 and the widths of ``WIDTHS`` at or above ``min_bits``, widest first: the trial's order.

    Example::

        candidate_widths(4)   # (32, 8, 4)
    """
    if not isinstance(min_bits, int) or isinstance(min_bits, bool) or min_bits not in WIDTHS:
        raise ValueError(f"min_bits={min_bits!r} is not allowed; allowed: {', '.join(map(str, sorted(WIDTHS)))}")
    return (UNCOMPRESSED, *(b for b in WIDTHS if b >= min_bits))


def choose_measured(seconds: Mapping[int, float], tolerance: float = TOLERANCE) -> int:
    """The widest width whose measured step time is within ``tolerance`` of the fastest one.

    Example::

        choose_measured({32: 0.100, 8: 0.099, 4: 0.120})   # 32: 8-bit is only 1% faster
        choose_measured({32: 0.300, 8: 0.150, 4: 0.120})   # 4
    """
    if not seconds:
        raise ValueError("seconds={} is empty; it needs one step time per candidate width")
    best = min(seconds.values())
    return max(b for b, t in seconds.items() if t <= best * (1.0 + tolerance))


class WidthTrial:
    """The trial schedule and its decision (see the module docstring).

    Args:
        candidates: the widths to try, in trial order (32 = no compression). One candidate: chosen at once.
        measured_steps: timed steps per candidate (their minimum is its figure).
        warm_steps: untimed first steps per candidate.
        recheck_steps: steps at the choice before the trial runs again (0: never).
        start: the first step of the first trial.
        tolerance: ``choose_measured``'s.
        owner: the name the log line uses.
        clock: seconds, monotonic (None: ``time.perf_counter``; injectable for tests).
    """

    def __init__(
        self,
        candidates: Sequence[int],
        measured_steps: int = TRIAL_STEPS,
        warm_steps: int = 1,
        recheck_steps: int = RECHECK_STEPS,
        start: int = 0,
        tolerance: float = TOLERANCE,
        owner: str = "auto",
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("candidates=() is empty; it needs at least one width")
        if measured_steps < 1 or warm_steps < 0 or recheck_steps < 0:
            raise ValueError(
                f"measured_steps={measured_steps}, warm_steps={warm_steps}, recheck_steps={recheck_steps}: "
                "measured_steps must be >= 1, the others >= 0"
            )
        self.candidates = tuple(candidates)
        self.measured_steps = measured_steps
        self.warm_steps = warm_steps
        self.recheck_steps = recheck_steps
        self.tolerance = tolerance
        self.owner = owner
        self.clock = clock
        self.start = start  # first step of the running (or next) trial
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None
        self.decided_at: int | None = start if self.chosen is not None else None
        self.figures: dict[int, float] = {}  # the agreed figures of the last trial
        self._times: dict[int, list[float]] = {b: [] for b in self.candidates}
        self._last_end: float | None = None

    @property
    def steps_per_candidate(self) -> int:
        return self.warm_steps + self.measured_steps

    def trialing(self, step: int) -> bool:
        """Whether ``step`` is part of a running trial."""
        return self.chosen is None and step >= self.start

    def width(self, step: int) -> int:
        """The width step ``step`` runs: its candidate during a trial, else the choice (before the first trial:
        the first candidate)."""
        if self.chosen is not None:
            return self.chosen
        if step < self.start:
            return self.candidates[0]
        index = min((step - self.start) // self.steps_per_candidate, len(self.candidates) - 1)
        return self.candidates[index]

    def step_done(self, step: int, agree: Callable[[list[float]], list[float]]) -> None:
        """Record the end of optimizer step ``step``; at a trial's last step decide (``agree`` is collective: it is
        called on every rank at the same step), and start the re-check trial when it is due."""
        now = (self.clock or time.perf_counter)()
        if self.trialing(step):
            index, pos = divmod(step - self.start, self.steps_per_candidate)
            if pos >= self.warm_steps and self._last_end is not None:
                self._times[self.candidates[index]].append(now - self._last_end)
            if step - self.start == len(self.candidates) * self.steps_per_candidate - 1:
                self._decide(step, agree)
        elif self.chosen is not None and self.recheck_steps and len(self.candidates) > 1:
            if step + 1 - self.decided_at >= self.recheck_steps:
                self.start, self.chosen, self.decided_at = step + 1, None, None
                self._times = {b: [] for b in self.candidates}
        self._last_end = now

    def _decide(self, step: int, agree: Callable[[list[float]], list[float]]) -> None:
        mine = [min(self._times[b]) for b in self.candidates]
        agreed = agree(mine)
        self.figures = dict(zip(self.candidates, (float(t) for t in agreed)))
        self.chosen = choose_measured(self.figures, self.tolerance)
        self.decided_at = step + 1
        rank_zero_info(f"{self.owner}: {self.describe()}")

    def describe(self) -> str:
        """One log line: the choice and the figures it was made from."""
        times = ", ".join(f"{b} bits {t * 1e3:.1f} ms" for b, t in self.figures.items())
        return (
            f"auto chose {self.chosen} bits at step {self.decided_at} from measured step times "
            f"(the slowest rank's minimum over {self.measured_steps} steps each): {times}"
        )

    def restart_clock(self) -> None:
        """Forget the last step's end (a new stage or fit begins): the next step is not timed across the gap."""
        self._last_end = None

    def state_dict(self) -> dict:
        return {
            "chosen": self.chosen,
            "decided_at": self.decided_at,
            "start": self.start,
            "figures": {str(b): t for b, t in self.figures.items()},
        }

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Continue a saved trial's choice; without one (a checkpoint of a fixed width, of a trial still running, or
        None: one made on another world size or topology), start a new trial at ``step``."""
        self._times = {b: [] for b in self.candidates}
        self._last_end = None
        chosen = None if state is None else state.get("chosen")
        if len(self.candidates) == 1:
            chosen = self.candidates[0]  # nothing to try
        elif chosen is None or int(chosen) not in self.candidates:
            self.start, self.chosen, self.decided_at, self.figures = step, None, None, {}
            return
        state = state or {}
        self.chosen, self.decided_at = int(chosen), int(state.get("decided_at", step))
        self.start = int(state.get("start", self.decided_at))
        self.figures = {int(b): float(t) for b, t in state.get("figures", {}).items()}


__all__ = [
    "AUTO_CODEC",
    "RECHECK_STEPS",
    "TOLERANCE",
    "TRIAL_STEPS",
    "UNCOMPRESSED",
    "WIDTHS",
    "WidthTrial",
    "candidate_widths",
    "choose_measured",
]
