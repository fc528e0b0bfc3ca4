"""Compressed collectives on a shaped link: time and wire bytes (docs/design.md: "Benchmark regime").

Two ranks, one per network namespace (``benchmarks.netns.shaped_link``: veth pair, tbf rate R each
way), gloo over the veth, OMP_NUM_THREADS=1 and one torch thread per rank, each rank pinned to its
own core when there are >= 2. Per rate, size and method, each rank runs ``--warmup`` untimed calls
then ``--iters`` timed ones, each bracketed by barriers; per call it reads its veth ``tx_bytes``
before and after (the after-read follows a barrier, so everything the call sent is counted; the
barrier's own bytes, measured beforehand, are subtracted).

Methods: fp32 = ``quantized_all_reduce(x, None)`` (a plain gloo all_reduce), q8/q4/q2 =
``quantized_all_reduce`` with the uniform codec (bucket 512, stochastic rounding unless ``--nearest``),
onebit = ``onebit_all_reduce``. All with ``check=False`` (the hot-path setting); the consistency
check's cost is measured separately on a 1-element call.

Reported per row: median seconds per call (slowest rank), the compute floor (the same call with its
two payload transfers replaced by local copies: all of this rank's encode/decode work, no network), measured tx bytes per call (max over ranks), the ledger
formula for this rank's wire bytes, their ratio, the byte-reduction factor vs fp32 (formula), the
speedup vs fp32 (median times) and speedup / reduction (the issue's goal: >= 0.8 at 100 Mbit/s).

    sudo python benchmarks/collectives.py --rates 100,1000 --sizes 4M,32M          # full run
    sudo python benchmarks/collectives.py --rates 100 --sizes 4M --iters 2         # quick check
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

METHODS = ("fp32", "q8", "q4", "q2", "onebit")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


# ----------------------------------------------------------------------------------------------- worker
@contextlib.contextmanager
def local_transfers():
    """Compute floor: the collectives' two payload transfers become local copies (all-to-all keeps this
    rank's own bytes, all-gather repeats them), so the call does exactly its N-rank encode/decode work
    and sends nothing."""
    from lightning_qcomm.collectives import engine

    names = ("_all_to_all", "_all_gather", "_all_to_all_async", "_all_gather_async")
    # every compressed collective moves its payloads through the engine, which binds these at import
    saved = [(engine, name, getattr(engine, name)) for name in names]

    def all_to_all(recv, send, group, world):
        recv.copy_(send)

    def all_gather(out, inp, group, world):
        out.copy_(inp.repeat(world))

    for mod, name, _ in saved:  # the async forms return None: nothing to wait for
        setattr(mod, name, all_to_all if "to_all" in name else all_gather)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.netns import iface_bytes
    from lightning_qcomm.codecs import get_codec
    from lightning_qcomm.collectives import onebit_all_reduce, onebit_server_error_numel, quantized_all_reduce
    from lightning_qcomm.comm import CommLedger, set_ledger

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    iface = cfg["iface"]
    tx = lambda: iface_bytes(iface).tx  # noqa: E731

    # bytes of one barrier (subtracted from every per-call reading)
    dist.barrier()
    t0 = tx()
    for _ in range(20):
        dist.barrier()
    barrier_bytes = (tx() - t0) / 20

    def make_call(method: str, d: int, group):
        if method == "onebit":
            ew, es = torch.zeros(d), torch.zeros(onebit_server_error_numel(d, group))
            return lambda x: onebit_all_reduce(x, ew, es, group=group, check=False)
        codec = None if method == "fp32" else get_codec("uniform", int(method[1:]), 512, stochastic=not cfg["nearest"])
        return lambda x: quantized_all_reduce(x, codec, group=group, op="avg", seed=7, check=False)

    rows = []
    for d in cfg["sizes"]:
        x = torch.randn(d, generator=torch.Generator().manual_seed(rank))
        for method in cfg["methods"]:
            ledger = CommLedger()
            set_ledger(ledger)
            call = make_call(method, d, None)
            for _ in range(cfg["warmup"]):
                call(x.clone())
            ledger.reset()
            times, sent = [], []
            for _ in range(cfg["iters"]):
                buf = x.clone()
                dist.barrier()
                b0 = tx()
                t0 = time.perf_counter()
                call(buf)
                times.append(time.perf_counter() - t0)
                dist.barrier()
                sent.append(tx() - b0 - barrier_bytes)
            wire = sum(t.wire_bytes for t in ledger.cumulative.values()) / cfg["iters"]
            set_ledger(None)
            floor = []
            if method != "fp32" and cfg["floor_iters"] > 0:
                with local_transfers():
                    for _ in range(cfg["floor_iters"]):
                        buf = x.clone()
                        t0 = time.perf_counter()
                        call(buf)
                        floor.append(time.perf_counter() - t0)
            rows.append(
                {
                    "size": d,
                    "method": method,
                    "times": times,
                    "median_s": statistics.median(times),
                    "floor_s": statistics.median(floor) if floor else 0.0,
                    "tx_bytes": statistics.median(sent),
                    "ledger_wire_bytes": wire,
                }
            )
            dist.barrier()

    # cost of the consistency check: a 1-element fp32 all-reduce with and without it
    one = torch.ones(1)
    check_cost = {}
    for check in (False, True):
        ts = []
        for _ in range(cfg["check_iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            quantized_all_reduce(one, None, check=check)
            ts.append(time.perf_counter() - t0)
        check_cost[str(check)] = statistics.median(ts)

    out = {"rank": rank, "barrier_bytes": barrier_bytes, "rows": rows, "check_cost_s": check_cost}
    with open(os.path.join(cfg["outdir"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver
def run_rate(rate: float, args, outdir: str) -> dict:
    from benchmarks.netns import netns_cmd, shaped_link

    ncpu = os.cpu_count() or 1
    with shaped_link(rate, mtu=args.mtu) as link:
        procs = []
        for r in range(2):
            cfg = {
                "iface": link.iface(r),
                "sizes": args.sizes,
                "methods": args.methods,
                "warmup": args.warmup,
                "iters": args.iters,
                "floor_iters": args.floor_iters,
                "check_iters": args.check_iters,
                "nearest": args.nearest,
                "outdir": outdir,
            }
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
            if ncpu >= 2:
                argv = ["taskset", "-c", str(r % ncpu), *argv]
            env = {**os.environ, **link.env(r), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            procs.append(subprocess.Popen(netns_cmd(link.ns(r), argv), env=env))
        try:
            for p in procs:
                rc = p.wait(timeout=args.timeout)
                if rc != 0:
                    raise RuntimeError(f"worker exited with {rc}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    ranks = []
    for r in range(2):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {"rate": rate, "ranks": ranks}


def summarize(results: list[dict]) -> list[dict]:
    table = []
    for res in results:
        r0, r1 = res["ranks"]
        fp32 = {}
        for a, b in zip(r0["rows"], r1["rows"]):
            row = {
                "rate_mbit": res["rate"],
                "size": a["size"],
                "method": a["method"],
                "median_s": max(a["median_s"], b["median_s"]),
                "floor_s": max(a["floor_s"], b["floor_s"]),
                "tx_bytes": max(a["tx_bytes"], b["tx_bytes"]),
                "formula_bytes": max(a["ledger_wire_bytes"], b["ledger_wire_bytes"]),
            }
            row["tx_over_formula"] = row["tx_bytes"] / row["formula_bytes"]
            if a["method"] == "fp32":
                fp32[a["size"]] = row
            table.append(row)
        for row in table:
            base = fp32.get(row["size"]) if row["rate_mbit"] == res["rate"] else None
            if base is None:
                continue
            row["reduction"] = base["formula_bytes"] / row["formula_bytes"]
            row["speedup"] = base["median_s"] / row["median_s"]
            row["speedup_over_reduction"] = row["speedup"] / row["reduction"]
    return table


def markdown(table: list[dict], results: list[dict], args) -> str:
    def size_str(d: int) -> str:
        return f"{d // 2**20}M" if d % 2**20 == 0 else str(d)

    lines = [
        "| rate Mbit/s | size | method | median s/call | floor s | tx MB/call (rank max) | formula MB | tx/formula "
        "| byte reduction | speedup vs fp32 | speedup/reduction |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['rate_mbit']:g} | {size_str(r['size'])} | {r['method']} | {r['median_s']:.3f} | {r['floor_s']:.3f} "
            f"| {r['tx_bytes'] / 1e6:.3f} | {r['formula_bytes'] / 1e6:.3f} | {r['tx_over_formula']:.3f} "
            f"| {r.get('reduction', float('nan')):.2f} | {r.get('speedup', float('nan')):.2f} "
            f"| {r.get('speedup_over_reduction', float('nan')):.2f} |"
        )
    lines.append("")
    for res in results:
        cc = res["ranks"][0]["check_cost_s"]
        lines.append(
            f"- {res['rate']:g} Mbit/s: consistency check (`check=True`) adds {1e3 * (cc['True'] - cc['False']):.2f} ms "
            f"per call (1-element all-reduce: {1e3 * cc['False']:.2f} ms without, {1e3 * cc['True']:.2f} ms with); "
            f"barrier bytes subtracted per reading: {res['ranks'][0]['barrier_bytes']:.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="100,1000", help="Mbit/s, comma separated")
    ap.add_argument("--sizes", default="4M,32M", help="elements, comma separated (K/M suffixes: 2^10/2^20)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--floor-iters", type=int, default=2)
    ap.add_argument("--check-iters", type=int, default=20)
    ap.add_argument("--mtu", type=int, default=1500, help="veth MTU (9000 = jumbo frames: less header overhead)")
    ap.add_argument("--nearest", action="store_true", help="round to nearest instead of stochastic rounding")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per rate before the workers are killed")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    rates = [float(r) for r in args.rates.split(",")]
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.methods = [m.strip() for m in args.methods.split(",")]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; allowed {','.join(METHODS)}")
    if "fp32" not in args.methods:
        args.methods.insert(0, "fp32")  # the baseline every ratio refers to
    results = []
    for rate in rates:
        with tempfile.TemporaryDirectory() as outdir:
            t0 = time.time()
            results.append(run_rate(rate, args, outdir))
            print(f"[collectives] {rate:g} Mbit/s done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    table = summarize(results)
    md = markdown(table, results, args)
    cmd = "python benchmarks/collectives.py " + " ".join(sys.argv[1:])
    header = f"<!-- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: {cmd} -->"
    print(header)
    print(md)
    if args.md:
        Path(args.md).write_text(header + "\n" + md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "table": table}, indent=1))


if __name__ == "__main__":
    main()
