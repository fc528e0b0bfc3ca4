"""netbench's orchestration: the interleaved schedule and the worker pairs that run it.

Each rank is one long-lived worker (``python -m benchmarks.netbench --worker``) running the whole
schedule (one per node, or ``--ranks-per-node`` per node); if a worker fails or stalls, all are killed and a
fresh set resumes after the failed entry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests._helpers._launch import free_port

REPO = Path(__file__).resolve().parents[2]


def make_schedule(names: list[str], repeats: int) -> list[dict]:
    """Interleaved: every repeat runs every variant; odd repeats run in reverse order (drift cancels)."""
    sched: list[dict] = []
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        sched += [{"id": len(sched) + i, "variant": v, "repeat": r} for i, v in enumerate(order)]
    return sched


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


def _worker_env(
    net: Any, node: int, port: int, threads: int, local_rank: int = 0, ranks_per_node: int = 1
) -> dict[str, str]:
    """Lightning's env-based launch for one process: NODE_RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    Every rank of a node binds gloo to its node's veth address: traffic to a peer in the same namespace
    goes to a local address, which the kernel delivers over that namespace's ``lo`` (unshaped), while
    traffic to the other node crosses the shaped veth."""
    env = dict(os.environ)
    for k in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        env.pop(k, None)  # keep Lightning on LightningEnvironment (not torchelastic / SLURM detection)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        MASTER_ADDR=net.master_addr,
        MASTER_PORT=str(port),
        NODE_RANK=str(node),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(2 * ranks_per_node),
        GLOO_SOCKET_IFNAME=net.iface(node),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
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
    rpn = getattr(args, "ranks_per_node", 1)
    # (global rank, node, local rank); one rank per node pins rank i to core i, two per node pin local rank
    # i of every node to core i (so with 2 cores each core runs one rank of each node)
    ranks = [(node * rpn + lr, node, lr) for node in (0, 1) for lr in range(rpn)]
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
            # on lo both nodes' packets are counted: halve for a per-node (= per-rank at 1 rank/node) share
            "wire_divisor": 2 if net.mode == "loopback" else 1,
        }
        if rpn > 1:  # keys only in multi-rank runs, so the one-rank-per-node spec stays as it was
            spec.update(nodes=2, ranks_per_node=rpn)
        spec_path = workdir / f"spec_{tag}.json"
        spec_path.write_text(json.dumps(spec))
        port = free_port() if net.mode == "loopback" else 29500 + attempt
        procs, res_paths, log_paths = [], [], []
        for rank, node, local_rank in ranks:
            res_paths.append(workdir / f"results_{tag}_rank{rank}.jsonl")
            log_paths.append(workdir / f"log_{tag}_rank{rank}.txt")
            core = rank if rpn == 1 else local_rank
            cmd = [*net.prefix(node), *(["taskset", "-c", str(core % ncpu)] if pin else [])]
            cmd += [sys.executable, "-m", "benchmarks.netbench", "--worker", "--spec", str(spec_path)]
            cmd += ["--rank", str(rank), "--results", str(res_paths[-1])]
            with open(log_paths[-1], "w") as log:
                env = _worker_env(net, node, port, args.threads, local_rank, rpn)
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
        failed, seen, printed, last_progress = None, 0, 0, time.time()
        try:
            while True:
                time.sleep(0.5)
                rows0 = _read_jsonl(res_paths[0])
                n = len(rows0) + sum(len(_read_jsonl(p)) for p in res_paths[1:])
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
        both = set.intersection(*done_ids)  # entries every rank finished
        results += [r for rr in rows for r in rr if r.get("event") == "done" and r["id"] in both]
        remaining = [e for e in remaining if e["id"] not in both]
        if failed and remaining:
            bad = remaining.pop(0)
            errs = [r for rr in rows for r in rr if r.get("event") == "error" and r["id"] == bad["id"]]
            tails = "".join("".join(p.read_text().splitlines(True)[-20:]) for p in log_paths)
            msg = errs[0]["error"].splitlines()[0][:300] if errs else failed
            if len(errs) < len(ranks):  # a rank that died without a Python exception: its log tells why
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


__all__ = ["make_schedule", "run_schedule"]
