"""The fidelity benchmark's report: per-method summary against its baseline, the markdown table and the plot.

Input is the JSON ``benchmarks/fidelity.py`` writes (``runs``: one entry per method and seed with the
validation loss at every evaluation step). For each method with a baseline:

* final validation loss: mean ± sample standard deviation over its seeds (± only with 2+ seeds);
* the baseline's over the *same* seeds (paired: same initial weights and data order), and the relative gap
  100 · (mean_method - mean_baseline) / mean_baseline;
* pass/fail against ``Method.goal_pct`` (gap <= goal), only when every seed of the method has its baseline.

Nothing here trains; ``python -m benchmarks.fidelity --render JSON`` rebuilds the report from the JSON alone.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.fidelity_methods import METHOD_BY_NAME


def run_key(method: str, seed: int) -> str:
    return f"{method}/seed{seed}"


def _mean_std(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _fmt(mean: float, std: float | None) -> str:
    return f"{mean:.4f} ± {std:.4f}" if std is not None else f"{mean:.4f}"


def _seeds_of(runs: dict[str, Any], method: str) -> list[int]:
    return sorted(r["seed"] for r in runs.values() if r["method"] == method)


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One summary row per method that has at least one finished run (see the module doc)."""
    runs = data["runs"]
    ddp_bytes = [r["wire_bytes_per_step"] for r in runs.values() if r["method"] == "ddp_fp32"]
    rows: dict[str, dict[str, Any]] = {}
    for name, method in METHOD_BY_NAME.items():
        seeds = _seeds_of(runs, name)
        if not seeds:
            continue
        finals = [runs[run_key(name, s)]["val_loss"][-1] for s in seeds]
        row: dict[str, Any] = {"method": name, "label": method.label, "baseline": method.baseline, "seeds": seeds}
        row["final_mean"], row["final_std"] = _mean_std(finals)
        row["step_median_ms"] = 1e3 * statistics.median(runs[run_key(name, s)]["step_median_s"] for s in seeds)
        per_step = statistics.fmean(runs[run_key(name, s)]["wire_bytes_per_step"] for s in seeds)
        row["bytes_vs_ddp"] = per_step / statistics.fmean(ddp_bytes) if ddp_bytes else None
        row["gap_pct"] = row["passed"] = row["base_mean"] = row["base_std"] = None
        row["goal_pct"], row["paired_gaps_pct"] = method.goal_pct, []
        if method.baseline is not None:
            paired = [s for s in seeds if run_key(method.baseline, s) in runs]
            if paired:
                base = [runs[run_key(method.baseline, s)]["val_loss"][-1] for s in paired]
                mine = [runs[run_key(name, s)]["val_loss"][-1] for s in paired]
                row["base_mean"], row["base_std"] = _mean_std(base)
                row["gap_pct"] = 100.0 * (statistics.fmean(mine) - row["base_mean"]) / row["base_mean"]
                row["paired_gaps_pct"] = [100.0 * (m - b) / b for m, b in zip(mine, base)]
                if method.goal_pct is not None and len(paired) == len(seeds):
                    row["passed"] = row["gap_pct"] <= method.goal_pct
        rows[name] = row
    return rows


def _goal_text(goal: float | None) -> str:
    if goal is None:
        return "—"
    return "≤ baseline" if goal == 0 else f"≤ +{goal:g}%"


