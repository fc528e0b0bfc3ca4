"""``codec="auto"``: the gradient all-reduce's width chosen from the measured link and codec speeds (comm layer).

Compressing pays only when the wire time it saves exceeds the codec work it adds. For a step that all-reduces
d gradient elements over N ranks, with the link's measured rate R (bytes per second, per direction) and the
codec's measured encode + decode cost c_b (seconds per element at b bits, on this rank's CPU or device), the
predicted communication time is

    T(32) = W_fp32(d, N) / R                           (plain fp32 ring all-reduce)
    T(b)  = W_b(d, N) / R + k_N · c_b · d              (the two-phase compressed all-reduce)

with W the wire bytes of ``comm.wire_bytes.wire_bytes_formula`` and k_N = (3 + 1/N) / 2 the encode + decode
pairs per element of d that one rank runs (``codec_work_factor``). The codec work is added, not overlapped:
on a CPU rank it shares the core with the backward pass. ``choose_bits`` takes
the width with the smallest T among 32 and the allowed widths (``min_bits`` .. 8); a tie goes to the wider
one (more accurate). The decision is deterministic given the costs, and ``measure_costs`` makes the costs
identical on every rank (each rank measures, then one all-reduce keeps the maximum, the slowest rank's),
so every rank chooses the same width. The choice is made once, at setup, and logged with its measurements.

Example::

    costs = measure_costs(group)                                  # collective: every rank calls it
    bits = choose_bits(numel=3_300_000, world_size=2, costs=costs, min_bits=4)   # 32, 8, 4 or 2
"""

from __future__ import annotations

import logging
import time
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


@dataclass(frozen=True)
class WidthCosts:
    """Measured speeds: the link's rate per direction and each width's encode + decode seconds per element."""

    link_bytes_per_s: float
    codec_s_per_element: dict[int, float]


def codec_work_factor(world_size: int) -> float:
    """Encode + decode pairs per element of d in one compressed all-reduce over N ranks.

    Phase 1 encodes the d elements (N chunks) and decodes the N received chunks (d); phase 2 encodes this
    rank's reduced chunk (d/N) and decodes the N gathered chunks (d): 2d + d/N + d element-operations, i.e.
    (3 + 1/N) / 2 encode + decode pairs per element.
    """
    return (3 + 1 / world_size) / 2


def predicted_seconds(bits: int, numel: int, world_size: int, costs: WidthCosts, bucket_size: int = 512) -> float:
    """T(bits) of the module docstring (``bits=32``: the fp32 all-reduce, no codec work)."""
    if world_size <= 1:
        return 0.0
    if bits == UNCOMPRESSED:
        return wire_bytes_formula("all_reduce", numel, world_size) / costs.link_bytes_per_s
    codec = get_codec(AUTO_CODEC, bits=bits, bucket_size=bucket_size)
    wire = wire_bytes_formula("all_reduce", numel, world_size, codec)
    work = codec_work_factor(world_size) * costs.codec_s_per_element[bits] * numel
    return wire / costs.link_bytes_per_s + work


def candidate_widths(min_bits: int) -> tuple[int, ...]:
    """32 and the widths of ``WIDTHS`` at or above ``min_bits``, widest first."""
    if not isinstance(min_bits, int) or isinstance(min_bits, bool) or min_bits not in WIDTHS:
        raise ValueError(f"min_bits={min_bits!r} is not allowed; allowed: {', '.join(map(str, sorted(WIDTHS)))}")
    return (UNCOMPRESSED, *(b for b in WIDTHS if b >= min_bits))


def choose_bits(numel: int, world_size: int, costs: WidthCosts, min_bits: int = 4, bucket_size: int = 512) -> int:
    """The width with the smallest predicted time (ties: the wider one)."""
    best, best_t = UNCOMPRESSED, float("inf")
    for b in candidate_widths(min_bits):  # widest first: a strict < keeps the wider one on a tie
        t = predicted_seconds(b, numel, world_size, costs, bucket_size)
        if t < best_t:
            best, best_t = b, t
    return best


def _timed(fn, repeats: int) -> float:
    fn()  # warm: first-use work (kernel builds, caches, connections)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def measure_codec(bits: int, numel: int = PROBE_NUMEL, device: torch.device | None = None, repeats: int = 3) -> float:
    """Seconds per element of one encode + decode at ``bits`` on ``device`` (a Gaussian probe)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device or "cpu")
    codec = get_codec(AUTO_CODEC, bits=bits)

    def roundtrip() -> None:
        codec.decode(codec.encode(x, seed=1))
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return _timed(roundtrip, repeats) / numel


def measure_link(group: dist.ProcessGroup | None, numel: int = PROBE_NUMEL, device=None, repeats: int = 3) -> float:
    """Bytes per second per direction of the fp32 all-reduce over ``group`` (collective)."""
    world = dist.get_world_size(group)
    buf = torch.zeros(numel, device=device or "cpu")

    def all_reduce() -> None:
        dist.all_reduce(buf, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)

    return wire_bytes_formula("all_reduce", numel, world) / _timed(all_reduce, repeats)


def measure_costs(group: dist.ProcessGroup | None = None, min_bits: int = 4, device=None) -> WidthCosts:
    """Measure the link and every candidate width's codec on every rank, then agree on the slowest figures
    (one all-reduce MAX of the seconds), so the costs, and any choice made from them, are the same everywhere.
    Collective."""
    widths = [b for b in candidate_widths(min_bits) if b != UNCOMPRESSED]
    link_s_per_byte = 1.0 / measure_link(group, device=device)
    codec_s = [measure_codec(b, device=device) for b in widths]
    seconds = torch.tensor([link_s_per_byte, *codec_s], dtype=torch.float64, device=device or "cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    values = seconds.tolist()
    return WidthCosts(1.0 / values[0], dict(zip(widths, values[1:])))


def describe(bits: int, numel: int, world_size: int, costs: WidthCosts, min_bits: int, bucket_size: int) -> str:
    """One log line: the choice, the measurements and every candidate's predicted time."""
    times = ", ".join(
        f"{b} bits {predicted_seconds(b, numel, world_size, costs, bucket_size) * 1e3:.1f} ms"
        for b in candidate_widths(min_bits)
    )
    codec = ", ".join(f"{b}-bit {s * 1e9:.2f} ns/element" for b, s in sorted(costs.codec_s_per_element.items()))
    return (
        f"codec='auto' chose {'no compression (fp32)' if bits == UNCOMPRESSED else f'{AUTO_CODEC} {bits}-bit'} for "
        f"{numel} gradient elements over {world_size} ranks: link {costs.link_bytes_per_s / 1e6:.1f} MB/s, codec "
        f"{codec}; predicted per step: {times}"
    )


__all__ = [
    "AUTO_CODEC",
    "UNCOMPRESSED",
    "WIDTHS",
    "WidthCosts",
    "candidate_widths",
    "choose_bits",
    "codec_work_factor",
    "describe",
    "measure_codec",
    "measure_costs",
    "measure_link",
    "predicted_seconds",
]
