"""The multi-GPU smoke run: every config in configs/ (every strategy and callback) for a few steps on N GPUs.

    python benchmarks/gpu_smoke.py                      # 2 GPUs of this node, NCCL
    python benchmarks/gpu_smoke.py --devices 8          # 8 GPUs
    python benchmarks/gpu_smoke.py --accelerator cpu    # 2 CPU processes over gloo (what the test suite runs)

Each config is trained as a user runs it, ``python -m lightning_qcomm fit --config configs/<name>.yaml``, with
``--trainer.accelerator``, ``--trainer.devices`` and a one-layer model for ``--steps`` optimizer steps, one
subprocess per config (Lightning launches the other ranks; on GPUs the process group is NCCL, on CPU gloo). A
config passes when the run exits 0 and ``CommVolumeLogger``'s summary covers every rank and every step; anything
else fails, with the last lines of its output in the report. The report (device names, torch, CUDA, NCCL,
the code's commit, the date) goes to ``benchmarks/results/gpu_smoke.md``, or ``--out``.

Exit status: 0 when every config passed, 1 when one failed, 2 when fewer GPUs than ``--devices`` are visible
(nothing is run, nothing is written).

Example::

    python benchmarks/gpu_smoke.py --devices 2 --only ddp_baseline,onebit_adam --out /tmp/smoke.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
RESULTS = REPO / "benchmarks" / "results" / "gpu_smoke.md"
TINY = [  # the demo model at one layer: the run checks that each method starts and steps, not its speed
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=32",
    "--model.warmup_steps=2",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=40000",
]


def _environment(accelerator: str) -> list[str]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    lines = [
        f"date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')}",
        f"commit: {commit or 'unknown (not a git checkout)'}",
        f"torch {torch.__version__}, Python {platform.python_version()}",
    ]
    if accelerator == "gpu":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
        lines.append(f"devices: {', '.join(names)}; CUDA {torch.version.cuda}; NCCL {nccl}")
    else:
        lines.append(f"devices: CPU processes over gloo ({platform.processor() or platform.machine()})")
    return lines


def run_config(path: Path, accelerator: str, devices: int, steps: int, workdir: Path, timeout_s: int) -> dict:
    """Train one config; ``{"config", "passed", "seconds", "detail"}``."""
    cmd = [sys.executable, "-m", "lightning_qcomm", "fit", "--config", str(path)]
    cmd += [f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}", "--trainer.num_nodes=1"]
    cmd += [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", *TINY]
    cmd += [f"--trainer.logger.init_args.save_dir={workdir / path.stem}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"config": path.stem, "passed": False, "seconds": timeout_s, "detail": f"timed out after {timeout_s} s"}
    seconds = time.monotonic() - start
    summary = f"lightning_qcomm communication summary: {devices} rank(s), {steps} optimizer steps"
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        return {"config": path.stem, "passed": False, "seconds": seconds, "detail": " / ".join(tail)}
    if summary not in proc.stdout:
        return {"config": path.stem, "passed": False, "seconds": seconds, "detail": f"no line {summary!r}"}
    return {"config": path.stem, "passed": True, "seconds": seconds, "detail": ""}


def write_report(out: Path, rows: list[dict], accelerator: str, devices: int, steps: int) -> None:
    passed = sum(r["passed"] for r in rows)
    lines = [
        "# Smoke run: every config on several processes",
        "",
        f"Written by `python benchmarks/gpu_smoke.py --accelerator {accelerator} --devices {devices} --steps {steps}`.",
        "",
        *[f"- {line}" for line in _environment(accelerator)],
        "",
        f"{passed} of {len(rows)} configs passed ({devices} ranks, {steps} optimizer steps, one-layer demo model).",
        "",
        "| config | result | seconds | detail |",
        "|---|---|---|---|",
        *[
            f"| {r['config']} | {'pass' if r['passed'] else 'FAIL'} | {r['seconds']:.1f} | {r['detail'].replace('|', '/')} |"
            for r in rows
        ],
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu", help="gpu: NCCL; cpu: gloo")
    parser.add_argument("--devices", type=int, default=2, help="ranks on this node")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per config")
    parser.add_argument("--only", default=None, help="comma-separated config names (default: every config)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the report (default benchmarks/results/)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per config")
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error(f"--devices {args.devices}: allowed an int >= 2 (a smoke run of collectives needs two ranks)")
    configs = sorted(CONFIGS.glob("*.yaml"))
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {p.stem for p in configs})
        if unknown:
            parser.error(f"--only: no config {unknown}; allowed: {sorted(p.stem for p in configs)}")
        configs = [p for p in configs if p.stem in wanted]
    if args.accelerator == "gpu":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < args.devices:
            print(f"gpu_smoke: {visible} CUDA device(s) visible, --devices {args.devices} asked", file=sys.stderr)
            return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in configs:
            row = run_config(path, args.accelerator, args.devices, args.steps, Path(tmp), args.timeout)
            print(f"{row['config']:32s} {'pass' if row['passed'] else 'FAIL'} {row['seconds']:6.1f} s {row['detail']}")
            rows.append(row)
    write_report(args.out, rows, args.accelerator, args.devices, args.steps)
    print(f"report: {args.out}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
