"""What ``CommVolumeLogger`` reports, as plain functions of ledger totals: metrics, the summary table, JSON.

No Lightning here. ``Totals`` maps ``(op, tag)`` to ``OpTotals`` (calls, payload, wire and same-collective
fp32 baseline bytes, see ``comm.ledger``). The headline baseline is plain DDP in fp32:

    ddp_fp32_step_bytes(P, N) = 2(N-1)/N * 4 * P

the bytes one rank sends when a ring all-reduce averages the fp32 gradients of the ``P`` trainable
parameters once per optimizer step (what ``strategy="ddp"`` does), counted from the model, not assumed.
``vs_ddp`` = bytes sent / that baseline; the per-collective ``ratio`` compares each collective with the
same collective uncompressed (an all-gather with an fp32 all-gather), which says how well a codec
compresses but not what a method saves against DDP (QSDP gathers weights twice per step; Local SGD
sends fp32 but rarely).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_qcomm.comm.ledger import OpTotals, wire_factor

Totals = dict[tuple[str, str], OpTotals]
FP32_BYTES = 4
MB = 1e6


def ddp_fp32_step_bytes(trainable_numel: int, world_size: int) -> float:
    """Bytes one rank sends in DDP's fp32 ring all-reduce of ``trainable_numel`` gradients: 2(N-1)/N * 4 * P.

    Example::

        ddp_fp32_step_bytes(1000, 2)  # 4000.0
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return wire_factor("all_reduce", world_size) * FP32_BYTES * int(trainable_numel)


def diff_totals(now: Totals, before: Totals) -> Totals:
    """Per-key ``now - before`` (keys absent from ``before`` count from zero); zero-call keys dropped."""
    out: Totals = {}
    for key, t in now.items():
        b = before.get(key, OpTotals())
        d = OpTotals(
            t.calls - b.calls,
            t.payload_bytes - b.payload_bytes,
            t.wire_bytes - b.wire_bytes,
            t.baseline_bytes - b.baseline_bytes,
        )
        if d.calls:
            out[key] = d
    return out


def add_totals(a: Totals, b: Totals) -> Totals:
    """Per-key ``a + b`` (new objects)."""
    out = snapshot(a)
    for key, t in b.items():
        out.setdefault(key, OpTotals()).add(t)
    return out


def snapshot(totals: Totals) -> Totals:
    return {k: OpTotals(t.calls, t.payload_bytes, t.wire_bytes, t.baseline_bytes) for k, t in totals.items()}


def group_totals(totals: Totals, by: str) -> dict[str, OpTotals]:
    """Group by ``op`` or ``tag`` (untagged traffic is listed under ``untagged``), or everything as ``all``."""
    out: dict[str, OpTotals] = defaultdict(OpTotals)
    for (op, tag), t in totals.items():
        out[{"op": op, "tag": tag or "untagged", "all": "all"}[by]].add(t)
    return dict(out)


def overall(totals: Totals) -> OpTotals:
    return group_totals(totals, "all").get("all", OpTotals())


def totals_to_rows(totals: Totals) -> list[list]:
    """``[[op, tag, calls, payload, wire, baseline], ...]``: a checkpoint- and pickle-friendly form."""
    return [
        [op, tag, t.calls, t.payload_bytes, t.wire_bytes, t.baseline_bytes] for (op, tag), t in sorted(totals.items())
    ]


def totals_from_rows(rows: Sequence[Sequence]) -> Totals:
    return {(op, tag): OpTotals(int(c), int(p), float(w), float(b)) for op, tag, c, p, w, b in rows}


def metrics_from_totals(
    step: Totals,
    cumulative: Totals,
    per_op: bool,
    ddp_step_bytes: float | None = None,
    ddp_cum_bytes: float | None = None,
) -> dict[str, float]:
    """The metric dict logged for one step (names in ``CommVolumeLogger``'s module docstring).

    ``ddp_step_bytes`` / ``ddp_cum_bytes`` (the DDP-fp32 baseline of this step / since training start) add
    ``comm/ddp_bytes``, ``comm/vs_ddp``, ``comm/cum_ddp_bytes``, ``comm/cum_vs_ddp`` when positive.
    """
    s, c = overall(step), overall(cumulative)
    m = {
        "comm/bytes_sent": s.wire_bytes,
        "comm/baseline_bytes": s.baseline_bytes,
        "comm/ratio": s.ratio,
        "comm/collectives": float(s.calls),
        "comm/cum_bytes_sent": c.wire_bytes,
        "comm/cum_baseline_bytes": c.baseline_bytes,
        "comm/cum_ratio": c.ratio,
    }
    if ddp_step_bytes:
        m["comm/ddp_bytes"] = ddp_step_bytes
        m["comm/vs_ddp"] = s.wire_bytes / ddp_step_bytes
    if ddp_cum_bytes:
        m["comm/cum_ddp_bytes"] = ddp_cum_bytes
        m["comm/cum_vs_ddp"] = c.wire_bytes / ddp_cum_bytes
    if per_op:
        for by in ("op", "tag"):
            for name, t in sorted(group_totals(step, by).items()):
                prefix = f"comm/{by}/{name}"
                m[f"{prefix}/bytes_sent"] = t.wire_bytes
                m[f"{prefix}/baseline_bytes"] = t.baseline_bytes
                if t.baseline_bytes or not t.wire_bytes:  # no ratio for pure overhead (baseline 0)
                    m[f"{prefix}/ratio"] = t.ratio
                m[f"{prefix}/collectives"] = float(t.calls)
    return m


