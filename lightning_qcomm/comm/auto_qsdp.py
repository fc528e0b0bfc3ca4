"""QSDP's auto widths: ``weight_bits="auto"`` / ``grad_bits="auto"`` chosen from the measured link and codec
speeds with QSDP's own wire formula (comm layer; the cost model is ``comm.auto_width``'s, docs/design.md,
"Auto widths").

Per optimizer step, each FSDP group g (this rank's row: S_g elements, of which q_g are in quantized segments;
``GroupTraffic``) all-gathers its weights A_g times (2 when FSDP2 reshards it after forward, so backward
gathers it again; 1 for a group that stays unsharded, FSDP2's root) and reduce-scatters its gradients once. Over
N ranks, with R the link rate and c_b the codec's encode + decode seconds per element:

    T_w(b) = Σ_g A_g · [ (N-1) · row_bytes_g(b) / R  +  (1 + 1/N)/2 · N q_g · c_b ]     (all-gather)
    T_g(b) = Σ_g       [ (N-1) · row_bytes_g(b) / R  +  (2 - 1/N)/2 · N q_g · c_b ]     (reduce-scatter)

row_bytes_g(b) = Σ_segments ``codec_b.nbytes(numel)`` for quantized segments, numel · itemsize for raw ones (and
for every segment at b = 32: the buffer dtype's bytes, through the same adapter). The two directions are
independent terms of the step time, so each is chosen on its own: ``fastest`` over 32 and the widths down to
``min_bits``, ties to the wider.

One width per direction for the whole model, not per group: every term that depends on b is proportional to
the group's quantized size q_g (the wire bytes of a quantized segment up to the rounding of its last scale
bucket, the codec work exactly), and A_g multiplies both parts alike, while the raw segments and any per-call
latency cost the same at every width. So T_g(b) - T_g(32) = A_g · q_g · f(b) with one f for all groups: every
group has the same best width, and a per-group choice would differ only where bucket rounding tips a near-tie,
i.e. only add noise. (A per-call codec overhead, which would favour fp32 for small groups, is not measured.)

Invariants: deterministic given the costs; the costs are agreed across ranks (``measure_widths``: the slowest
rank's figures) and the layout is the same on every rank (padded shards), so every rank chooses the same widths.

Example::

    groups = group_traffic(model, min_quant_numel=1024)     # after fully_shard
    choice = choose_qsdp_widths(groups, mesh.get_group(), 2, min_bits=4, weight=("uniform", 1024), grad=("uniform", 1024))
    choice.weight_bits, choice.grad_bits        # each 32, 8 or 4; the same on every rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightning_qcomm.codecs import get_codec
from lightning_qcomm.comm.auto_width import (
    UNCOMPRESSED,
    WidthCosts,
    candidate_widths,
    codec_work_factor,
    fastest,
    format_costs,
    format_times,
    measure_widths,
    step_seconds,
)
from lightning_qcomm.comm.fsdp_internals import fsdp_params, gathers_per_step, param_dtypes, param_shard
from lightning_qcomm.comm.row_codec import Segment, is_quantized_param
from lightning_qcomm.comm.wire_bytes import wire_bytes_formula

DIRECTIONS = ("weights", "grads")
_OP = {"weights": "all_gather", "grads": "reduce_scatter"}


@dataclass(frozen=True)
class GroupTraffic:
    """One FSDP group as this rank's collectives see it: its row layout (one ``Segment`` per parameter shard,
    padded, in buffer order), weight all-gathers per step, and the raw bytes per element of each direction."""

    segments: tuple[Segment, ...]
    gathers: int = 2
    weight_itemsize: int = 4
    grad_itemsize: int = 4

    @property
    def quantized_numel(self) -> int:
        return sum(s.numel for s in self.segments if s.quantize)


def group_traffic(root: torch.nn.Module, min_quant_numel: int) -> list[GroupTraffic]:
    """``GroupTraffic`` of each FSDP module under ``root`` (``root`` included) that owns parameters, in
    ``root.modules()`` order (the group ids); after ``fully_shard``, before the first forward is fine. An FSDP
    module under no other FSDP module (one without parameters included) is an FSDP2 root."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in root.modules() if isinstance(m, FSDPModule)]
    inner = {id(x) for m in fsdp for x in m.modules() if x is not m and isinstance(x, FSDPModule)}
    groups = []
    for m in fsdp:
        fps = fsdp_params(m)
        if not fps:
            continue
        shards = [param_shard(fp) for fp in fps]
        gather_dtype, reduce_dtype = param_dtypes(m)
        groups.append(
            GroupTraffic(
                tuple(Segment(p.padded_shard_numel, is_quantized_param(p, min_quant_numel)) for p in shards),
                gathers_per_step(m, is_root=id(m) not in inner),
                gather_dtype.itemsize,
                reduce_dtype.itemsize,
            )
        )
    return groups


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not allowed; allowed: {', '.join(DIRECTIONS)}")


