"""The non-finite gradient policy shared by the strategies and OneBitAdam (comm layer): skip, raise or propagate.

A NaN or Inf in one rank's gradient reaches every rank through the gradient collective (the codecs decode
a non-finite bucket as NaN, never as finite garbage), and an optimizer step then writes NaN into the
weights of every rank. The strategies check the gradients the optimizer is about to apply, after their own
synchronisation and before the step:

* ``"skip"`` (default): the step is skipped (every gradient of the optimizer is set to None, so torch's
  optimizers leave parameters and state alone, as a skipped ``GradScaler`` step does), counted in
  ``skipped`` and logged. Where the checked gradients are identical on all ranks (DDP-style strategies
  after their all-reduce) every rank reaches the same decision by itself; where they differ (QSDP's
  gradient shards) the ranks agree through ``agree`` (one small all-reduce per step).
* ``"raise"``: ``FloatingPointError`` on every rank, naming the step and the first parameters concerned.
* ``"propagate"``: no check; torch's behaviour.

Under a loss scaler (fp16 ``GradScaler``) the scaler already skips steps with non-finite gradients and
lowers its scale; the guard stands aside then (setting gradients to None would hide the overflow from it).

Example::

    guard = NonFiniteGuard("skip", "QuantDDPStrategy")
    closure = guard.wrap(closure, optimizer, step=trainer.global_step)   # before the optimizer step runs it
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

log = logging.getLogger(__name__)

NONFINITE_POLICIES = ("skip", "raise", "propagate")


def check_policy(owner: str, value: Any) -> str:
    """``value`` if it is one of ``NONFINITE_POLICIES``; TypeError/ValueError naming it otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}(nonfinite={value!r}) must be a str; allowed: {', '.join(NONFINITE_POLICIES)}")
    if value not in NONFINITE_POLICIES:
        raise ValueError(f"{owner}(nonfinite={value!r}) is not allowed; allowed: {', '.join(NONFINITE_POLICIES)}")
    return value