def render_markdown(data: dict[str, Any], scheduled: list[tuple[str, int]] | None = None) -> str:
    """The table (one row per method), the validation loss at a few steps, what failed and what is missing."""
    meta, rows = data["meta"], summarize(data)
    cfg = meta["config"]
    lines = [
        f"# Fidelity over a full run: `{meta['name']}`",
        "",
        f"```bash\n{meta['command']}\n```",
        "",
        f"Code {meta.get('commit', '?')}, {meta.get('started', '?')}; torch {meta.get('torch', '?')}, "
        f"lightning {meta.get('lightning', '?')}. 2 gloo ranks on loopback (no shaping), one core and "
        "`OMP_NUM_THREADS=1` per rank, denormals flushed.",
        "",
        f"Model: bench_model GPT preset `{cfg['preset']}` ({meta.get('params', 0):,} parameters), byte-level, "
        f"{cfg['batch_size']} windows of {meta.get('seq_len', '?')} bytes per rank per step, AdamW peak lr "
        f"{cfg['lr']:g}, {cfg['lr_warmup']} warm-up steps then cosine to 10%, {cfg['steps']} optimizer steps. "
        f"Data: the stdlib sources ({meta.get('train_bytes', 0):,} training bytes, the last "
        f"{meta.get('val_bytes', 0):,} held out); validation = mean next-byte cross-entropy (nats) over "
        f"{cfg['val_windows']} fixed held-out windows, every {cfg['eval_every']} steps. OneBitAdam freezes at step "
        f"{meta.get('phases', {}).get('onebit_freeze', '?')}; post-local SGD switches at step "
        f"{meta.get('phases', {}).get('post_local_switch', '?')}. Local SGD averages the replicas before each "
        "evaluation (LocalSGDStrategy's documented sync point: the evaluated model is the average).",
        "",
        "Gap = (method − baseline) / baseline of the final validation loss, means over the same seeds (same "
        "initial weights and data order). Bytes = the ledger's wire bytes per step over the whole run, against "
        "DDP fp32's. Step ms: median training step on loopback (indicative only; netbench times the link).",
        "",
        "| method | seeds | final val loss | baseline | baseline val loss | gap | per-seed gaps | goal | pass | "
        "bytes vs DDP | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        gap = f"{r['gap_pct']:+.2f}%" if r["gap_pct"] is not None else "—"
        per_seed = " / ".join(f"{g:+.2f}%" for g in r["paired_gaps_pct"]) or "—"
        base = _fmt(r["base_mean"], r["base_std"]) if r["base_mean"] is not None else "—"
        passed = {None: "—", True: "**pass**", False: "**FAIL**"}[r["passed"]]
        ratio = f"{r['bytes_vs_ddp']:.3f}" if r["bytes_vs_ddp"] is not None else "—"
        lines.append(
            f"| {name} | {len(r['seeds'])} | {_fmt(r['final_mean'], r['final_std'])} | {r['baseline'] or '—'} | "
            f"{base} | {gap} | {per_seed} | {_goal_text(r['goal_pct'])} | {passed} | {ratio} | "
            f"{r['step_median_ms']:.1f} |"
        )
    lines += ["", *_curve_table(data), "", "Methods:", ""]
    lines += [f"* `{name}`: {METHOD_BY_NAME[name].label}{_syncs(data['runs'], name)}" for name in rows]
    if data.get("errors"):
        lines += ["", "Failed configurations:", ""]
        lines += [f"* `{k}`: {last_line(v)}" for k, v in sorted(data["errors"].items())]
    missing = [run_key(m, s) for m, s in (scheduled or []) if run_key(m, s) not in data["runs"]]
    if missing:
        lines += ["", f"Not run yet: {', '.join(f'`{k}`' for k in missing)}."]
    return "\n".join(lines) + "\n"


def last_line(text: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "?")[:300]


def _syncs(runs: dict[str, Any], method: str) -> str:
    """Local SGD's averages per run (mean over seeds), scheduled and forced by evaluation."""
    mine = [r for r in runs.values() if r["method"] == method and "num_syncs" in r]
    if not mine:
        return ""
    steps = mine[0]["eval_steps"][-1]
    syncs = statistics.fmean(r["num_syncs"] for r in mine)
    forced = statistics.fmean(r.get("num_forced_syncs", 0) for r in mine)
    return (
        f"; {syncs:.1f} scheduled averages in {steps} steps ({100 * syncs / steps:.1f}% of the steps), plus "
        f"{forced:.1f} before evaluations or at the end"
    )


def _curve_table(data: dict[str, Any]) -> list[str]:
    """Mean validation loss over seeds at 5 evenly spaced evaluation steps (the plot's numbers)."""
    runs = data["runs"]
    if not runs:
        return []
    steps = next(iter(runs.values()))["eval_steps"]
    picks = sorted({steps[round(i * (len(steps) - 1) / 4)] for i in range(5)})
    lines = ["| method | " + " | ".join(f"val @ {s}" for s in picks) + " |", "|---" * (len(picks) + 1) + "|"]
    for name in METHOD_BY_NAME:
        curves = [r for r in runs.values() if r["method"] == name]
        if curves:
            means = [statistics.fmean(c["val_loss"][c["eval_steps"].index(s)] for c in curves) for s in picks]
            lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in means) + " |")
    return lines


