"""netbench report for two ranks per node (``--ranks-per-node 2``): per-node figures and the bound ratio.

Per (rate, variant), for each repeat: step time = the slowest rank's mean step (max over ranks); inter =
veth tx bytes per step of a node (both ranks of a node read the same counter: mean over the node's ranks),
max over nodes (each direction has its own shaper, so the busier sender sets the pace); intra = the node's
``lo`` tx bytes per step (max over nodes); ledger inter / flat = the ledger's ``inter`` / ``flat`` scope
summed over the node's ranks, mean over nodes. Across repeats: medians. Within one rate:

    speedup      = T(ddp_fp32) / T(variant)
    T_inter_wire = inter / (rate in bytes/s)
    bound ratio  = T(variant) / max(T(floor), T_inter_wire)      (the goal for hierarchical rows: <= 1.15)

and the floor check: T(floor) <= T of every communicating variant, else the run is flagged.
"""

from __future__ import annotations

import statistics

from benchmarks.netbench.report import _fmt, collect_rows, floor_entry
from benchmarks.netbench.variants import BASELINE, label_for


def _by_node(rr: list[dict], key: str) -> dict[int, float]:
    nodes = sorted({r["node"] for r in rr})
    return {n: statistics.fmean(r[key] for r in rr if r["node"] == n) for n in nodes}


def _sum_by_node(rr: list[dict], key: str) -> dict[int, float]:
    nodes = sorted({r["node"] for r in rr})
    return {n: sum(r[key] for r in rr if r["node"] == n) for n in nodes}


def _per_repeat(rr: list[dict]) -> dict:
    vals = [r["val_loss"] for r in rr]
    lo_missing = any(r["lo_tx_per_step"] is None for r in rr)
    return {
        "step_median_s": max(r["step_median_s"] for r in rr),
        "step_mean_s": max(r["step_mean_s"] for r in rr),
        "tx_max": max(_by_node(rr, "tx_per_step").values()),
        "intra_max": None if lo_missing else max(_by_node(rr, "lo_tx_per_step").values()),
        "ledger_inter": statistics.fmean(_sum_by_node(rr, "ledger_inter_per_step").values()),
        "ledger_flat": statistics.fmean(_sum_by_node(rr, "ledger_flat_per_step").values()),
        "train_loss": statistics.fmean(r["train_loss_last5"] for r in rr),
        "val_loss": statistics.fmean(vals) if all(v is not None for v in vals) else None,
    }


def aggregate_nodes(results: list[dict], rates: list[float | None], names: list[str]) -> dict:
    """``{str(rate): {"rows": {variant: figures}, "floor_s", "floor_sound"}}`` (see module doc)."""
    table: dict = {}
    for rate in rates:
        rows = collect_rows(results, rate, names, per_repeat=_per_repeat)
        floor = rows.get("floor", {}).get("step_mean_s")
        base = rows.get(BASELINE, {})
        for row in rows.values():
            if "step_mean_s" not in row:
                continue
            if base.get("step_mean_s"):
                row["speedup_vs_fp32"] = base["step_mean_s"] / row["step_mean_s"]
            if rate is not None and floor:
                row["t_inter_wire_s"] = row["tx_max"] / (rate * 1e6 / 8)
                row["bound_s"] = max(floor, row["t_inter_wire_s"])
                row["bound_ratio"] = row["step_mean_s"] / row["bound_s"]
        table[str(rate)] = floor_entry(rows)
    return table


