"""OneBitAdam: 1-bit Adam (Tang et al. 2021) as a torch optimizer (optim layer; docs/design.md, "1-bit Adam").

This file owns the optimizer math (multi-tensor form: ``optim.adam_foreach``; per parameter: ``optim.adam_math``)
and when the variance freezes (settings: ``optim.onebit_adam_config``; the freeze: ``optim.variance_freeze``). The
compressed momentum average is ``adapters.onebit.sync``; the Lightning glue ``callbacks.onebit_adam``.

Phases: a warm-up that is torch's AdamW bit for bit (fp32 parameters); at ``freeze_step`` (or by auto-freeze) v is
replaced by its bias-corrected v̂ and frozen (refreshed every ``variance_refresh`` steps); then each step averages
the preconditioned momentum u = m / (√v̂ + ε), clipped, with the error-compensated 1-bit all-reduce, and no gradient
all-reduce. Invariants: m, v̂ and p are the same on every rank; non-finite gradients stay non-finite; the state
uses torch's Adam keys (an AdamW checkpoint loads); the 1-bit error buffers differ per rank and travel through
``rank_state_dict`` / ``load_rank_state_dict``, not ``state_dict``. Unsupported (ValueError): amsgrad, maximize,
sparse gradients, complex parameters. Memory kept between steps after the freeze, per fp32 parameter: AdamW's
bytes + 4 + 4/N (the error buffers) + 2 with ``variance_refresh`` (the window of g² sums, bf16); within a step
a few buckets more, inline and with ``overlap`` (at most ``adapters.onebit.overlap.MAX_IN_FLIGHT`` buckets' fp32
candidates in backward; the averages wait for the step in their 1-bit wire form). More: docs/design.md, "Module notes".

Example::

    optimizer = OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=100)
    onebit_adam_ddp(ddp, optimizer)                    # parallel.onebit_adam: the DDP side
    torch.save(optimizer.rank_state_dict(), f"onebit_rank{rank}.pt")   # per rank, beside optimizer.state_dict()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_qcomm.adapters.onebit.overlap import MomentumOverlap
from lightning_qcomm.adapters.onebit.sync import OneBitMomentumSync
from lightning_qcomm.comm.agree import max_over_ranks, max_over_ranks_tensor
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.optim.adam_foreach import bucket_candidates, bucket_update_, warmup_step_
from lightning_qcomm.optim.adam_math import moment_dtype
from lightning_qcomm.optim.onebit_adam_config import (
    DEFAULT_SCALE_BLOCK,
    DEFAULT_VARIANCE_REFRESH,
    OneBitAdamConfig,
    check_adam_hparams,
    check_no_amsgrad,
)
from lightning_qcomm.optim.onebit_state import OneBitAdamCheckpoint
from lightning_qcomm.optim.variance_freeze import (
    auto_freeze_count,
    freeze_variance,
    relative_variance_change,
    tracked_variance_change,
    unusable_fraction,
    warn_if_unstable,
)
from lightning_qcomm.optim.variance_refresh import VarianceRefresh

log = logging.getLogger(__name__)


class OneBitAdam(OneBitAdamCheckpoint, Optimizer):
    """1-bit Adam: AdamW warm-up, then frozen variance and an error-compensated 1-bit momentum all-reduce.

    See the module docstring for the exact math. Constructor arguments after ``params`` are typed primitives.

    Args:
        params: parameters or param-group dicts (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``decoupled_weight_decay`` are honoured).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (weight decay is decoupled by default).
        decoupled_weight_decay: True = AdamW (p <- p(1 - lr·wd)); False = Adam's L2 term (g <- g + wd·p).
        freeze_step, auto_freeze_threshold, auto_freeze_interval, auto_freeze_patience: see ``OneBitAdamConfig``.
        bucket_mb, nonfinite, overlap, scale_block, variance_refresh: see ``OneBitAdamConfig``.
        process_group: the data-parallel group of the momentum all-reduce (None: default group). The
            Lightning callback sets it from the DDP module (``set_process_group``).

    Example::

        optimizer = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        onebit = onebit_adam_ddp(ddp_model, optimizer)   # plain torch; in Lightning: OneBitAdamCallback
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        decoupled_weight_decay: bool = True,
        freeze_step: int = 100,
        auto_freeze_threshold: float | None = None,
        auto_freeze_interval: int = 10,
        auto_freeze_patience: int = 3,
        bucket_mb: float = 32.0,
        nonfinite: str = "skip",
        overlap: bool = True,
        process_group: dist.ProcessGroup | None = None,
        scale_block: int = DEFAULT_SCALE_BLOCK,
        variance_refresh: int = DEFAULT_VARIANCE_REFRESH,
    ) -> None:
        check_adam_hparams(lr, betas, eps, weight_decay)
        if not isinstance(decoupled_weight_decay, bool):
            raise ValueError(f"OneBitAdam(decoupled_weight_decay={decoupled_weight_decay!r}): allowed True or False")
        self.config = OneBitAdamConfig(
            freeze_step,
            auto_freeze_threshold,
            auto_freeze_interval,
            auto_freeze_patience,
            bucket_mb,
            nonfinite,
            overlap,
            scale_block,
            variance_refresh,
        )
        self.nonfinite = NonFiniteGuard(nonfinite, "OneBitAdam", agree=self._all_ranks_finite)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay
        )
        super().__init__(params, defaults)
        check_no_amsgrad(self.param_groups, "OneBitAdam")
        for i, group in enumerate(self.param_groups):
            check_adam_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], f"param_groups[{i}]")
            for p in group["params"]:
                if torch.is_complex(p):
                    raise ValueError("OneBitAdam: complex parameters are not supported; allowed: real floating tensors")
        self.process_group = process_group
        self.num_steps = 0  # optimizer steps taken (warm-up + compression)
        self.frozen_at: int | None = None  # value of num_steps when v froze
        self.auto_below = 0  # consecutive auto-freeze checks with r < threshold
        self.last_variance_change: float | None = None  # r of the last auto-freeze check
        self._sync: OneBitMomentumSync | None = None
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._overlap = MomentumOverlap(self.config.overlap)
        self.variance_refresh = VarianceRefresh(self.config.variance_refresh, self.config.bucket_numel)
        self._layout: list[torch.Tensor] | None = None
        self._pending_rank_state: dict | None = None
        self._warned_stateless = False
        self.change_at_freeze: float | None = None  # r over the last check interval when v froze (None: not measured)
        self.unusable_at_freeze: float | None = None  # share of coordinates with √v̂ <= eps when v froze

    # ------------------------------------------------------------------ public state
    @property
    def frozen(self) -> bool:
        """True once the variance is frozen (compression phase)."""
        return self.frozen_at is not None

    def disable_overlap(self, reason: str) -> None:
        """Average the momentum after backward from now on (``overlap`` off; ``reason`` is logged once)."""
        self._overlap.disable(reason)

    def close_overlap(self) -> None:
        """Remove the gradient hooks of the overlapped sync (made again at the next compressed step, if it applies)."""
        self._overlap.close()

    def set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Group of the momentum all-reduce; call before the first compression step."""
        if self._sync is not None and self._sync.process_group is not process_group:
            raise ValueError(
                f"OneBitAdam.set_process_group(process_group={process_group!r}): the momentum sync already runs on "
                f"{self._sync.process_group!r}; allowed: that group (it is fixed at the first compression step)"
            )
        self.process_group = process_group

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step (warm-up AdamW, or the compression-phase update); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        overlapped = self.frozen and self._overlap.launcher is not None  # its verdict comes from the average
        if not overlapped and not self.nonfinite.should_step(params, self.num_steps):
            return loss  # skipped on every rank: nothing moves, the step is not counted
        if self.frozen:
            if not self._compressed_step():
                return loss
            if self.variance_refresh.enabled:
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                self.variance_refresh.accumulate(self.param_groups, self.state, self.num_steps, rank)
        else:
            self._warmup_step()
        self.num_steps += 1
        if self.frozen and self.variance_refresh.due(self.num_steps - self.frozen_at):
            self.variance_refresh.refresh(self.param_groups, self.state, self.process_group)
        if not self.frozen:
            self._maybe_freeze()
        return loss

    def _warmup_step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("OneBitAdam: sparse gradients are not supported; allowed: dense gradients")
                state = self.state[p]
                if len(state) == 0:
                    dtype = moment_dtype(p)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=dtype)
            if params:
                warmup_step_(params, self.state, group)

    def _build_layout(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if "exp_avg" in self.state.get(p, {})]
        if not params:
            raise RuntimeError("OneBitAdam: no parameter received a gradient during warm-up; nothing to optimize")
        self._layout = params
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._sync = OneBitMomentumSync(
            [p.numel() for p in params],
            self.config.bucket_numel,
            process_group=self.process_group,
            block_numel=self.config.block_numel,
        )
        if self._pending_rank_state is not None:
            pending, self._pending_rank_state = self._pending_rank_state, None
            self._load_rank_state(pending)

    def _compressed_step(self) -> bool:
        """The compression-phase step; False when the overlapped step's verdict skipped it."""
        if self._sync is None:
            self._build_layout()
        elif self._overlap.launcher is not None:
            return self._overlapped_step()
        assert self._layout is not None and self._sync is not None
        for b, members in enumerate(self._sync.buckets):  # layout order (param_groups order), as the sync was built
            self._update_bucket(b, self._sync.reduce_bucket_(b, self._momentum_candidates(members)))
        self._warn_stateless()
        # from the next step on, where overlap applies (collective the first time: every rank is at this step)
        self._overlap.start(self._sync, self._layout, self._momentum_candidates, self.process_group)
        return True

    def _overlapped_step(self) -> bool:
        assert self._layout is not None and self._sync is not None
        averaged = self._overlap.launcher.finish()  # 1-bit wire forms: one bucket is decoded at a time
        if self.nonfinite.policy != "propagate":
            # the average is the same on every rank and non-finite wherever any rank's momentum was (the codec
            # never decodes a non-finite unit as finite): the ranks agree without a collective
            finite = bool(torch.stack([a.finite() for a in averaged]).all())
            if not self.nonfinite.verdict(finite, self.num_steps, "the averaged 1-bit momentum"):
                return False
        for b in range(len(averaged)):
            wire, averaged[b] = averaged[b], None
            self._update_bucket(b, wire.decode())
        self._warn_stateless()
        return True

    def _momentum_candidates(self, members: list[int]) -> torch.Tensor:
        assert self._layout is not None
        return bucket_candidates([self._layout[i] for i in members], self.state, self._group_of)

    def _update_bucket(self, b: int, flat: torch.Tensor) -> None:
        """m and p of bucket ``b``'s members from its averaged preconditioned momenta (not those with
        ``requires_grad=False``: m, v̂, step and p stay)."""
        assert self._layout is not None and self._sync is not None
        bucket_update_([self._layout[i] for i in self._sync.buckets[b]], self.state, self._group_of, flat)

    def _warn_stateless(self) -> None:
        if self._warned_stateless:
            return
        in_layout = set(self._layout or ())
        for p in (p for g in self.param_groups for p in g["params"]):
            if p not in in_layout and p.grad is not None:
                self._warned_stateless = True
                log.warning(
                    "OneBitAdam: a parameter of shape %s got a gradient after the freeze but none during warm-up "
                    "(no variance); it is not updated",
                    tuple(p.shape),
                )
                return

    def _all_ranks_finite(self, flag: torch.Tensor) -> torch.Tensor:
        """After the freeze each rank checks its own local gradient, so the ranks agree before m moves; during
        the warm-up the gradient is DDP's average, the same on every rank, and needs no agreement."""
        if not self.frozen:
            return flag
        return max_over_ranks_tensor(flag, self.process_group, device=self._collective_device())

    # ------------------------------------------------------------------ freezing
    def _maybe_freeze(self) -> None:
        cfg = self.config
        if cfg.auto_freeze_threshold is None and self.num_steps == max(1, cfg.freeze_step - cfg.auto_freeze_interval):
            relative_variance_change(self.param_groups, self.state)  # the reference of the check at the freeze
        elif cfg.auto_freeze_threshold is not None and self.num_steps % cfg.auto_freeze_interval == 0:
            self.last_variance_change = self._variance_change()
            self.auto_below, stable = auto_freeze_count(cfg, self.auto_below, self.last_variance_change)
            if stable:
                log.info(
                    "OneBitAdam: variance stable for %d checks; freezing at step %d", self.auto_below, self.num_steps
                )
                self.freeze()
                return
        if self.num_steps >= cfg.freeze_step:
            self.freeze()

    def _variance_change(self) -> float:
        """r = ||v̂ - v̂_ref|| / ||v̂|| over all parameters (max over ranks); v̂_ref <- v̂."""
        r = relative_variance_change(self.param_groups, self.state)
        return max_over_ranks(r, self.process_group, device=self._collective_device())

    def _collective_device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def freeze(self) -> None:
        """Freeze v now (v <- v̂, bias-corrected); the next step is a compression-phase step. Idempotent. Warns once
        when the variance still changed by r >= τ over the last check interval (``variance_freeze.warn_if_unstable``)."""
        if self.frozen:
            return
        cfg = self.config
        checked_now = cfg.auto_freeze_threshold is not None and self.num_steps % cfg.auto_freeze_interval == 0
        r = self.last_variance_change if checked_now else tracked_variance_change(self.param_groups, self.state)
        freeze_variance(self.param_groups, self.state)
        self.frozen_at = self.num_steps
        self.change_at_freeze, self.unusable_at_freeze = r, unusable_fraction(self.param_groups, self.state)
        log.info("OneBitAdam: variance frozen after %d warm-up steps; momentum now travels 1-bit", self.num_steps)
        warn_if_unstable(r, cfg.auto_freeze_threshold, self.unusable_at_freeze, self.num_steps)


__all__ = ["OneBitAdam", "OneBitAdamConfig", "check_adam_hparams"]
