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

Scopes (``comm.ledger.scope_of``): the hierarchical collectives tag their traffic ``<purpose>@intra`` (inside a
node) or ``<purpose>@inter`` (between nodes). Grouping by tag sums a purpose's scopes; the table's ``intra MB``
and ``inter MB`` columns split each row by scope, and a flat collective (no suffix) is in neither column
(``sent MB`` minus the two): it runs over the whole group, across the nodes' links too when the world spans
several nodes. The same split is logged as ``comm/scope/<scope>/...`` and written as ``by_scope``.

Also here: what the summary says about the method (``summary_notes``: the vs-DDP headline, Local SGD's syncs,
1-bit Adam's phase), read duck-typed from the strategy and optimizers.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_qcomm.comm.ledger import OpTotals, purpose_of, scope_of, wire_factor

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
    """Group by ``op``, ``tag`` (the purpose, scopes summed; untagged traffic is listed under ``untagged``),
    ``scope`` (intra, inter, flat), or everything as ``all``."""
    out: dict[str, OpTotals] = defaultdict(OpTotals)
    for (op, tag), t in totals.items():
        key = {"op": op, "tag": purpose_of(tag) or "untagged", "scope": scope_of(tag), "all": "all"}[by]
        out[key].add(t)
    return dict(out)


def scope_split(totals: Totals, by: str) -> dict[str, dict[str, float]]:
    """Per ``by`` group (as ``group_totals``): wire bytes of each scope, ``{name: {"intra": b, "inter": b}}``."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"intra": 0.0, "inter": 0.0})
    for (op, tag), t in totals.items():
        name = {"op": op, "tag": purpose_of(tag) or "untagged", "scope": scope_of(tag), "all": "all"}[by]
        scope = scope_of(tag)
        out[name]  # a flat-only group still gets its (zero) entry
        if scope != "flat":
            out[name][scope] += t.wire_bytes
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
    for scope, t in sorted(group_totals(step, "scope").items()):
        m[f"comm/scope/{scope}/bytes_sent"] = t.wire_bytes
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
        f"vs DDP fp32 (this answers 'how much less than DDP'): training steps sent {train_sent / MB:.3f} MB; DDP fp32 "
        f"would send {ddp_bytes / MB:.3f} MB (ring all-reduce of {trainable_numel:,} trainable parameters per "
        f"optimizer step) -> {r:.3f} ({fewer})"
    )


def format_summary(
    totals: Totals, world_size: int, steps: int, extra: dict[str, float] | None = None, notes: Sequence[str] = ()
) -> str:
    """A plain-text table of ``totals`` (already summed over ranks) grouped by op, by tag, and overall.

    ``notes`` (the vs-DDP headline, Local SGD's syncs, 1-bit Adam's phase) are printed above the table.
    """
    header = (
        f"{'group':<6} {'name':<16} {'calls':>8} {'sent MB':>12} {'intra MB':>10} {'inter MB':>10} {'fp32 MB':>12} "
        f"{'ratio':>7} {'saving':>8}"
    )
    lines = [
        f"lightning_qcomm communication summary: {world_size} rank(s), {steps} optimizer steps, "
        "bytes summed over ranks (wire estimate)",
        *notes,
        "per collective, against the same collective uncompressed in fp32 (how well the codecs compress, not the "
        "saving against DDP; all traffic since training start); "
        "intra / inter: inside / between nodes (hierarchical collectives; flat ones are in neither):",
        header,
        "-" * len(header),
    ]

    def row(group: str, name: str, t: OpTotals, split: dict[str, float]) -> str:
        if t.baseline_bytes == 0 and t.wire_bytes > 0:  # pure overhead (e.g. a metadata check): no ratio
            ratio, saving = "-", "-"
        else:
            ratio, saving = f"{t.ratio:.3f}", (f"{1 / t.ratio:.1f}x" if t.ratio > 0 else "inf")
        return (
            f"{group:<6} {name:<16} {t.calls:>8d} {t.wire_bytes / MB:>12.3f} {split['intra'] / MB:>10.3f} "
            f"{split['inter'] / MB:>10.3f} {t.baseline_bytes / MB:>12.3f} {ratio:>7} {saving:>8}"
        )

    for by in ("op", "tag"):
        splits = scope_split(totals, by)
        for name, t in sorted(group_totals(totals, by).items()):
            lines.append(row(by, name, t, splits[name]))
    lines.append("-" * len(header))
    lines.append(row("total", "", overall(totals), scope_split(totals, "all").get("all", {"intra": 0.0, "inter": 0.0})))
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
    """JSON with ``total``, ``by_op``, ``by_tag``, ``by_scope`` (each calls/payload_bytes/wire_bytes/baseline_bytes/ratio),
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
        "by_scope": {k: as_dict(v) for k, v in sorted(group_totals(totals, "scope").items())},
        "metrics": {k: v for k, v in extra.items() if math.isfinite(v)},
        **(headline or {}),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True))


