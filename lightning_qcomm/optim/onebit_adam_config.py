"""OneBitAdam's settings and their validation (docs/design.md, "1-bit Adam").

``OneBitAdamConfig`` holds the optimizer-wide settings (freeze schedule, bucket size, non-finite policy);
``check_adam_hparams`` validates the per-group Adam hyperparameters, raising ``ValueError`` naming the
argument, its value and the allowed range.

Example::

    cfg = OneBitAdamConfig(freeze_step=200, bucket_mb=16.0, variance_refresh=64)
    cfg.bucket_numel                        # 16 MiB of fp32 = 4194304 elements
    check_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 0.01)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_qcomm.comm.nonfinite import check_policy

FP32_BYTES = 4
DEFAULT_SCALE_BLOCK = 256  # elements per 1-bit scale (0: one per chunk)
DEFAULT_VARIANCE_REFRESH = 128  # optimizer steps between two refreshes of the frozen variance (0: never)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class OneBitAdamConfig:
    """Optimizer-wide settings of OneBitAdam (per-group hyperparameters live in ``param_groups``).

    Attributes:
        freeze_step: warm-up length in optimizer steps (>= 1); the variance freezes at the end of this step.
        auto_freeze_threshold: τ of the auto-freeze test (None: off), 0 < τ < 1.
        auto_freeze_interval: k, optimizer steps between two auto-freeze checks (>= 1).
        auto_freeze_patience: consecutive checks with r < τ needed to freeze (>= 1).
        bucket_mb: maximum size of one flat fused momentum bucket, MiB of fp32 (> 0).
        nonfinite: a step whose gradient holds NaN/Inf on any rank is ``"skip"``-ped on every rank (m, v, the
            error buffers and the step count untouched; logged, counted in ``nonfinite.skipped``; after the freeze
            the ranks agree with one 8-byte all-reduce per step), ``"raise"``-s FloatingPointError, or
            ``"propagate"``-s. With ``overlap`` the verdict is read from the averaged momentum instead (no
            extra all-reduce; see ``optim.onebit_adam``, "Overlap").
        overlap: start each momentum bucket's 1-bit average during backward, as soon as its gradients are
            final (``adapters.onebit.overlap``), instead of after it. Needs one backward per optimizer step.
        scale_block: B, elements per 1-bit scale (an int >= 8; default ``DEFAULT_SCALE_BLOCK``): each block of B
            consecutive momentum elements travels as signs and its own fp32 rms, 1 + 32/B bits per element. 0: one
            scale per chunk of a bucket (up to 2^18 elements per rank and piece), the original 1-bit Adam code.
        variance_refresh: K, optimizer steps between two refreshes of the frozen variance after the freeze (an int
            >= 0; default ``DEFAULT_VARIANCE_REFRESH``): each rank sums its local g² over K steps, one bf16
            all-reduce averages the sums and v̂ <- β2^K v̂ + (1-β2^K) · mean g² (``optim.variance_refresh``), 16/K bits
            per element and step. 0: the variance stays as frozen, the original 1-bit Adam.
    """

    freeze_step: int = 100
    auto_freeze_threshold: float | None = None
    auto_freeze_interval: int = 10
    auto_freeze_patience: int = 3
    bucket_mb: float = 32.0
    nonfinite: str = "skip"
    overlap: bool = True
    scale_block: int = DEFAULT_SCALE_BLOCK
    variance_refresh: int = DEFAULT_VARIANCE_REFRESH

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"OneBitAdam({name}={value!r}): allowed {allowed}")

        if not isinstance(self.freeze_step, int) or isinstance(self.freeze_step, bool) or self.freeze_step < 1:
            raise bad("freeze_step", self.freeze_step, "an int >= 1 (v needs at least one warm-up update)")
        t = self.auto_freeze_threshold
        if t is not None and (not _is_number(t) or not 0.0 < t < 1.0):
            raise bad("auto_freeze_threshold", t, "None or a float in (0, 1)")
        for name in ("auto_freeze_interval", "auto_freeze_patience"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, v, "an int >= 1")
        if not _is_number(self.bucket_mb) or not self.bucket_mb > 0 or not math.isfinite(self.bucket_mb):
            raise bad("bucket_mb", self.bucket_mb, "a finite float > 0")
        check_policy("OneBitAdam", self.nonfinite)
        if not isinstance(self.overlap, bool):
            raise bad("overlap", self.overlap, "True or False")
        s = self.scale_block
        if not isinstance(s, int) or isinstance(s, bool) or not (s == 0 or s >= 8):
            raise bad("scale_block", s, "0 (one scale per chunk) or an int >= 8")
        k = self.variance_refresh
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise bad("variance_refresh", k, "0 (the variance stays frozen) or an int >= 1 (steps per refresh)")

    @property
    def bucket_numel(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024 / FP32_BYTES))

    @property
    def block_numel(self) -> int | None:
        """``scale_block`` as the collective takes it (None: one scale per chunk)."""
        return self.scale_block or None


def check_adam_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "OneBitAdam") -> None:
    """ValueError naming the argument unless lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0 (all finite)."""

    def finite(x: Any) -> bool:
        return _is_number(x) and math.isfinite(x)

    if not finite(lr) or lr < 0:
        raise ValueError(f"{where}(lr={lr!r}): allowed a finite float >= 0")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(finite(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"{where}(betas={betas!r}): allowed a pair of floats in [0, 1)")
    if not finite(eps) or eps < 0:
        raise ValueError(f"{where}(eps={eps!r}): allowed a finite float >= 0")
    if not finite(weight_decay) or weight_decay < 0:
        raise ValueError(f"{where}(weight_decay={weight_decay!r}): allowed a finite float >= 0")


def check_no_amsgrad(groups: Any, where: str) -> None:
    """ValueError naming the group unless every param group has amsgrad and maximize off (not supported)."""
    for i, g in enumerate(groups):
        if g.get("amsgrad") or g.get("maximize"):
            raise ValueError(
                f"{where}: param_groups[{i}] has amsgrad={g.get('amsgrad')!r}, maximize={g.get('maximize')!r}; "
                "allowed: both False (amsgrad/maximize are not supported)"
            )


__all__ = [
    "DEFAULT_SCALE_BLOCK",
    "DEFAULT_VARIANCE_REFRESH",
    "OneBitAdamConfig",
    "check_adam_hparams",
    "check_no_amsgrad",
]