def qsdp_wire_bytes(
    direction: str,
    bits: int,
    groups: Sequence[GroupTraffic],
    world_size: int,
    codec: str = "uniform",
    bucket_size: int = 1024,
) -> float:
    """Bytes this rank sends per step for ``direction`` ("weights": the all-gathers, "grads": the
    reduce-scatters) at ``bits`` (32: raw), Σ_g calls_g · (N-1) · row_bytes_g(b)."""
    _check_direction(direction)
    code = None if bits == UNCOMPRESSED else get_codec(codec, bits=bits, bucket_size=bucket_size)
    total = 0.0
    for g in groups:
        calls = g.gathers if direction == "weights" else 1
        itemsize = g.weight_itemsize if direction == "weights" else g.grad_itemsize
        row = sum(
            wire_bytes_formula(_OP[direction], s.numel, world_size, code if s.quantize else None, itemsize)
            for s in g.segments
        )
        total += calls * row
    return total


def qsdp_codec_pairs(direction: str, groups: Sequence[GroupTraffic], world_size: int) -> float:
    """Encode + decode pairs this rank runs per step for ``direction``: Σ_g calls_g · k · N q_g."""
    _check_direction(direction)
    k = codec_work_factor(world_size, _OP[direction])
    return sum((g.gathers if direction == "weights" else 1) * k * world_size * g.quantized_numel for g in groups)


def qsdp_predicted_seconds(
    direction: str,
    bits: int,
    groups: Sequence[GroupTraffic],
    world_size: int,
    costs: WidthCosts,
    codec: str = "uniform",
    bucket_size: int = 1024,
) -> float:
    """T_w(bits) or T_g(bits) of the module docstring (0 on one rank: nothing travels)."""
    if world_size <= 1:
        return 0.0
    wire = qsdp_wire_bytes(direction, bits, groups, world_size, codec, bucket_size)
    return step_seconds(bits, wire, qsdp_codec_pairs(direction, groups, world_size), costs)


def qsdp_times(
    direction: str,
    groups: Sequence[GroupTraffic],
    world_size: int,
    costs: WidthCosts,
    min_bits: int = 4,
    codec: str = "uniform",
    bucket_size: int = 1024,
) -> dict[int, float]:
    """Every candidate width's predicted seconds, widest first."""
    return {
        b: qsdp_predicted_seconds(direction, b, groups, world_size, costs, codec, bucket_size)
        for b in candidate_widths(min_bits)
    }


def choose_qsdp_bits(
    direction: str,
    groups: Sequence[GroupTraffic],
    world_size: int,
    costs: WidthCosts,
    min_bits: int = 4,
    codec: str = "uniform",
    bucket_size: int = 1024,
) -> int:
    """The width of ``direction`` with the smallest predicted time (ties: the wider one)."""
    return fastest(qsdp_times(direction, groups, world_size, costs, min_bits, codec, bucket_size))


@dataclass(frozen=True)
class QSDPAutoChoice:
    """What ``choose_qsdp_widths`` decided, with what it measured (identical on every rank).

    ``weight_bits`` / ``grad_bits`` are None for a direction that was not "auto"; ``costs`` and ``times`` hold
    the measured ``WidthCosts`` and each candidate's predicted seconds per chosen direction."""

    weight_bits: int | None
    grad_bits: int | None
    world_size: int
    groups: int
    quantized_numel: int
    costs: dict[str, WidthCosts] = field(default_factory=dict)
    times: dict[str, dict[int, float]] = field(default_factory=dict)

    def describe(self) -> str:
        """One log line: the choices, the measurements and every candidate's predicted time."""
        parts = []
        for direction, arg, bits in (
            ("weights", "weight_bits", self.weight_bits),
            ("grads", "grad_bits", self.grad_bits),
        ):
            if bits is None:
                continue
            what = "no compression (32)" if bits == UNCOMPRESSED else f"{bits}"
            parts.append(
                f"{arg}='auto' chose {what} ({format_costs(self.costs[direction])}; predicted per step: "
                f"{format_times(self.times[direction])})"
            )
        return (
            f"{'; '.join(parts)}; for {self.groups} FSDP groups ({self.quantized_numel} quantizable elements per "
            f"rank) over {self.world_size} ranks, one width per direction for all groups"
        )


def choose_qsdp_widths(
    groups: Sequence[GroupTraffic],
    process_group,
    world_size: int,
    min_bits: int = 4,
    weight: tuple[str, int] | None = None,
    grad: tuple[str, int] | None = None,
    device: torch.device | None = None,
) -> QSDPAutoChoice:
    """Measure (collective: ``measure_widths`` over ``process_group``) and choose the width of each
    direction given as ``(codec name, bucket_size)``; None leaves that direction alone."""
    specs = {d: s for d, s in (("weights", weight), ("grads", grad)) if s is not None}
    unique = list(dict.fromkeys(specs.values()))
    measured = dict(zip(unique, measure_widths(process_group, min_bits, device, unique)))
    costs = {d: measured[s] for d, s in specs.items()}
    times = {d: qsdp_times(d, groups, world_size, costs[d], min_bits, *specs[d]) for d in specs}
    chosen = {d: fastest(t) for d, t in times.items()}
    return QSDPAutoChoice(
        chosen.get("weights"),
        chosen.get("grads"),
        world_size,
        len(groups),
        sum(g.quantized_numel for g in groups),
        costs,
        times,
    )


__all__ = [
    "DIRECTIONS",
    "GroupTraffic",
    "QSDPAutoChoice",
    "choose_qsdp_bits",
    "choose_qsdp_widths",
    "group_traffic",
    "qsdp_codec_pairs",
    "qsdp_predicted_seconds",
    "qsdp_times",
    "qsdp_wire_bytes",
]
