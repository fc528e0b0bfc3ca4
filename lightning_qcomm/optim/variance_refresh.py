"""The periodic variance refresh of 1-bit Adam after the freeze (optim layer; docs/design.md, "1-bit Adam").

A frozen v̂ drifts away from the one AdamW would hold on models whose gradient scales keep moving. With
``variance_refresh`` = K > 0 each rank sums its local g² over a window of K compressed steps, and at the window's
end one bf16 all-reduce (ledger tag ``"variance"``) gives the ranks' mean square s = Σ_ranks a / (N K) and v̂ moves
as Adam's v would over K steps of it::

    a <- SR_bf16(a + g²)  (each compressed step);    v̂ <- β2^K v̂ + (1 - β2^K) s;  a <- 0  (each K-th)

The window a is held in bf16 (2 bytes per parameter), rounded stochastically: unbiased (``_add_square_rounded_``).

Invariants: v̂ stays the same on every rank; the blend (not a replacement of v̂ by s) keeps the memory of rows the
window did not touch (the choice is measured in BENCHMARKS.md); a coordinate with no usable variance at the freeze
joins once its √v̂ > ε; the accumulators differ per rank and are saved with the 1-bit error buffers; the window's
position comes from the optimizer's own step counts. K = 0 turns it off. Cost and derivation: docs/design.md,
"Module notes".

Example::

    refresh = VarianceRefresh(128, bucket_numel=1 << 23)
    refresh.accumulate(opt.param_groups, opt.state, step, rank)   # after each compressed step
    if steps_since_freeze % 128 == 0:
        refresh.refresh(opt.param_groups, opt.state, process_group)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_qcomm.codecs.rng import derive_seed, signed_seed
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.topology import NodeGroups
from lightning_qcomm.optim.adam_math import momentum_grad

LEDGER_TAG = "variance"
WINDOW_DTYPE = torch.bfloat16  # the window sums, held and all-reduced
WIRE_DTYPE = WINDOW_DTYPE
WINDOW_SEED = 0x5EED_F1A7  # keys the stochastic rounding with (step, rank, parameter index)
MAX_CHUNK = 1 << 16  # elements of a + g² formed in fp32 at once, at most


def chunk_numel(bucket_numel: int) -> int:
    """Elements of a + g² formed at once: an eighth of a momentum bucket, in [1024, ``MAX_CHUNK``]. The piece's
    fp32 sum, its hashes and their scratch (12 bytes an element) stay below 1.5 bytes per bucket element, under
    what a compressed step's own bucket buffers take (``adam_foreach.bucket_candidates``: 9 bytes per element)."""
    return min(MAX_CHUNK, max(1024, bucket_numel // 8))


def _window_zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=WINDOW_DTYPE, device=p.device)


def _add_square_rounded_(acc: torch.Tensor, g: torch.Tensor, seed: int, chunk: int) -> None:
    """acc (flat bf16) <- SR_bf16(acc + g²) (g flat, any float dtype), ``chunk`` elements at a time.

    acc + g² is formed in fp32 and rounded stochastically (``codecs.rng.round_bf16_stochastic_``; ``seed`` from step,
    rank and parameter, so a resumed run repeats the bits): E[a] = Σ g² exactly, where a bf16 sum rounded to nearest
    drops every term below half a place of a (up to 127 of them in a window of 128). Each rounding moves a by less
    than one place (2^-7 of it), unbiased and independent, so after K steps sd(a - Σ g²) < √(K/3) · 2^-8 · a: 2.5% at
    K = 128, under the spread of the window's own estimate of E[g²] (√(2/K), 12% for Gaussian g), and scaled by
    (1 - β2^K) in v̂. Hard bound: |a_K - S_K| < 2^-7 Σ_k (1+2^-7)^(k-1) S_k (S_k: the exact partial sums)."""
    torch.ops.qcomm.add_square_sr_(acc, g, signed_seed(seed), chunk)  # one launch on CUDA, the reference elsewhere


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

    def accumulate(self, param_groups: list[dict], state: Mapping, step: int, rank: int = 0) -> None:
        """a <- SR_bf16(a + g²) for every trainable parameter with a frozen variance (g: its local gradient, g + λp
        under L2 weight decay; a parameter without a gradient on this rank adds nothing). a + g² is formed in fp32
        a piece of ``chunk_numel(bucket_numel)`` elements at a time, and rounded stochastically with the counter-based bits keyed by
        (``step``, ``rank``, the parameter's index): the same on a resumed run."""
        index = 0
        for group, params in _refreshed(param_groups, state):
            l2 = group["weight_decay"] != 0 and not group["decoupled_weight_decay"]
            for p in params:
                index += 1
                acc = self.sums.get(p)
                if acc is None:
                    acc = self.sums[p] = _window_zeros(p)
                if p.grad is None:
                    continue
                g = momentum_grad(p, state[p]["exp_avg"], group) if l2 else p.grad
                seed = derive_seed(WINDOW_SEED, step, rank, index)
                _add_square_rounded_(acc.view(-1), g.reshape(-1), seed, chunk_numel(self.bucket_numel))

    def refresh(self, param_groups: list[dict], state: Mapping, process_group: Any = None) -> None:
        """End of a window: s = the ranks' mean of a / K (bf16 all-reduce, ledger tag ``"variance"``), then
        v̂ <- β2^K v̂ + (1-β2^K) s per group, and a <- 0. Collective: every rank calls it at the same step."""
        entries = _refreshed(param_groups, state)
        params = [p for _, ps in entries for p in ps]
        for p in params:
            if p not in self.sums:
                self.sums[p] = _window_zeros(p)
        world = self._sum_over_ranks_([self.sums[p] for p in params], process_group)
        for group, ps in entries:
            decay = group["betas"][1] ** self.every
            for p in ps:
                v = state[p]["exp_avg_sq"]
                v.mul_(decay).add_(self.sums[p], alpha=(1 - decay) / (self.every * world))
        for p in params:
            self.sums[p].zero_()

    def _sum_over_ranks_(self, sums: list[torch.Tensor], process_group: Any) -> int:
        """Each of ``sums`` <- its sum over the ranks (bf16, as held), in pieces of at most ``bucket_numel``; returns
        the number of ranks N (the mean is taken in the blend's factor)."""
        if not (dist.is_available() and dist.is_initialized()) or not sums:
            return 1
        group = None if isinstance(process_group, NodeGroups) else process_group  # the refresh is over the world
        world = dist.get_world_size(group)
        if world == 1:
            return 1
        piece: list[torch.Tensor] = []
        numel = 0
        for i, t in enumerate(sums):
            piece.append(t)
            numel += t.numel()
            if numel >= self.bucket_numel or i == len(sums) - 1:
                flat = torch.cat([x.reshape(-1) for x in piece])
                dist.all_reduce(flat, group=group)
                get_ledger().record("all_reduce", flat.numel() * flat.element_size(), 0, world, tag=LEDGER_TAG)
                for x, y in zip(piece, torch.split(flat, [x.numel() for x in piece])):
                    x.copy_(y.view_as(x))
                del flat
                piece, numel = [], 0
        return world

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
        self.sums = {p: s.to(device=p.device, dtype=WINDOW_DTYPE) for p, s in zip(params, sums) if s is not None}


__all__ = ["LEDGER_TAG", "VarianceRefresh"]
