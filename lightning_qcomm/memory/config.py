"""Configuration of activation quantization: one frozen dataclass, validated on construction.

Every check raises ``ValueError`` naming the argument, the value and what is allowed, so the Lightning
callback (whose typed constructor arguments map one to one onto these fields) reports bad YAML clearly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_qcomm.memory.bit_allocation import POLICIES

DEFAULT_ATTENTION_PATTERNS = ("*attn*", "*attention*")


def parse_patterns(value: str | Sequence[str] | None, arg: str = "attention_patterns") -> tuple[str, ...]:
    """A comma-separated string or a list of fnmatch patterns -> tuple (None or "" -> no pattern)."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise ValueError(f"{arg} must be a comma-separated str, a list of str or None, got {value!r}")
    return tuple(p.strip().lower() for p in items if p.strip())


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value} is out of range; allowed: {allowed}")


@dataclass(frozen=True)
class ActivationQuantConfig:
    """Everything the quantizer needs; validated on construction (ValueError names the argument).

    bits: code width of quantized activations (1..8); block_size: elements per (min, unit) scale pair;
    policy: ``uniform`` | ``layer_aware`` | ``budget`` (see ``bit_allocation``); min_numel: smaller saves
    stay exact; recompute: norms and activations hold only their quantized input and recompute;
    attention_patterns: fnmatch patterns naming attention modules (case-insensitive: stored lowercased);
    edge_bits: layer_aware's width of the first and last site (bits..8; the first forward, which counts
    the sites, is all 8-bit); budget_bits: budget's mean code width per quantized element
    (bits..8; None: bits + 1, at most 8); calibration_steps: optimizer steps measured (at 8 bits, about
    twice the saved bytes of a 4-bit step) before the budget plan is fixed;
    stochastic: stochastic rounding (False: round to nearest, biased); seed: folded into every site's seed.

    Example::

        cfg = ActivationQuantConfig(bits=4, policy="layer_aware", edge_bits=8)
        quantizer = ActivationQuantizer(cfg)
    """

    bits: int = 4
    block_size: int = 128
    policy: str = "uniform"
    min_numel: int = 1024
    recompute: bool = True
    attention_patterns: tuple[str, ...] = DEFAULT_ATTENTION_PATTERNS
    edge_bits: int = 8
    budget_bits: float | None = None
    calibration_steps: int = 1
    stochastic: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("bits", self.bits, 1, 8)
        _check_int("block_size", self.block_size, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not supported; allowed: {', '.join(POLICIES)}")
        _check_int("min_numel", self.min_numel, 1)
        for name in ("recompute", "stochastic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.attention_patterns, tuple) or not all(
            isinstance(p, str) for p in self.attention_patterns
        ):
            raise ValueError(f"attention_patterns must be a tuple of str, got {self.attention_patterns!r}")
        # matched against lowercased module / class names (case-insensitive), so stored lowercased
        object.__setattr__(self, "attention_patterns", tuple(p.strip().lower() for p in self.attention_patterns))
        _check_int("edge_bits", self.edge_bits, self.bits, 8)
        if self.budget_bits is None:
            object.__setattr__(self, "budget_bits", float(min(self.bits + 1, 8)))
        if isinstance(self.budget_bits, bool) or not isinstance(self.budget_bits, (int, float)):
            raise ValueError(f"budget_bits must be a float, got {self.budget_bits!r}")
        if not self.bits <= self.budget_bits <= 8:
            raise ValueError(f"budget_bits={self.budget_bits} is out of range; allowed: bits ({self.bits})..8")
        _check_int("calibration_steps", self.calibration_steps, 1)
        _check_int("seed", self.seed, 0)