def render_markdown_nodes(table: dict, meta: dict, names: list[str]) -> str:
    """The 2-node x 2-rank report: header, one table per rate, variants, notes."""
    rpn = meta["ranks_per_node"]
    lines = [f"# netbench: {meta['nodes']} nodes x {rpn} ranks on a rate-limited inter-node link ({meta['date']})", ""]
    if meta.get("note"):
        lines += [f"**{meta['note']}**", ""]
    pin = (
        "local rank i of every node pinned to core i (two ranks per core on 2 cores)" if meta["pinned"] else "unpinned"
    )
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Network: {meta['network']}"
        + ("; intra-node traffic on each namespace's own lo (unshaped)  " if meta["mode"] == "netns" else "  "),
        f"Model: {meta['model']}; batch {meta['batch_size']} x {meta['seq_len']} tokens per rank; "
        f"{meta['steps']} steps, the first {meta['warmup']} untimed; {meta['repeats']} interleaved repeats; "
        f"torch threads per rank {meta['threads']}, {pin}, flush_denormal {meta['flush_denormal']}.  ",
        f"Duration: {meta['duration_s']:.0f} s.",
        "",
        "Columns: step = the slowest rank's mean step time over the timed window (median over repeats, "
        "[min-max] over repeats); inter = veth tx bytes per step per node (max over nodes; on loopback: "
        "machine-wide lo counters halved, intra and inter mixed); ledger inter / flat = the ledger's inter-node "
        "scope / whole-world collectives (whose bytes cross the nodes too), summed over a node's ranks; intra = "
        "the node's lo tx bytes per step; T_wire = inter / rate; bound = measured / max(T_floor, T_wire) "
        "(goal for the hierarchical rows <= 1.15); loss = training loss, mean of the last 5 steps and of the "
        "ranks; val = validation loss after the last step (the floor trains each rank alone: not comparable).",
        "",
    ]
    for rate, block in table.items():
        rows = block["rows"]
        lines += [
            f"## {float(rate):g} Mbit/s per direction between nodes" if rate != "None" else "## unshaped loopback",
            "",
        ]
        if block["floor_sound"] is False:
            lines += ["**WARNING: the compute floor was slower than a communicating variant in this run (noise); "
                      "bound ratios are unreliable.**", ""]  # fmt: skip
        elif block["floor_sound"]:
            lines += ["Floor check passed: the compute floor is faster than every communicating variant.", ""]
        lines += [
            "| variant | step ms [min-max] | speedup vs DDP fp32 | inter MB/step/node (veth) | ledger inter MB "
            "| ledger flat MB | intra MB/step/node (lo) | T_wire ms | bound | loss | val |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in names:
            r = rows.get(name)
            if r is None:
                continue
            if "step_mean_s" not in r:
                lines.append(f"| {name} | FAILED: {r['error'][:100]} |" + " |" * 9)
                continue
            lo, hi = r["step_mean_spread_s"]
            shown = f"{name} ({len(r['errors'])} failed, {r['repeats']} ok)" if r.get("errors") else name
            sp = r.get("speedup_vs_fp32")
            lines.append(
                f"| {shown} | {_fmt(r['step_mean_s'], '.0f', 1e3)} [{_fmt(lo, '.0f', 1e3)}-{_fmt(hi, '.0f', 1e3)}] "
                f"| {_fmt(sp, '.2f')}{'x' * (sp is not None)} | {_fmt(r['tx_max'], '.3f', 1e-6)} "
                f"| {_fmt(r['ledger_inter'], '.3f', 1e-6)} | {_fmt(r['ledger_flat'], '.3f', 1e-6)} "
                f"| {_fmt(r['intra_max'], '.3f', 1e-6)} | {_fmt(r.get('t_inter_wire_s'), '.0f', 1e3)} "
                f"| {_fmt(r.get('bound_ratio'))} | {_fmt(r['train_loss'], '.3f')} | {_fmt(r['val_loss'], '.3f')} |"
            )
        lines.append("")
    lines += ["## Variants", ""]
    lines += [f"- `{n}`: {label_for(n, rpn)}" for n in names]
    if meta["skipped"]:
        lines += ["", "Skipped (not landed / not importable):", ""]
        lines += [f"- `{n}`: {why[:300]}" for n, why in meta["skipped"].items()]
    lines += [
        "",
        "Ledger sources: lightning_qcomm variants report their own `CommLedger` (hierarchical collectives tag "
        "their inter-node legs `@inter`); torch's hooks, FSDP2 and the post-local SGD averager are counted by "
        "wrapping the `torch.distributed` collectives in the worker, a sub-group inside one node as intra, one "
        "rank per node as inter, the whole world as flat. Wire bytes are whole frames: TCP/IP/Ethernet headers "
        "and the ACKs for the peer's traffic are included. A flat collective over 4 ranks sends part of its "
        "bytes inside a node (which part depends on gloo's ring order), so its veth bytes are below its ledger "
        "flat figure.",
    ]
    if meta.get("link_checks"):
        checks = "; ".join(f"{k} Mbit/s -> {v.get('goodput_mbit')} Mbit/s" for k, v in meta["link_checks"].items())
        lines += ["", f"Link check (TCP goodput ns0 -> ns1 after shaping): {checks}."]
    return "\n".join(lines) + "\n"


__all__ = ["aggregate_nodes", "render_markdown_nodes"]
