"""netbench report: raw per-rank results -> per-variant figures, markdown tables and a PNG plot.

Per (rate, variant), for each repeat: step time = the slower rank's (max over ranks); wire = max
over ranks of veth tx bytes per step (each direction has its own shaper, so the busier sender sets
the pace); ledger and wire/ledger use means over ranks. Across repeats: medians, and the min-max of
the step time. Then, within one rate:

    speedup  = T(ddp_fp32) / T(variant)            bytes vs fp32 = wire(variant) / wire(ddp_fp32)
    ideal    = T(floor) + wire(variant) / (rate in bytes/s)
    eff      = ideal / T(variant)                   (goal >= 0.85)

and the floor check: T(floor) <= T of every communicating variant, else the run is flagged.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from benchmarks.netbench.variants import BASELINE, VARIANT_BY_NAME

MIN_LEDGER_FOR_RATIO = 1024.0  # bytes/step; below this wire/ledger is header noise, not a check


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _per_repeat(rr: list[dict]) -> dict:
    vals = [r["val_loss"] for r in rr]
    return {
        "step_median_s": max(r["step_median_s"] for r in rr),
        "step_mean_s": max(r["step_mean_s"] for r in rr),
        "tx_max": max(r["tx_per_step"] for r in rr),
        "tx_mean": statistics.fmean(r["tx_per_step"] for r in rr),
        "ledger_mean": statistics.fmean(r["ledger_per_step"] for r in rr),
        "train_loss": statistics.fmean(r["train_loss_last5"] for r in rr),
        "val_loss": statistics.fmean(vals) if all(v is not None for v in vals) else None,
    }


def collect_rows(results: list[dict], rate: float | None, names: list[str], per_repeat=_per_repeat) -> dict:
    """``{variant: figures}`` at one rate: ``per_repeat`` of each repeat's rank records, the median over repeats,
    with the repeat count, the spread of the mean step, the ledger source and any errors."""
    rows: dict[str, dict] = {}
    for name in names:
        mine = [r for r in results if r["variant"] == name and r.get("rate_mbit") == rate]
        done = [r for r in mine if r.get("event") == "done"]
        errs = [r for r in mine if r.get("event") == "error"]
        per_rep = [per_repeat([r for r in done if r["repeat"] == rep]) for rep in sorted({r["repeat"] for r in done})]
        if not per_rep:
            if errs:
                rows[name] = {"error": errs[0]["error"]}
            continue
        agg: dict[str, Any] = {k: _med([p[k] for p in per_rep if p[k] is not None]) for k in per_rep[0]}
        agg["repeats"] = len(per_rep)
        agg["step_mean_spread_s"] = [min(p["step_mean_s"] for p in per_rep), max(p["step_mean_s"] for p in per_rep)]
        agg["ledger_source"] = done[0]["ledger_source"]
        if errs:
            agg["errors"] = [e["error"] for e in errs]
        rows[name] = agg
    return rows


def floor_entry(rows: dict) -> dict:
    """``{"rows", "floor_s", "floor_sound"}``: the floor is sound when no communicating variant beats it."""
    floor = rows.get("floor", {}).get("step_mean_s")
    comm = [r["step_mean_s"] for n, r in rows.items() if n != "floor" and "step_mean_s" in r]
    sound = (floor <= min(comm)) if (floor is not None and comm) else None
    return {"rows": rows, "floor_s": floor, "floor_sound": sound}


def aggregate(results: list[dict], rates: list[float | None], names: list[str]) -> dict:
    """``{str(rate): {"rows": {variant: figures}, "floor_s", "floor_sound"}}`` (see module doc)."""
    table: dict = {}
    for rate in rates:
        rows = collect_rows(results, rate, names)
        floor = rows.get("floor", {}).get("step_mean_s")
        base = rows.get(BASELINE, {})
        for row in rows.values():
            if "step_mean_s" not in row:
                continue
            ok = row["ledger_mean"] >= MIN_LEDGER_FOR_RATIO
            row["wire_over_ledger"] = row["tx_mean"] / row["ledger_mean"] if ok else None
            if base.get("step_mean_s"):
                row["speedup_vs_fp32"] = base["step_mean_s"] / row["step_mean_s"]
                row["bytes_vs_fp32"] = row["tx_max"] / base["tx_max"] if base["tx_max"] > 0 else None
            if rate is not None and floor:
                wire_s = row["tx_max"] / (rate * 1e6 / 8)
                row["ideal_s"] = floor + wire_s
                row["efficiency"] = row["ideal_s"] / row["step_mean_s"]
                row["limit_s"] = max(floor, wire_s)  # communication fully hidden behind compute
                row["over_limit"] = row["step_mean_s"] / row["limit_s"]
        table[str(rate)] = floor_entry(rows)
    return table


def auto_choices(results: list[dict]) -> list[str]:
    """One line per ``auto`` run (rank 0): variant, rate, repeat and what it chose."""
    done = [r for r in results if r.get("event") == "done" and r.get("rank") == 0 and r.get("auto_choice")]
    return [
        f"`{r['variant']}` at {r.get('rate_mbit') or 'loopback'} Mbit/s, repeat {r['repeat']}: {r['auto_choice']}"
        for r in done
    ]


def _fmt(x: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x * scale, spec)


def render_markdown(table: dict, meta: dict, names: list[str]) -> str:
    """The report: header (command, machine, network, model), one table per rate, variants, notes."""
    lines = [f"# netbench: compression methods on a rate-limited link ({meta['date']})", ""]
    if meta.get("note"):
        lines += [f"**{meta['note']}**", ""]
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Network: {meta['network']}  ",
        f"Model: {meta['model']}; batch {meta['batch_size']} x {meta['seq_len']} tokens per rank; "
        f"{meta['steps']} steps, the first {meta['warmup']} untimed; {meta['repeats']} interleaved repeats; "
        f"torch threads per rank {meta['threads']}, pinned to own core {meta['pinned']}, "
        f"flush_denormal {meta['flush_denormal']}.  ",
        f"Duration: {meta['duration_s']:.0f} s.",
        "",
        "Columns: step = the slower rank's mean step time over the timed window (median over repeats, "
        "[min-max] over repeats); median = median step duration; wire = veth tx bytes per step (max over "
        "ranks); ledger = ledger wire estimate per step (mean over ranks); wire/ledger (mean over ranks; "
        "goal within 10%); ideal = floor + wire / rate; eff = ideal / step (goal >= 0.85); limit = max(floor, "
        "wire / rate), the step with its communication fully hidden; /limit = step / limit; loss = training "
        "loss, mean of the last 5 steps and of the ranks; val = validation loss after the last step "
        "(the floor trains each rank on its own data, so its losses are not comparable).",
        "",
    ]
    for rate, block in table.items():
        rows = block["rows"]
        lines += [f"## {float(rate):g} Mbit/s per direction" if rate != "None" else "## unshaped loopback", ""]
        if block["floor_sound"] is False:
            lines += [
                "**WARNING: the compute floor was slower than a communicating variant in this run (noise); "
                "efficiencies are unreliable.**",
                "",
            ]
        elif block["floor_sound"]:
            lines += ["Floor check passed: the compute floor is faster than every communicating variant.", ""]
        lines += [
            "| variant | step ms [min-max] | median ms | speedup vs DDP fp32 | wire MB/step | bytes vs fp32 "
            "| ledger MB/step | wire/ledger | ideal ms | eff | limit ms | /limit | loss | val |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in names:
            r = rows.get(name)
            if r is None:
                continue
            if "step_mean_s" not in r:
                lines.append(f"| {name} | FAILED: {r['error'][:100]} |" + " |" * 12)
                continue
            lo, hi = r["step_mean_spread_s"]
            shown = f"{name} ({len(r['errors'])} failed, {r['repeats']} ok)" if r.get("errors") else name
            lines.append(
                f"| {shown} | {_fmt(r['step_mean_s'], '.0f', 1e3)} [{_fmt(lo, '.0f', 1e3)}-{_fmt(hi, '.0f', 1e3)}] "
                f"| {_fmt(r['step_median_s'], '.0f', 1e3)} | {_fmt(r.get('speedup_vs_fp32'), '.2f')}{'x' * ('speedup_vs_fp32' in r)} "
                f"| {_fmt(r['tx_max'], '.3f', 1e-6)} | {_fmt(r.get('bytes_vs_fp32'), '.3f')} "
                f"| {_fmt(r['ledger_mean'], '.3f', 1e-6)} | {_fmt(r.get('wire_over_ledger'), '.3f')} "
                f"| {_fmt(r.get('ideal_s'), '.0f', 1e3)} | {_fmt(r.get('efficiency'))} "
                f"| {_fmt(r.get('limit_s'), '.0f', 1e3)} | {_fmt(r.get('over_limit'))} "
                f"| {_fmt(r['train_loss'], '.3f')} | {_fmt(r['val_loss'], '.3f')} |"
            )
        lines.append("")
    lines += ["## Variants", ""]
    lines += [f"- `{n}`: {VARIANT_BY_NAME[n].label}" for n in names]
    if meta.get("auto_choices"):
        lines += ["", "What the `auto` variants chose (rank 0, each rate and repeat):", ""]
        lines += [f"- {line}" for line in meta["auto_choices"]]
    if meta["skipped"]:
        lines += ["", "Skipped (not landed / not importable):", ""]
        lines += [f"- `{n}`: {why[:300]}" for n, why in meta["skipped"].items()]
    lines += [
        "",
        "Ledger sources: lightning_qcomm variants report their own `CommLedger`; torch's hooks, FSDP2 and the "
        "post-local SGD averager are counted by wrapping the `torch.distributed` collectives in the worker. "
        "Wire bytes are whole frames: TCP/IP/Ethernet headers and the ACKs for the peer's traffic are included.",
        "",
        "Known gap between wire and ledger: gloo (CPU) runs `reduce_scatter` as a full all-reduce - a 16 MB "
        "`reduce_scatter_tensor` between two namespaces sends 16.0 MB per rank where the bandwidth-optimal "
        "(ledger) figure is (N-1)/N x 16 = 8 MB - so FSDP2's gradient reduce-scatter costs twice its textbook "
        "bytes here and the fsdp2 rows show wire/ledger ~1.4. NCCL does not have this overhead.",
    ]
    if meta.get("link_checks"):
        checks = "; ".join(f"{k} Mbit/s -> {v.get('goodput_mbit')} Mbit/s" for k, v in meta["link_checks"].items())
        lines += ["", f"Link check (TCP goodput ns0 -> ns1 after shaping): {checks}."]
    return "\n".join(lines) + "\n"


def plot(table: dict, names: list[str], path: Path) -> bool:
    """Step time vs wire bytes and loss vs wire bytes, one marker per variant, one shade per rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[netbench] matplotlib not installed (pip install -e .[bench]); no plot.", flush=True)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    markers = "os^vD<>pP*hX"
    rates = list(table)
    for ri, rate in enumerate(rates):
        for i, name in enumerate(names):
            r = table[rate]["rows"].get(name)
            if not r or "step_mean_s" not in r:
                continue
            x = max(r["tx_max"], 1e3) / 1e6
            kw = {"marker": markers[i % len(markers)], "color": f"C{i % 10}", "alpha": 1.0 if ri == 0 else 0.45}
            axes[0].scatter(x, r["step_mean_s"] * 1e3, label=name if ri == 0 else None, **kw)
            axes[1].scatter(x, r["train_loss"], **kw)
    shade = " (solid: first rate, faded: others)" if len(rates) > 1 else ""
    rate_txt = ", ".join(f"{float(r):g} Mbit/s" if r != "None" else "loopback" for r in rates)
    axes[0].set(xscale="log", yscale="log", xlabel="wire MB / step / rank (veth tx)", ylabel="step time (ms)")
    axes[0].set_title(f"step time vs bytes - {rate_txt}{shade}", fontsize=9)
    axes[1].set(xscale="log", xlabel="wire MB / step / rank (veth tx)", ylabel="training loss (last 5 steps)")
    axes[1].set_title("loss vs bytes after the same steps", fontsize=9)
    fig.legend(loc="lower center", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine_line() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import lightning
        import torch

        vers = f", torch {torch.__version__}, lightning {lightning.__version__}"
    except ImportError:
        vers = ""
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}{vers}"