def estimate(probe: dict[str, Any], planned: list[tuple[str, int]], cfg: dict[str, Any]) -> tuple[list[str], float]:
    """Seconds the ``planned`` runs under ``cfg`` should take, from a short probe run's per-method figures.

    Per run: set-up (the probe's fit time less its steps and evaluations) + steps x the probe's median step
    + evaluations x the probe's time per evaluation, scaled by the ratio of validation windows. A method
    missing from the probe is reported and left out of the total."""
    pcfg = probe["meta"]["config"]
    lines, total = [], 0.0
    for key in ("preset", "batch_size"):
        if pcfg[key] != cfg[key]:
            lines.append(
                f"warning: the probe ran {key}={pcfg[key]!r}, this run {cfg[key]!r}: its step times do not apply"
            )
    for name in dict.fromkeys(m for m, _ in planned):
        runs = [r for r in probe["runs"].values() if r["method"] == name]
        n = sum(1 for m, _ in planned if m == name)
        if not runs:
            lines.append(f"{name:<16} x{n}: not in the probe")
            continue
        step = min(r["step_median_s"] for r in runs)
        per_eval = min(r["eval_s"] / len(r["eval_steps"]) for r in runs) * cfg["val_windows"] / pcfg["val_windows"]
        setup = min(max(0.0, r["fit_s"] - pcfg["steps"] * r["step_median_s"] - r["eval_s"]) for r in runs)
        one = setup + cfg["steps"] * step + (cfg["steps"] // cfg["eval_every"] + 1) * per_eval
        total += n * one
        lines.append(
            f"{name:<16} x{n}: step {1e3 * step:6.1f} ms, eval {per_eval:5.2f} s, set-up {setup:4.1f} s"
            f" -> {one / 60:5.1f} min per run, {n * one / 60:5.1f} min"
        )
    return lines, total


def plot(data: dict[str, Any], out: Path) -> Path | None:
    """One panel per compared method: its validation loss per seed and mean, and its baseline's mean (dashed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"[fidelity] matplotlib is not installed: {out} not drawn", flush=True)
        return None
    runs = data["runs"]
    compared = [m for m in METHOD_BY_NAME.values() if m.baseline and any(r["method"] == m.name for r in runs.values())]
    if not compared:
        return None
    cols = min(4, len(compared))
    nrows = -(-len(compared) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, method in enumerate(compared):
        ax = fig.add_subplot(nrows, cols, i + 1)
        lows, tops = [], []
        for name, style in ((method.baseline, "--"), (method.name, "-")):
            curves = [r for r in runs.values() if r["method"] == name]
            if not curves:
                continue
            steps = curves[0]["eval_steps"]
            mean = [statistics.fmean(c["val_loss"][j] for c in curves) for j in range(len(steps))]
            (line,) = ax.plot(steps, mean, style, label=f"{name} (n={len(curves)})")
            if len(curves) > 1 and name == method.name:
                for c in curves:
                    ax.plot(c["eval_steps"], c["val_loss"], color=line.get_color(), alpha=0.3, lw=0.8)
            lows.append(min(mean))
            tops.append(max(mean[max(1, len(mean) // 10) :]))  # from ~10% in: the early drop is off the top
        low, top = min(lows), max(tops)
        if top > low:
            ax.set_ylim(low - 0.05 * (top - low), top)
        ax.set_title(method.name, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['meta']['name']}: validation loss vs step, each method against its baseline")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


__all__ = ["estimate", "last_line", "plot", "render_markdown", "run_key", "summarize"]
