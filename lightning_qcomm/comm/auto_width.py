"""Auto widths: the code width chosen from the measured link and codec speeds, one cost model for every strategy
(comm layer; docs/design.md, "Auto widths").

Compressing pays only when the wire time it saves exceeds the codec work it adds. With the link's measured rate
R (bytes per second, per direction) and the codec's measured encode + decode cost c_b (seconds per element at b
bits, on this rank's CPU or device), one step's communication at width b is predicted as

    T(b) = W_b / R + P · c_b        (``step_seconds``; at b = 32 nothing is coded: P · c_32 = 0)

with W_b the bytes this rank sends per step (``comm.wire_bytes.wire_bytes_formula``) and P the encode + decode
pairs this rank runs per step, P = Σ_calls k · d for collectives of d elements, k from ``codec_work_factor``.
The codec work is added, not overlapped: on a CPU rank it shares the core with the backward pass.
``fastest`` takes the width with the smallest T among 32 and the allowed widths (``min_bits`` .. 8); a tie goes
to the wider one (more accurate). QSDP (``weight_bits`` / ``grad_bits="auto"``, ``comm.auto_qsdp``) supplies W_b
and P. QuantDDP's ``codec="auto"`` measures whole steps instead (``comm.auto_trial``): its fp32 all-reduce
overlaps backward, which this model cannot see.

Invariants: the decision is deterministic given the costs, and ``measure_widths`` makes the costs identical on
every rank (each rank measures, then one all-reduce keeps the maximum, the slowest rank's), so every rank
chooses the same width. On one rank nothing travels: nothing is measured and the choice is 32. The choice is
made once, at setup, and logged with its measurements.

Example::

    (costs,) = measure_widths(group, min_bits=4)                  # collective: every rank calls it
    wire = wire_bytes_formula("all_gather", 3_300_000, 2, get_codec("uniform", bits=4))
    step_seconds(4, wire, codec_work_factor(2, "all_gather") * 3_300_000, costs)   # predicted seconds
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import get_codec
from lightning_qcomm.comm.wire_bytes import wire_bytes_formula

log = logging.getLogger(__name__)

UNCOMPRESSED = 32
WIDTHS = (8, 4, 2)
AUTO_CODEC = "uniform"  # min-max stochastic rounding: unbiased, contractive, the fastest fused CPU path
PROBE_NUMEL = 1 << 20
WORK_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class WidthCosts:
    """Measured speeds: the link's rate per direction and each width's encode + decode seconds per element."""

    link_bytes_per_s: float
    codec_s_per_element: dict[int, float]


def codec_work_factor(world_size: int, collective: str = "all_reduce") -> float:
    """Encode + decode pairs per element of d in one compressed ``collective`` over N ranks (d: the whole
    logical buffer, N shards of d/N for the all-gather and the reduce-scatter).

    * all_reduce (two-phase): phase 1 encodes the d elements (N chunks) and decodes the N received chunks (d);
      phase 2 encodes this rank's reduced chunk (d/N) and decodes the N gathered chunks (d): (3 + 1/N) / 2.
    * all_gather (QSDP weights): encode this rank's shard (d/N), decode all N shards (d): (1 + 1/N) / 2.
    * reduce_scatter (QSDP gradients): encode the N rows (d), decode the N - 1 received ones (d - d/N; the own
      row stays exact): (2 - 1/N) / 2.
    """
    n = world_size
    if collective == "all_reduce":
        return (3 + 1 / n) / 2
    if collective == "all_gather":
        return (1 + 1 / n) / 2
    if collective == "reduce_scatter":
        return (2 - 1 / n) / 2
    raise ValueError(f"collective={collective!r} is not allowed; allowed: {', '.join(WORK_COLLECTIVES)}")


def step_seconds(bits: int, wire_bytes: float, codec_pairs: float, costs: WidthCosts) -> float:
    """T(bits) = W / R + P · c_bits of the module docstring (no codec work at 32 bits)."""
    work = 0.0 if bits == UNCOMPRESSED else codec_pairs * costs.codec_s_per_element[bits]
    return wire_bytes / costs.link_bytes_per_s + work


def fastest(times: Mapping[int, float]) -> int:
    """The width with the smallest predicted time; on a tie the wider one (more accurate)."""
    return min(times, key=lambda b: (times[b], -b))


def candidate_widths(min_bits: int) -> tuple[int, ...]:
    """32 and the widths of ``WIDTHS`` at or above ``min_bits``, widest first."""
    if not isinstance(min_bits, int) or isinstance(min_bits, bool) or min_bits not in WIDTHS:
        raise ValueError(f"min_bits={min_bits!r} is not allowed; allowed: {', '.join(map(str, sorted(WIDTHS)))}")
    return (UNCOMPRESSED, *(b for b in WIDTHS if b >= min_bits))


def _timed(fn, repeats: int) -> float:
    fn()  # warm: first-use work (kernel builds, caches, connections)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def measure_codec(
    bits: int,
    numel: int = PROBE_NUMEL,
    device: torch.device | None = None,
    repeats: int = 3,
    codec: str = AUTO_CODEC,
    bucket_size: int | None = None,
) -> float:
    """Seconds per element of one encode + decode with ``codec`` at ``bits`` on ``device`` (a Gaussian probe)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device or "cpu")
    code = get_codec(codec, bits=bits, **({} if bucket_size is None else {"bucket_size": bucket_size}))

    def roundtrip() -> None:
        code.decode(code.encode(x, seed=1))
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return _timed(roundtrip, repeats) / numel