def vs_ddp_line(train_sent: float, ddp_bytes: float, trainable_numel: int) -> str:
    """The headline: what training steps sent against DDP fp32's ring all-reduce of the trainable parameters."""
    if ddp_bytes <= 0:
        return "vs DDP fp32: no baseline (a single process sends nothing under DDP)"
    r = train_sent / ddp_bytes
    fewer = f"{1 / r:.1f}x fewer" if r > 0 else "nothing sent"
    return (
        f"vs DDP fp32: training steps sent {train_sent / MB:.3f} MB; DDP fp32 would send {ddp_bytes / MB:.3f} MB "
        f"(ring all-reduce of {trainable_numel:,} trainable parameters per optimizer step) -> {r:.3f} ({fewer})"
    )


def format_summary(
    totals: Totals, world_size: int, steps: int, extra: dict[str, float] | None = None, notes: Sequence[str] = ()
) -> str:
    """A plain-text table of ``totals`` (already summed over ranks) grouped by op, by tag, and overall.

    ``notes`` (the vs-DDP headline, Local SGD's syncs, 1-bit Adam's phase) are printed above the table.
    """
    header = f"{'group':<6} {'name':<16} {'calls':>8} {'sent MB':>12} {'fp32 MB':>12} {'ratio':>7} {'saving':>8}"
    lines = [
        f"lightning_qcomm communication summary: {world_size} rank(s), {steps} optimizer steps, "
        "bytes summed over ranks (wire estimate)",
        *notes,
        "per collective, against the same collective uncompressed in fp32 (all traffic since training start):",
        header,
        "-" * len(header),
    ]

    def row(group: str, name: str, t: OpTotals) -> str:
        if t.baseline_bytes == 0 and t.wire_bytes > 0:  # pure overhead (e.g. a metadata check): no ratio
            ratio, saving = "-", "-"
        else:
            ratio, saving = f"{t.ratio:.3f}", (f"{1 / t.ratio:.1f}x" if t.ratio > 0 else "inf")
        return f"{group:<6} {name:<16} {t.calls:>8d} {t.wire_bytes / MB:>12.3f} {t.baseline_bytes / MB:>12.3f} {ratio:>7} {saving:>8}"

    for by in ("op", "tag"):
        for name, t in sorted(group_totals(totals, by).items()):
            lines.append(row(by, name, t))
    lines.append("-" * len(header))
    lines.append(row("total", "", overall(totals)))
    if not totals:
        lines.append("(no collective was recorded)")
    for name, value in sorted((extra or {}).items()):
        lines.append(f"{name} = {value:.4f}")
    return "\n".join(lines)


def aggregate_over_ranks(
    totals: Totals, device: torch.device, scalars: Sequence[float] = ()
) -> tuple[Totals, list[float]]:
    """Sum ``totals`` and ``scalars`` over all ranks (keys unioned with ``all_gather_object``; one fp64 all-reduce).

    Every rank must call this. These two collectives are deliberately not recorded in the ledger.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return snapshot(totals), [float(x) for x in scalars]
    key_lists: list[list[tuple[str, str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(key_lists, sorted(totals))
    keys = sorted({tuple(k) for ks in key_lists for k in ks})
    flat = [v for k in keys for v in _as_numbers(totals.get(k, OpTotals()))] + [float(x) for x in scalars]
    values = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out_values = values.cpu().tolist()
    out: Totals = {}
    for i, key in enumerate(keys):
        calls, payload, wire, baseline = out_values[4 * i : 4 * i + 4]
        out[key] = OpTotals(int(round(calls)), int(round(payload)), wire, baseline)
    return out, out_values[4 * len(keys) :]


def _as_numbers(t: OpTotals) -> list[float]:
    return [float(t.calls), float(t.payload_bytes), t.wire_bytes, t.baseline_bytes]


def write_summary_json(
    path: str, totals: Totals, world_size: int, steps: int, extra: dict[str, float], headline: dict | None = None
) -> None:
    """JSON with ``total``, ``by_op``, ``by_tag`` (each calls/payload_bytes/wire_bytes/baseline_bytes/ratio),
    the headline ``vs_ddp`` block and any method notes given in ``headline``, and the final ``metrics``."""

    def as_dict(t: OpTotals) -> dict[str, float]:
        return {
            "calls": t.calls,
            "payload_bytes": t.payload_bytes,
            "wire_bytes": t.wire_bytes,
            "baseline_bytes": t.baseline_bytes,
            "ratio": t.ratio,
        }

    doc = {
        "world_size": world_size,
        "optimizer_steps": steps,
        "total": as_dict(overall(totals)),
        "by_op": {k: as_dict(v) for k, v in sorted(group_totals(totals, "op").items())},
        "by_tag": {k: as_dict(v) for k, v in sorted(group_totals(totals, "tag").items())},
        "metrics": {k: v for k, v in extra.items() if math.isfinite(v)},
        **(headline or {}),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True))