def _params_with_grad(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    opt = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps the torch one
    return [p for g in opt.param_groups for p in g["params"] if p.grad is not None]


def nonfinite_params(params: list[torch.nn.Parameter]) -> list[int]:
    """Indices of the parameters whose gradient holds a NaN or Inf (one host sync for all of them)."""
    live, flags = _nonfinite_flags(params)
    if flags is None:
        return []
    # One device-to-host copy of the flags, then the indices on the host: the step's one sync, as GradScaler's
    # found-inf check is (nonfinite="propagate" makes none).
    return [live[i] for i in flags.cpu().nonzero().reshape(-1).tolist()]


def _nonfinite_flags(params: list[torch.nn.Parameter]) -> tuple[list[int], torch.Tensor | None]:
    """(indices of the parameters with a non-empty gradient, a device bool tensor: that gradient holds a NaN/Inf)."""
    # max |g| (the inf-norm) is NaN/Inf iff an element is and cannot overflow (a sum or the 2-norm of finite values
    # can); one multi-tensor reduction for all of them (a fused launch per group of tensors on CUDA), |g| taken
    # inside the reduction, no temporary
    local = [_local(p.grad.detach()) for p in params]
    live = [i for i, g in enumerate(local) if g.numel()]
    if not live:
        return live, None
    return live, ~_max_abs([local[i] for i in live]).isfinite()


def _max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |t| of every tensor (non-empty), stacked on the first one's device: one ``_foreach_norm`` per device."""
    device = tensors[0].device
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) == 1:
        return torch.stack(torch._foreach_norm(tensors, float("inf")))
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in by_device.values():
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], float("inf"))):
            out[i] = n.to(device)
    return torch.stack(out)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (max |t| per tensor, one host sync for all)."""
    live = [t for t in tensors if t.numel()]
    if not live:
        return True
    return bool(_max_abs(live).isfinite().all())


def _local(g: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a sharded DTensor's local shard (a reduction over the DTensor itself
    would be a collective per parameter). Read as the DTensor's local tensor, not through ``to_local()``,
    which builds an autograd node per call: the gradients are data here, never differentiated."""
    local = getattr(g, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(g, "to_local", None)
    return to_local() if callable(to_local) else g


class NonFiniteGuard:
    """The policy of one strategy. ``agree(flag) -> flag's max over the ranks`` when ranks check different
    gradients (None: the checked gradients are the same on every rank): ``flag`` is a one-element fp64 tensor,
    1.0 where this rank saw a non-finite gradient; ``agree`` returns a tensor (``comm.agree.max_over_ranks_tensor``:
    one all-reduce, no host read), so the local flags and the agreed verdict reach the host in one copy."""

    def __init__(self, policy: str, owner: str, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.policy = check_policy(owner, policy)
        self.owner = owner
        self.agree = agree
        self.skipped = 0
        self.scope = "on every rank"  # where a skip happens; Local SGD's local steps skip on one rank

    def should_step(self, params: list[torch.nn.Parameter], step: int) -> bool:
        """Check ``params``' gradients: True to apply the step; False after a skip (counted, logged); raises
        under ``"raise"``. Always True under ``"propagate"``. One device-to-host copy."""
        if self.policy == "propagate":
            return True
        if self.agree is None:
            bad = nonfinite_params(params)
            finite = not bad
        else:
            bad, finite = self._agreed(params)
        shapes = [tuple(params[i].shape) for i in bad[:4]]
        return self.verdict(finite, step, f"local parameters of shapes {shapes}" if bad else "another rank's gradients")

    def _agreed(self, params: list[torch.nn.Parameter]) -> tuple[list[int], bool]:
        """(this rank's non-finite parameters, whether every rank's gradients are finite): the local flags and the
        agreed verdict in one device-to-host copy (``agree`` returning its argument: no collective was needed)."""
        live, flags = _nonfinite_flags(params)
        local = torch.zeros(1, dtype=torch.float64) if flags is None else flags.any().reshape(1).double()
        agreed = self.agree(local)
        if agreed is local:  # nothing to agree on (one rank, or gradients the same everywhere): the flags alone
            bad = [] if flags is None else [live[i] for i in flags.cpu().nonzero().reshape(-1).tolist()]
            return bad, not bad
        both = agreed if flags is None else torch.cat([flags.double(), agreed.to(flags.device)])
        found = both.cpu().nonzero().reshape(-1).tolist()  # the one device-to-host copy; the verdict is last
        return [live[i] for i in found if i < len(live)], len(both) - 1 not in found

    def verdict(self, finite: bool, step: int, where: str) -> bool:
        """Apply the policy to a decision already the same on every rank (``where``: what was non-finite, for the
        message): True to apply the step; False after a skip (counted, logged); raises under ``"raise"``."""
        if finite or self.policy == "propagate":
            return True
        if self.policy == "raise":
            raise FloatingPointError(
                f"{self.owner}: non-finite gradient at optimizer step {step} ({where}); nonfinite='raise' "
                f"(allowed: {', '.join(NONFINITE_POLICIES)})"
            )
        self.skipped += 1
        log.warning(
            "%s: non-finite gradient at optimizer step %d (%s): step skipped %s (%d so far; nonfinite='skip')",
            self.owner,
            step,
            where,
            self.scope,
            self.skipped,
        )
        return False

    def wrap(
        self, closure: Callable[[], Any], optimizer: Optimizer, step: int, scaler: Any = None
    ) -> Callable[[], Any]:
        """``closure`` followed by the check, to hand to the optimizer step in its place: a skipped step sets
        every gradient of ``optimizer`` to None, so the step that runs the closure changes nothing."""
        if self.policy == "propagate" or scaler is not None:
            return closure

        def guarded() -> Any:
            out = closure()
            self.apply(optimizer, step)
            return out

        return guarded

    def apply(self, optimizer: Optimizer, step: int) -> bool:
        """Check ``optimizer``'s gradients now (after backward, before its step): False after a skip, which set
        every gradient to None so the step that follows changes nothing. For callers without a closure (Fabric,
        an optimizer step pre-hook)."""
        if self.policy == "propagate":
            return True
        params = _params_with_grad(optimizer)
        if self.should_step(params, step):
            return True
        for p in params:
            p.grad = None
        return False

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped = int(state.get("skipped", 0))


__all__ = ["NONFINITE_POLICIES", "NonFiniteGuard", "all_finite", "check_policy", "nonfinite_params"]
