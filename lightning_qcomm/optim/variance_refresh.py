"""The periodic variance refresh of 1-bit Adam after the freeze (docs/design.md, "1-bit Adam", "Variance refresh").

A variance frozen at the freeze step stays the preconditioner for the rest of training; on a model whose gradient
scales keep moving (a large vocabulary's rows, layers that wake up late) the frozen v̂ drifts away from the one
AdamW would hold, and the loss trails AdamW's even with an exact momentum average. ``VarianceRefresh`` brings v̂
along at a small, fixed cost: with ``variance_refresh`` = K > 0, after the freeze each rank sums its local squared
gradient over a window of K optimizer steps (per parameter, in the moment dtype; g + λp under L2 weight decay, as
Adam's v sees it, with p as the step left it: the sum is taken after the update, a difference of at most η·λ·b per
coordinate in the L2 term)::

    a <- a + g²                                   (every compressed step; a = 0 at the window's start)

and at the end of each window one all-reduce (bf16 payload, ledger tag ``"variance"``, in pieces of at most
``bucket_numel`` elements) averages the windows over the N ranks, and v̂ moves as Adam's v would have over K steps
of that mean square, per param group's β2::

    s = (1/(N K)) Σ_ranks a                       (the window's mean square gradient, averaged over the ranks)
    v̂ <- β2^K v̂ + (1 - β2^K) s;    a <- 0

If g² were constant over the window this is exactly Adam's K updates v <- β2 v + (1-β2) g² (v̂ is already bias-
corrected). It is chosen over replacing v̂ by s, by measurement (BENCHMARKS.md §6b: +0.02% of AdamW's loss against
+1.98%): a vocabulary row that no token of the window touched would get v̂ = 0 and stop; the blend keeps its
memory as AdamW's v does. s averages local squared gradients, which carry the
per-rank noise, so s >= (mean gradient)² on average: v̂ errs on the larger side, steps on the smaller one. A
coordinate that had no usable variance at the freeze (w = 0, ``adam_math.frozen_weight``) joins the 1-bit average
once its refreshed √v̂ > ε. The 1-bit error buffers keep their residuals across a refresh (in units of the old w,
off by the relative change of √v̂ for that one step).

Cost: 16 bits per element every K steps, 16/K bits per element and step (0.125 at K = 128), next to the momentum's
~1 + 32/B; memory one accumulator per trainable parameter (its moment dtype). The accumulators differ per rank:
they are saved with the 1-bit error buffers (``state_dict`` / ``load_state_dict`` here, called by
``OneBitAdam.rank_state_dict`` / ``load_rank_state_dict``); the position in the window is (steps since the freeze)
mod K, from the optimizer's own step counts. K = 0 turns it off (the original frozen variance).

Example::

    refresh = VarianceRefresh(128, bucket_numel=1 << 23)
    refresh.accumulate(opt.param_groups, opt.state)          # after each compressed step
    if steps_since_freeze % 128 == 0:
        refresh.refresh(opt.param_groups, opt.state, process_group)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.topology import NodeGroups
from lightning_qcomm.optim.adam_math import momentum_grad

LEDGER_TAG = "variance"
WIRE_DTYPE = torch.bfloat16


def _refreshed(param_groups: list[dict], state: Mapping) -> list[tuple[dict, list[torch.Tensor]]]:
    """(group, its trainable parameters with a frozen variance), in param_groups order: the same on every rank."""
    out = []
    for group in param_groups:
        params = [p for p in group["params"] if p.requires_grad and "exp_avg_sq" in state.get(p, {})]
        if params:
            out.append((group, params))
    return out


class VarianceRefresh:
    """Window sums of the local squared gradient and the periodic refresh of the frozen v̂ (see the module doc).

    Invariant: ``sums`` holds, per parameter, the sum of g² over the compressed steps of the current window (the
    steps since the freeze mod K); it is all zeros right after a refresh.

    Args:
        every: K, optimizer steps per window (0: off).
        bucket_numel: most elements per all-reduce piece.

    Example::

        opt.variance_refresh.state_dict(params)    # this rank's window sums, saved by OneBitAdam.rank_state_dict
    """

    def __init__(self, every: int, bucket_numel: int) -> None:
        self.every = int(every)
        self.bucket_numel = max(1, int(bucket_numel))
        self.sums: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> a, this window's Σ g² on this rank

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, steps_since_freeze: int) -> bool:
        """Whether the window ends with the step that made ``steps_since_freeze`` compressed steps."""
        return self.enabled and steps_since_freeze > 0 and steps_since_freeze % self.every == 0

    def accumulate(self, param_groups: list[dict], state: Mapping) -> None:
        """a <- a + g² for every trainable parameter with a frozen variance (g: its local gradient, g + λp under L2
        weight decay; a parameter without a gradient on this rank adds nothing). Multi-tensor (``torch._foreach``)."""
        for group, params in _refreshed(param_groups, state):
            sums, grads = [], []
            for p in params:
                acc = self.sums.get(p)
                if acc is None:
                    acc = self.sums[p] = torch.zeros_like(state[p]["exp_avg_sq"])
                if p.grad is None:
                    continue
                if group["weight_decay"] != 0 and not group["decoupled_weight_decay"]:
                    g = momentum_grad(p, acc, group)
                else:
                    g = p.grad if p.grad.dtype == acc.dtype else p.grad.to(acc.dtype)
                sums.append(acc)
                grads.append(g)
            if sums:
                torch._foreach_addcmul_(sums, grads, grads)

    def refresh(self, param_groups: list[dict], state: Mapping, process_group: Any = None) -> None:
        """End of a window: s = the ranks' mean of a / K (bf16 all-reduce, ledger tag ``"variance"``), then
        v̂ <- β2^K v̂ + (1-β2^K) s per group, and a <- 0. Collective: every rank calls it at the same step."""
        entries = _refreshed(param_groups, state)
        params = [p for _, ps in entries for p in ps]
        for p in params:
            if p not in self.sums:
                self.sums[p] = torch.zeros_like(state[p]["exp_avg_sq"])
        self._average_([self.sums[p] for p in params], process_group)
        for group, ps in entries:
            decay = group["betas"][1] ** self.every
            vs = [state[p]["exp_avg_sq"] for p in ps]
            torch._foreach_mul_(vs, decay)
            torch._foreach_add_(vs, [self.sums[p] for p in ps], alpha=(1 - decay) / self.every)
        for p in params:
            self.sums[p].zero_()

    def _average_(self, sums: list[torch.Tensor], process_group: Any) -> None:
        """Each of ``sums`` <- its mean over the ranks (through bf16), in pieces of at most ``bucket_numel``."""
        if not (dist.is_available() and dist.is_initialized()) or not sums:
            return
        group = None if isinstance(process_group, NodeGroups) else process_group  # the refresh is over the world
        world = dist.get_world_size(group)
        if world == 1:
            return
        piece: list[torch.Tensor] = []
        numel = 0
        for i, t in enumerate(sums):
            piece.append(t)
            numel += t.numel()
            if numel >= self.bucket_numel or i == len(sums) - 1:
                flat = torch.cat([x.reshape(-1) for x in piece]).to(WIRE_DTYPE)
                dist.all_reduce(flat, group=group)
                get_ledger().record("all_reduce", flat.numel() * flat.element_size(), 0, world, tag=LEDGER_TAG)
                flat = flat.to(piece[0].dtype).div_(world)
                for x, y in zip(piece, torch.split(flat, [x.numel() for x in piece])):
                    x.copy_(y.view_as(x))
                piece, numel = [], 0

    # ------------------------------------------------------------------ per-rank checkpoint
    def state_dict(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's window sums (CPU copies) in the order of ``params`` (None where there is none)."""
        return [None if p not in self.sums else self.sums[p].detach().cpu().clone() for p in params]

    def load_state_dict(self, params: list[torch.Tensor], sums: list[torch.Tensor | None]) -> None:
        """Restore window sums saved by ``state_dict`` for the same ``params`` (ValueError if the count differs)."""
        if len(sums) != len(params):
            raise ValueError(
                f"VarianceRefresh.load_state_dict(sums=<{len(sums)} tensors>): allowed one entry per parameter "
                f"({len(params)})"
            )
        self.sums = {p: s.to(device=p.device) for p, s in zip(params, sums) if s is not None}


__all__ = ["LEDGER_TAG", "VarianceRefresh"]