def measure_link(group: dist.ProcessGroup | None, numel: int = PROBE_NUMEL, device=None, repeats: int = 3) -> float:
    """Bytes per second per direction of the fp32 all-reduce over ``group`` (collective; two ranks or more)."""
    world = dist.get_world_size(group)
    buf = torch.zeros(numel, device=device or "cpu")

    def all_reduce() -> None:
        dist.all_reduce(buf, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)

    return wire_bytes_formula("all_reduce", numel, world) / _timed(all_reduce, repeats)


def measure_widths(
    group: dist.ProcessGroup | None = None,
    min_bits: int = 4,
    device=None,
    codecs: Sequence[tuple[str, int | None]] = ((AUTO_CODEC, None),),
) -> tuple[WidthCosts, ...]:
    """The link once and every candidate width of each ``(codec name, bucket_size)`` in ``codecs``, on every
    rank, then the slowest figures agreed (one all-reduce MAX of the seconds): one ``WidthCosts`` per codec, the
    same everywhere. Collective. On one rank nothing travels: link ``inf``, codec 0, nothing is timed."""
    widths = [b for b in candidate_widths(min_bits) if b != UNCOMPRESSED]
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world <= 1:
        return tuple(WidthCosts(math.inf, dict.fromkeys(widths, 0.0)) for _ in codecs)
    link_s_per_byte = 1.0 / measure_link(group, device=device)
    codec_s = [measure_codec(b, device=device, codec=name, bucket_size=bs) for name, bs in codecs for b in widths]
    seconds = torch.tensor([link_s_per_byte, *codec_s], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    values = seconds.tolist()
    k = len(widths)
    return tuple(
        WidthCosts(1.0 / values[0], dict(zip(widths, values[1 + i * k : 1 + (i + 1) * k]))) for i in range(len(codecs))
    )


def format_costs(costs: WidthCosts) -> str:
    """The measurements, for a log line."""
    codec = ", ".join(f"{b}-bit {s * 1e9:.2f} ns/element" for b, s in sorted(costs.codec_s_per_element.items()))
    return f"link {costs.link_bytes_per_s / 1e6:.1f} MB/s, codec {codec}"


def format_times(times: Mapping[int, float]) -> str:
    """Every candidate's predicted time, for a log line."""
    return ", ".join(f"{b} bits {t * 1e3:.1f} ms" for b, t in times.items())


__all__ = [
    "AUTO_CODEC",
    "UNCOMPRESSED",
    "WIDTHS",
    "WidthCosts",
    "candidate_widths",
    "codec_work_factor",
    "fastest",
    "format_costs",
    "format_times",
    "measure_codec",
    "measure_link",
    "measure_widths",
    "step_seconds",
]
