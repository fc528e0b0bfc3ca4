"""netbench: every compression method side by side on a real, rate-limited network (docs/design.md, "Benchmark regime").

    sudo python benchmarks/netbench.py --rates 100,1000 --steps 30 --repeats 2 --out benchmarks/results

Owns the command line and the orchestration; the variants live in ``netbench_variants.py``, the
measurement inside a rank in ``netbench_worker.py``, the tables and plot in ``netbench_report.py``,
the shaped link in ``netns.py``, the model in ``bench_model.py``.

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
import contextlib
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [p for p in (str(HERE), str(REPO)) if p not in sys.path]

from netbench_report import aggregate, machine_line, plot, render_markdown  # noqa: E402
from netbench_variants import VARIANT_BY_NAME, VARIANTS, variant_available  # noqa: E402

__all__ = ["LoopbackNet", "NamespaceNet", "aggregate", "main", "make_schedule", "run_schedule"]

# --------------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------------


class LoopbackNet:
    """Both ranks on 127.0.0.1; no shaping; ``lo`` counters include every process on the machine."""

    mode = "loopback"
    shaped = False
    master_addr = "127.0.0.1"

    def iface(self, rank: int) -> str:
        return "lo"

    def prefix(self, rank: int) -> list[str]:
        return []

    def shape(self, rate_mbit: float | None) -> None:
        pass

    def link_check(self, rate_mbit: float | None) -> dict:
        return {}

    def __enter__(self) -> LoopbackNet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class NamespaceNet:
    """The two shaped namespaces of ``netns.shaped_link`` (created on enter, deleted on exit), plus
    re-shaping between rates and a TCP goodput check of the shaped link."""

    mode = "netns"
    shaped = True

    def __init__(self, first_rate_mbit: float, prefix: str = "lqnb", subnet: str = "10.88.0") -> None:
        import netns

        self._netns = netns
        self._cm = netns.shaped_link(first_rate_mbit, prefix=prefix, subnet=subnet)
        self.link = None

    def __enter__(self) -> NamespaceNet:
        self.link = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)

    @property
    def master_addr(self) -> str:
        return self.link.addr0

    @property
    def ns(self) -> tuple[str, str]:
        return (self.link.ns0, self.link.ns1)

    def iface(self, rank: int) -> str:
        return self.link.iface(rank)

    def prefix(self, rank: int) -> list[str]:
        return self._netns.netns_cmd(self.link.ns(rank), [])

    def shape(self, rate_mbit: float | None) -> None:
        for rank in (0, 1):
            self._netns.shape(self.link.ns(rank), self.link.iface(rank), rate_mbit)

    def link_check(self, rate_mbit: float | None, seconds: float = 0.5) -> dict:
        """Send ~``seconds`` worth of bytes ns0 -> ns1 over TCP; the receiver measures the goodput."""
        nbytes = int(max(1e6, (rate_mbit or 1000) * 1e6 / 8 * seconds))
        addr, port = self.link.addr1, 29400
        server = (
            "import socket,time\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{addr}',{port}))\n"
            "s.listen(1);print('ready',flush=True);c,_=s.accept();n=0;t0=None\n"
            "while True:\n d=c.recv(1<<20)\n if t0 is None:t0=time.perf_counter()\n if not d:break\n n+=len(d)\n"
            "print(n,time.perf_counter()-t0,flush=True)\n"
        )
        client = (
            f"import socket;s=socket.create_connection(('{addr}',{port}));b=bytes(1<<20);n={nbytes}\n"
            "while n>0:\n s.sendall(b[:min(n,1<<20)]);n-=1<<20\ns.close()"
        )
        srv = subprocess.Popen([*self.prefix(1), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        try:
            srv.stdout.readline()
            subprocess.run([*self.prefix(0), sys.executable, "-c", client], check=True, capture_output=True)
            out, _ = srv.communicate(timeout=60)
            n, dt = out.split()
            return {
                "bytes": int(n),
                "seconds": round(float(dt), 4),
                "goodput_mbit": round(int(n) * 8 / float(dt) / 1e6, 1),
            }
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()


def make_net(args: argparse.Namespace, first_rate: float):
    """NamespaceNet when root and iproute2 is there; LoopbackNet otherwise, saying why."""
    if args.loopback:
        print("[netbench] --loopback: both ranks on 127.0.0.1, unshaped, counters machine-wide.", flush=True)
        return LoopbackNet()
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"missing tools {missing}"
        print(
            f"[netbench] WARNING: {why}, so no network namespaces: falling back to plain loopback "
            "(127.0.0.1, NO rate limit, interface counters include other processes' loopback traffic). "
            "Step times are not link-limited and no efficiency is computed. Run as root for the real benchmark.",
            flush=True,
        )
        return LoopbackNet()
    return NamespaceNet(first_rate)


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------


def make_schedule(names: list[str], repeats: int) -> list[dict]:
    """Interleaved: every repeat runs every variant; odd repeats run in reverse order (drift cancels)."""
    sched: list[dict] = []
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        sched += [{"id": len(sched) + i, "variant": v, "repeat": r} for i, v in enumerate(order)]
    return sched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each worker's process group, SIGKILL what is left after 5 s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _worker_env(net: Any, rank: int, port: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        env.pop(k, None)  # keep Lightning on LightningEnvironment (not torchelastic / SLURM detection)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        MASTER_ADDR=net.master_addr,
        MASTER_PORT=str(port),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        GLOO_SOCKET_IFNAME=net.iface(rank),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(HERE), env.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    return env


def run_schedule(
    net: Any, rate: float | None, schedule: list[dict], args: argparse.Namespace, workdir: Path
) -> list[dict]:
    """Run ``schedule`` on a worker pair; after a failed or stalled entry, a fresh pair resumes after it.

    Returns the "done" rows of both ranks and one "error" row per failed entry.
    """
    results: list[dict] = []
    remaining = list(schedule)
    ncpu = os.cpu_count() or 1
    pin = args.pin and ncpu >= 2 and shutil.which("taskset") is not None
    attempt = 0
    while remaining:
        attempt += 1
        tag = f"r{rate}_a{attempt}"
        spec = {
            "schedule": remaining,
            "rate_mbit": rate,
            "steps": args.steps,
            "warmup": args.warmup,
            "preset": args.model,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "val_batches": 2,
            "threads": args.threads,
            "flush_denormal": not args.no_flush_denormal,
            "collective_timeout": args.collective_timeout,
            "ifaces": [net.iface(0), net.iface(1)],
            "wire_divisor": 2 if net.mode == "loopback" else 1,  # on lo both ranks' packets are counted
        }
        spec_path = workdir / f"spec_{tag}.json"
        spec_path.write_text(json.dumps(spec))
        port = _free_port() if net.mode == "loopback" else 29500 + attempt
        procs, res_paths, log_paths = [], [], []
        for rank in (0, 1):
            res_paths.append(workdir / f"results_{tag}_rank{rank}.jsonl")
            log_paths.append(workdir / f"log_{tag}_rank{rank}.txt")
            cmd = [*net.prefix(rank), *(["taskset", "-c", str(rank % ncpu)] if pin else [])]
            cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(spec_path)]
            cmd += ["--rank", str(rank), "--results", str(res_paths[-1])]
            with open(log_paths[-1], "w") as log:
                env = _worker_env(net, rank, port, args.threads)
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
        failed, seen, printed, last_progress = None, 0, 0, time.time()
        try:
            while True:
                time.sleep(0.5)
                rows0 = _read_jsonl(res_paths[0])
                n = len(rows0) + len(_read_jsonl(res_paths[1]))
                if n != seen:
                    seen, last_progress = n, time.time()
                for r in rows0[printed:]:
                    if r.get("event") == "done":
                        print(
                            f"[netbench] {rate} Mbit/s  {r['variant']:<15} rep {r['repeat']}  "
                            f"step {r['step_mean_s'] * 1e3:8.1f} ms  tx {r['tx_per_step'] / 1e6:7.3f} MB/step",
                            flush=True,
                        )
                printed = len(rows0)
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    time.sleep(3)  # let the peer write its own error line
                    failed = f"worker exit codes {[p.poll() for p in procs]}"
                    break
                if time.time() - last_progress > args.variant_timeout:
                    failed = f"no progress for {args.variant_timeout:.0f} s"
                    break
        finally:
            _kill(procs)
        rows = [_read_jsonl(p) for p in res_paths]
        done_ids = [{r["id"] for r in rr if r.get("event") == "done"} for rr in rows]
        both = done_ids[0] & done_ids[1]
        results += [r for rr in rows for r in rr if r.get("event") == "done" and r["id"] in both]
        remaining = [e for e in remaining if e["id"] not in both]
        if failed and remaining:
            bad = remaining.pop(0)
            errs = [r for rr in rows for r in rr if r.get("event") == "error" and r["id"] == bad["id"]]
            tails = "".join("".join(p.read_text().splitlines(True)[-20:]) for p in log_paths)
            msg = errs[0]["error"].splitlines()[0][:300] if errs else failed
            if len(errs) < 2:  # a rank that died without a Python exception: its log tells why
                msg += f" (ranks with an error line: {[e['rank'] for e in errs]}; {failed})"
            print(f"[netbench] {rate} Mbit/s  {bad['variant']} rep {bad['repeat']} FAILED: {msg}", flush=True)
            if args.verbose:
                print("\n".join(e.get("traceback", "") for e in errs) or tails, flush=True)
            results.append(
                {"event": "error", "variant": bad["variant"], "repeat": bad["repeat"], "rate_mbit": rate, "error": msg,
                 "tracebacks": [e.get("traceback", "") for e in errs], "log_tails": tails[-6000:]}
            )  # fmt: skip
        elif failed:
            print(f"[netbench] worker pair ended abnormally after the last entry: {failed}", flush=True)
    return results


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s per direction, comma separated")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per entry (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per rate (default 2)")
    p.add_argument(
        "--variants",
        default="all",
        help=f"comma list or 'all' (ablations only by name): {','.join(VARIANT_BY_NAME)}",
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
    if args.variants == "all":
        args.variant_list = [v.name for v in VARIANTS if v.in_all]
    else:
        args.variant_list = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in args.variant_list if n not in VARIANT_BY_NAME]
        if unknown:
            p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANT_BY_NAME)}")
    return args


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(
    results: list[dict], rates: list[float | None], names: list[str], meta: dict, out: Path, name: str
) -> int:
    """Aggregate, write NAME.md / NAME.json / NAME.png under ``out``, print the markdown."""
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
        from netbench_worker import worker_main

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
    from bench_model import MODEL_PRESETS

    cfg = MODEL_PRESETS[args.model]
    params = next((r["params"] for r in results if r.get("params")), "?")
    shown = argv if argv is not None else sys.argv[1:]
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", os.path.relpath(Path(__file__).resolve(), Path.cwd()), *shown]),
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
    write_report(results, rates, names, meta, out, args.name)
    failed = [r for r in results if r.get("event") == "error"]
    return 1 if (interrupted or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