# ------------------------------------------------------------------------------------------- method notes
def local_sgd_info(strategy: Any, steps: int) -> dict[str, float] | None:
    """Syncs and mean H of a strategy that exposes ``num_syncs`` (LocalSGDStrategy), else None."""
    syncs = getattr(strategy, "num_syncs", None)
    if not isinstance(syncs, int):
        return None
    forced = getattr(strategy, "num_forced_syncs", 0)
    return {"syncs": syncs, "mean_h": steps / syncs if syncs else None, "forced_syncs": int(forced)}


def onebit_info(optimizers: list) -> dict[str, Any] | None:
    """Phase of an optimizer with ``frozen_at`` (OneBitAdam): warm-up until it is set, compressed after.

    ``last``: the optimizer step just taken was a compressed one (``num_steps > frozen_at``; the step at which
    the variance froze was still a warm-up step).
    """
    for opt in optimizers:
        if hasattr(opt, "frozen_at") and hasattr(opt, "num_steps"):
            frozen_at = opt.frozen_at
            last = frozen_at is not None and opt.num_steps > frozen_at
            return {"phase": "warm-up" if frozen_at is None else "compressed", "frozen_at": frozen_at, "last": last}
    return None


def summary_notes(
    strategy: Any,
    optimizers: list,
    steps: int,
    steps_counted: int,
    train_sent: float,
    ddp_bytes: float,
    trainable: int,
    outside: float,
) -> tuple[dict[str, Any], list[str]]:
    """(the summary's headline document, the lines printed above the table): vs DDP fp32, traffic outside
    training steps, Local SGD's syncs and 1-bit Adam's phase (``steps``: the trainer's global step)."""
    doc: dict[str, Any] = {
        "vs_ddp": {
            "train_wire_bytes": train_sent,
            "ddp_fp32_bytes": ddp_bytes,
            "ratio": train_sent / ddp_bytes if ddp_bytes else None,
            "trainable_params": trainable,
        }
    }
    notes = [vs_ddp_line(train_sent, ddp_bytes, trainable)]
    if outside > 0:
        notes.append(f"outside training steps (sanity check, validation): {outside / 1e6:.3f} MB more")
    sgd = local_sgd_info(strategy, steps_counted)
    if sgd is not None:
        doc["local_sgd"] = sgd
        mean_h = "no sync yet" if sgd["mean_h"] is None else f"mean H {sgd['mean_h']:.2f}"
        notes.append(
            f"Local SGD: {sgd['syncs']} parameter averages in {steps_counted} optimizer steps ({mean_h}), "
            f"{sgd['forced_syncs']} more before validation / checkpoint / end"
        )
    onebit = onebit_info(optimizers)
    if onebit is not None:
        doc["onebit_adam"] = {"phase": onebit["phase"], "frozen_at": onebit["frozen_at"]}
        k = onebit["frozen_at"]
        notes.append(
            f"1-bit Adam: still in the fp32 AdamW warm-up after {steps} optimizer steps"
            if k is None
            else f"1-bit Adam: warm-up (fp32 AdamW) for the first {k} optimizer steps, compressed since "
            f"(1-bit momentum for {steps - k} steps)"
        )
    return doc, notes
