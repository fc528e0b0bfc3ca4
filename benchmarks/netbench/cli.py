"""netbench: every compression method side by side on a real, rate-limited network (docs/design.md, "Benchmark regime").

    sudo python -m benchmarks.netbench --rates 100,1000 --steps 30 --repeats 2 --out benchmarks/results

This module owns the command line (run from the repository root); the network lives in ``net.py``, the
schedule and worker pairs in ``orchestrate.py``, the variants in ``variants.py`` (built by ``build.py``), the
measurement inside a rank in ``worker.py``, the tables and plot in ``report.py``, the shaped link in
``benchmarks/netns.py``, the model in ``benchmarks/bench_model.py``.

Network. As root: two network namespaces joined by a veth pair (``netns.shaped_link``; addresses
10.88.0.1 and 10.88.0.2, assigned only inside those namespaces), each end's egress shaped with
``tc qdisc ... tbf rate R``, so each direction carries at most R. Everything is torn down on exit,
on error and on Ctrl-C / SIGTERM / SIGHUP. Not root (or ``--loopback``): both ranks on 127.0.0.1,
unshaped, and the ``lo`` counters are machine-wide (other processes' loopback traffic is counted
too) - the report says so and computes no efficiency.

Job. One rank per namespace, started as a two-node Lightning job (``num_nodes=2, devices=1``, Lightning's
env-based ``LightningEnvironment``: MASTER_ADDR = ns0's address, MASTER_PORT, NODE_RANK, LOCAL_RANK=0,
WORLD_SIZE=2). Each rank is one long-lived worker that runs the whole interleaved schedule (every
variant, every repeat; odd repeats in reverse order) with a fresh ``Trainer`` per entry, so
interpreter start-up and rendezvous stay out of every timing. If a worker fails or stalls, both are
killed and a fresh pair resumes after the failed entry.

Two ranks per node (``--ranks-per-node 2``): each namespace hosts two ranks of a
``num_nodes=2, devices=2`` job (LOCAL_RANK 0/1, NODE_RANK = the namespace, WORLD_SIZE=4). All ranks of a
node bind gloo to their node's veth address, so traffic between two ranks of one node goes to a local
address and stays on that namespace's ``lo`` (unshaped), while inter-node traffic crosses the shaped veth.
The veth counters are per node (both ranks of a node read the same counter): inter-node bytes per step per
node, next to the ledger's ``inter`` scope summed over the node's ranks (``report_nodes``). Local rank i of
every node is pinned to core i, so on 2 cores each core runs one rank of each node (two per core). ``all``
runs ``variants.MULTI_RANK_ALL``: the flat rows next to their hierarchical / HSDP counterparts. Expected
duration of ``--rates 100,1000 --steps 14 --warmup 4 --repeats 1`` on 2 cores: ~10 min (an estimate from a
3-step smoke run on a shared machine: ~4 s per entry outside the steps, ~22 s per step over all 16 rows at
100 Mbit/s; ``--repeats 2`` doubles it).

Compute floor. The same two-node job with each rank training its own copy: no DDP wrapper, no
traffic (same launcher, processes, optimizer and data). ``floor_ddp`` (DDP with torch's no-op comm
hook) is kept as a reference: DDP's bucket copies and hooks cost ~20% of a step here, and strategies
without the DDP wrapper (LocalSGD) ran their non-sync steps faster than it, so it is not a lower bound.
Ranks run with OMP_NUM_THREADS=1 and one torch thread, each pinned to its own core (taskset) when
there are >= 2 cores, with ``torch.set_flush_denormal(True)``; ``--threads``, ``--no-pin`` and
``--no-flush-denormal`` reproduce the unsound set-ups (benchmarks/results/netbench_floor.md). The
report checks the floor is not slower than any other variant.

Expected duration (default variants, 2 repeats, 100 and 1000 Mbit/s) on this 2-core machine with
``--steps 20``: 764 s under light load, 1141 s under heavy load; ``--steps 30`` takes ~1.5x that
(~19 min quiet), so ``--steps 20`` fits a 15-minute budget. fp32 DDP and FSDP2 are link-bound at
100 Mbit/s (~1.1 and ~2.2 s per step) and the quantized strategies pay their CPU codec cost (up to
~1-2 s per step for 3.3M parameters with the torch reference codecs). Time scales with ``--steps``
and ``--repeats``; ``--variants`` trades coverage for time. The report states the run's duration.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench.build import variant_available
from benchmarks.netbench.net import make_net
from benchmarks.netbench.orchestrate import make_schedule, run_schedule
from benchmarks.netbench.report import aggregate, auto_choices, machine_line, plot, render_markdown
from benchmarks.netbench.report_nodes import aggregate_nodes, render_markdown_nodes
from benchmarks.netbench.variants import MULTI_RANK_ALL, VARIANT_BY_NAME, VARIANTS

__all__ = ["aggregate", "main", "make_schedule", "parse_args", "run_schedule"]

# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.netbench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s per direction, comma separated")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per entry (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per rate (default 2)")
    p.add_argument(
        "--variants",
        default="all",
        help=f"comma list or 'all' (ablations only by name): {','.join(VARIANT_BY_NAME)}",
    )
    p.add_argument("--nodes", type=int, default=2, help="nodes (network namespaces); only 2 is supported")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per node: 1 (default) or 2 (intra-node traffic on the namespace's lo, inter-node on the veth)",
    )
    p.add_argument("--model", default="bench", help="bench_model preset: bench (3.3M params), small, tiny")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (warm-up + cosine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads per rank (default 1)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank i to core i (taskset)")
    p.add_argument("--no-flush-denormal", action="store_true", help="keep denormals (to study their effect)")
    p.add_argument("--loopback", action="store_true", help="force the unshaped loopback fallback")
    p.add_argument("--out", default="benchmarks/results", help="output folder (default benchmarks/results)")
    p.add_argument("--name", default="netbench", help="output file stem: NAME.md, NAME.json, NAME.png")
    p.add_argument("--note", default="", help="a line shown at the top of the report (e.g. PRELIMINARY ...)")
    p.add_argument("--variant-timeout", type=float, default=600.0, help="kill a pair without progress (s)")
    p.add_argument("--collective-timeout", type=float, default=240.0, help="gloo collective timeout (s)")
    p.add_argument("--verbose", action="store_true", help="print worker tracebacks; keep the work folder")
    p.add_argument("--render", metavar="JSON", help="only re-render NAME.md/.png in --out from a previous run's JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.steps < 2 or not 1 <= args.warmup < args.steps:
        p.error(f"need --steps >= 2 and 1 <= --warmup < --steps, got steps={args.steps} warmup={args.warmup}")
    if args.repeats < 1 or args.threads < 1:
        p.error(f"--repeats and --threads must be >= 1, got {args.repeats}, {args.threads}")
    try:
        args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates must be comma-separated numbers (Mbit/s), got {args.rates!r}")
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        p.error(f"--rates must be positive, got {args.rates!r}")
    if args.nodes != 2 or args.ranks_per_node not in (1, 2):
        p.error(f"need --nodes 2 and --ranks-per-node 1 or 2, got {args.nodes}, {args.ranks_per_node}")
    if args.variants == "all":
        multi = args.ranks_per_node > 1
        args.variant_list = list(MULTI_RANK_ALL) if multi else [v.name for v in VARIANTS if v.in_all]
    else:
        args.variant_list = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in args.variant_list if n not in VARIANT_BY_NAME]
        if unknown:
            p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANT_BY_NAME)}")
        single = [n for n in args.variant_list if VARIANT_BY_NAME[n].multi_rank_only and args.ranks_per_node == 1]
        if single:
            p.error(f"--variants: {single} need --ranks-per-node 2 (hierarchical / HSDP rows)")
    return args


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(
    results: list[dict], rates: list[float | None], names: list[str], meta: dict, out: Path, name: str
) -> int:
    """Aggregate, write NAME.md / NAME.json / NAME.png under ``out``, print the markdown."""
    meta = {**meta, "auto_choices": auto_choices(results)}
    if meta.get("ranks_per_node", 1) > 1:
        table = aggregate_nodes(results, rates, names)
        md = render_markdown_nodes(table, meta, names)
    else:
        table = aggregate(results, rates, names)
        md = render_markdown(table, meta, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(md)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "table": table, "raw": results}, indent=1))
    plotted = plot(table, names, out / f"{name}.png")
    print(md, flush=True)
    print(f"[netbench] wrote {out / name}.md, .json" + (", .png" if plotted else ""), flush=True)
    return 0


def rerender(path: Path, out: Path, name: str) -> int:
    """Rebuild the report from a previous run's JSON (after a change to the report code)."""
    data = json.loads(path.read_text())
    meta, raw = data["meta"], data["raw"]
    rates = [None if k == "None" else float(k) for k in data["table"]]
    present = {r["variant"] for r in raw}
    names = meta.get("variants") or [v.name for v in VARIANTS if v.name in present]
    return write_report(raw, rates, names, meta, out, name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from benchmarks.netbench.worker import worker_main

        return worker_main(args.spec, args.rank, args.results)
    if args.render:
        return rerender(Path(args.render), Path(args.out), args.name)
    names, skipped = [], {}
    for n in args.variant_list:
        ok, why = variant_available(VARIANT_BY_NAME[n])
        if ok:
            names.append(n)
        else:
            skipped[n] = why
    if skipped:
        print(f"[netbench] skipped (not landed): {', '.join(skipped)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    net = make_net(args, args.rate_list[0])
    rates: list[float | None] = list(args.rate_list) if net.shaped else [None]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    t_start = time.time()
    results: list[dict] = []
    link_checks: dict = {}
    interrupted = False
    workdir = Path(tempfile.mkdtemp(prefix="netbench_"))
    try:
        with net:
            for rate in rates:
                net.shape(rate)
                if net.shaped:
                    link_checks[f"{rate:g}"] = net.link_check(rate)
                    print(f"[netbench] link check at {rate:g} Mbit/s: {link_checks[f'{rate:g}']}", flush=True)
                results += run_schedule(net, rate, make_schedule(names, args.repeats), args, workdir)
    except KeyboardInterrupt:
        interrupted = True
        print("[netbench] interrupted: workers killed, namespaces deleted; writing partial results.", flush=True)
    finally:
        if args.verbose:
            print(f"[netbench] worker logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    from benchmarks.bench_model import MODEL_PRESETS

    cfg = MODEL_PRESETS[args.model]
    params = next((r["params"] for r in results if r.get("params")), "?")
    shown = argv if argv is not None else sys.argv[1:]
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "-m", "benchmarks.netbench", *shown]),
        "note": args.note + (" (INTERRUPTED: partial results)" if interrupted else ""),
        "machine": machine_line(),
        "network": (
            "two network namespaces joined by a veth pair (MTU 1500), tbf on each end's egress"
            if net.shaped
            else "loopback fallback (unshaped; lo counters are machine-wide, halved per rank)"
        ),
        "mode": net.mode,
        "model": f"GPT preset '{args.model}' ({params} params, d={cfg.d_model}, layers={cfg.n_layer}, "
        f"vocab={cfg.vocab_size})",
        "batch_size": args.batch_size,
        "seq_len": cfg.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": args.threads,
        "pinned": bool(args.pin and (os.cpu_count() or 1) >= 2),
        "flush_denormal": not args.no_flush_denormal,
        "duration_s": time.time() - t_start,
        "skipped": skipped,
        "link_checks": link_checks,
        "variants": names,
    }
    if args.ranks_per_node > 1:  # keys only in multi-rank runs: the one-rank-per-node JSON stays as it was
        meta.update(nodes=args.nodes, ranks_per_node=args.ranks_per_node)
    write_report(results, rates, names, meta, out, args.name)
    failed = [r for r in results if r.get("event") == "error"]
    return 1 if (interrupted or failed) else 0
