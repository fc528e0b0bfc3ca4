"""``NesterovOuterOptimizer``: DiLoCo's outer step at a Local SGD sync (entry-point layer, no collectives).

Local SGD with ``outer_optimizer="nesterov"`` (docs/design.md, "Local SGD across nodes") keeps θ_g, the global
parameters of the last sync (fp32, one copy per trainable parameter), and a momentum buffer b (fp32, zero at the
start). At a scheduled sync, once the replicas have been averaged to θ̄ = mean_r θ_local^(r):

    Δ   = θ_g − θ̄                 (the pseudo-gradient: how far the replicas moved, with a gradient's sign)
    b  <- μ·b + Δ
    θ_g <- θ_g − η·(Δ + μ·b)      (Nesterov SGD, dampening 0, as ``torch.optim.SGD(nesterov=True)``)
    θ_local <- θ_g                 (every replica restarts from the new global parameters)

with η = ``outer_lr`` and μ = ``outer_momentum``. η = 1, μ = 0 gives θ_g = θ̄: plain averaging.

Invariants: θ_g and b are identical on every rank (θ̄ is, and the update is elementwise and deterministic), so a
checkpoint stores one copy and every rank restores it; after a step θ_local = θ_g on every rank. A data-parallel
step (post_local before ``switch_step``) has no pseudo-gradient: ``restart`` takes θ_g from the (common)
parameters and leaves b alone.

Example::

    outer = NesterovOuterOptimizer(params, lr=0.7, momentum=0.9)  # θ_g <- params
    ...                                                            # H local steps, then the replicas' mean
    outer.step()                                                   # the outer step; params <- θ_g
    torch.save(outer.state_dict(), path)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class NesterovOuterOptimizer:
    """DiLoCo's outer Nesterov SGD over ``params`` (see the module docstring).

    Args:
        params: the trainable parameters (the local replica; their number, order and shapes equal on every rank).
        lr: η, > 0.
        momentum: μ, in [0, 1).

    Example::

        outer = NesterovOuterOptimizer(list(model.parameters()), lr=0.7, momentum=0.9)
        outer.step()    # after the parameters were averaged
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float = 0.7, momentum: float = 0.9) -> None:
        self.params = list(params)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.global_params = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.momentum_buffers = [torch.zeros_like(g) for g in self.global_params]
        self.num_steps = 0

    @torch.no_grad()
    def step(self) -> None:
        """The outer step from the averaged parameters; writes θ_g into the parameters."""
        for p, g, b in zip(self.params, self.global_params, self.momentum_buffers):
            delta = g - p.detach().to(torch.float32)
            b.mul_(self.momentum).add_(delta)
            g.sub_(delta.add_(b, alpha=self.momentum), alpha=self.lr)
            p.copy_(g)
        self.num_steps += 1

    @torch.no_grad()
    def restart(self) -> None:
        """θ_g <- the current (common) parameters; the momentum is kept."""
        for p, g in zip(self.params, self.global_params):
            g.copy_(p.detach())

    def state_dict(self) -> dict[str, Any]:
        """θ_g and b (lists in parameter order, fp32 on the parameters' devices) and the step count."""
        return {
            "global_params": [g.clone() for g in self.global_params],
            "momentum": [b.clone() for b in self.momentum_buffers],
            "num_steps": self.num_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` (ValueError when its tensors do not match the parameters)."""
        for key, mine in (("global_params", self.global_params), ("momentum", self.momentum_buffers)):
            saved = list(state[key])
            if len(saved) != len(mine) or any(s.shape != m.shape for s, m in zip(saved, mine)):
                raise ValueError(
                    f"outer optimizer state {key!r} holds {[tuple(s.shape) for s in saved]}, the parameters are "
                    f"{[tuple(m.shape) for m in mine]}"
                )
            for s, m in zip(saved, mine):
                m.copy_(s)
        self.num_steps = int(state.get("num_steps", 0))


def build_outer_optimizer(
    name: str, params: Sequence[torch.Tensor], lr: float, momentum: float
) -> NesterovOuterOptimizer | None:
    """The outer optimizer named by ``LocalSGDConfig.outer_optimizer``: None for "average" (nothing to keep)."""
    if name == "average":
        return None
    if name == "nesterov":
        return NesterovOuterOptimizer(params, lr=lr, momentum=momentum)
    raise ValueError(f"outer_optimizer={name!r} is not allowed; allowed: average, nesterov")


__all__ = ["NesterovOuterOptimizer", "build_outer_optimizer"]
