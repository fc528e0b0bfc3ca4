"""Configuration of activation quantization: one frozen dataclass, validated on construction.

Every check raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) in the package's one form,
``ActivationQuantConfig(bits=9) is out of range; allowed: ...``, so the Lightning callback (whose typed
constructor arguments map one to one onto these fields, built through ``build_as``) reports bad YAML naming
itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_qcomm._checks import check_bool, check_choice, check_float, check_int
from lightning_qcomm.memory.bit_allocation import POLICIES

DEFAULT_ATTENTION_PATTERNS: tuple[str, ...] = ()  # attention is recognised by op (op_rules)


def parse_patterns(
    value: str | Sequence[str] | None, arg: str = "attention_patterns", owner: str = "ActivationQuantConfig"
) -> tuple[str, ...]:
    """A comma-separated string or a list of fnmatch patterns -> tuple (None or "" -> no pattern)."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise ValueError(
            f"{owner}({arg}={value!r}) is not allowed; allowed: a comma-separated str, a list of str or None"
        )
    return tuple(p.strip().lower() for p in items if p.strip())


@dataclass(frozen=True)
class ActivationQuantConfig:
    """Everything the quantizer needs; validated on construction (ValueError names the argument).

    bits: code width of quantized activations (1..8); block_size: elements per (min, unit) scale pair;
    policy: ``uniform`` | ``layer_aware`` | ``budget`` (see ``bit_allocation``); min_numel: smaller saves
    stay exact; recompute: norms and activations hold only their quantized input and recompute;
    attention_patterns: fnmatch patterns naming modules whose every save stays exact (case-insensitive: stored
    lowercased; default none: attention is recognised by op, ``op_rules``);
    edge_bits: layer_aware's width of the first and last site (bits..8; the first forward, which counts
    the sites, is all 8-bit); budget_bits: budget's mean code width per quantized element
    (bits..8; None: bits + 1, at most 8); calibration_steps: optimizer steps measured (at 8 bits, about
    twice the saved bytes of a 4-bit step) before the budget plan is fixed;
    stochastic: stochastic rounding (False: round to nearest, biased); seed: folded into every site's seed;
    batch_saves: on a GPU, encode a layer's saves together when its forward ends and decode them together in
    backward (``save_batch``: a few launches per layer, not three per save; a layer's saves are held in full
    precision until then); False: each save encoded at once. No effect on CPU.

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
    batch_saves: bool = True

    def __post_init__(self) -> None:
        own = type(self).__name__
        check_int(own, "bits", self.bits, minimum=1, maximum=8)
        check_int(own, "block_size", self.block_size, minimum=1)
        check_choice(own, "policy", self.policy, POLICIES)
        check_int(own, "min_numel", self.min_numel, minimum=1)
        check_bool(own, "recompute", self.recompute)
        check_bool(own, "stochastic", self.stochastic)
        check_bool(own, "batch_saves", self.batch_saves)
        if not isinstance(self.attention_patterns, tuple) or not all(
            isinstance(p, str) for p in self.attention_patterns
        ):
            raise TypeError(
                f"{own}(attention_patterns={self.attention_patterns!r}) must be a tuple of str "
                "(parse_patterns makes one from a comma-separated str)"
            )
        # matched against lowercased module / class names (case-insensitive), so stored lowercased
        object.__setattr__(self, "attention_patterns", tuple(p.strip().lower() for p in self.attention_patterns))
        check_int(own, "edge_bits", self.edge_bits, minimum=self.bits, maximum=8)
        if self.budget_bits is None:
            object.__setattr__(self, "budget_bits", float(min(self.bits + 1, 8)))
        check_float(own, "budget_bits", self.budget_bits, minimum=self.bits, maximum=8)
        object.__setattr__(self, "budget_bits", float(self.budget_bits))
        check_int(own, "calibration_steps", self.calibration_steps, minimum=1)
        check_int(own, "seed", self.seed, minimum=0)
