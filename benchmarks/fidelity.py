"""Fidelity over a full run: every method's validation loss against its own baseline.

Two gloo ranks on loopback (no shaping: the link changes speed, not the math), the bench_model GPT on the
bytes of the Python standard library, warm-up + cosine over ``--steps`` optimizer steps, validation every
``--eval-every`` steps on a fixed held-out set. The methods and baselines are ``fidelity_methods.METHODS``
(QSDP vs FSDP2 fp32; QuantDDP codecs, Local SGD, OneBitAdam, ActivationQuantization vs DDP fp32 + AdamW);
methods marked multi-seed (and their baselines) run ``--seeds`` seeds, the others seed 0. A seed fixes the
initial weights and the data order, identical for every method, so a method and its baseline are paired.

    python -m benchmarks.fidelity                                    # the full run (~75 min on 2 cores)
    python -m benchmarks.fidelity --smoke --out /tmp/fid             # seconds: the test's size
    python -m benchmarks.fidelity --methods qddp_uniform8 --steps 50 --seeds 1 --name probe   # + its baseline
    python -m benchmarks.fidelity --render benchmarks/results/fidelity.json

One process pair runs every configuration in turn (one Trainer each, the process group made once), so the
per-run start-up is a Trainer's, not a launch's. Rank 0 writes ``<out>/<name>.json`` after every finished
configuration: a killed run keeps what finished, and rerunning the same command skips those (the settings
must match; ``--fresh`` starts over). A configuration that fails is recorded under ``errors`` and a fresh pair
continues with the next; a rerun retries it. At the end ``<name>.md`` (table + command) and ``<name>.png``
(loss vs step per method) are written from the JSON (``fidelity_report``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.fidelity_methods import METHOD_BY_NAME, METHODS, RunConfig, phase_steps  # noqa: E402
from benchmarks.fidelity_report import estimate, last_line, plot, render_markdown, run_key  # noqa: E402

SMOKE = {"preset": "fidelity_smoke", "steps": 30, "eval_every": 10, "seeds": 1, "batch_size": 4, "lr": 1e-2}
SMOKE.update(val_windows=32, val_batch_size=16, corpus_bytes=300_000, collective_timeout_s=120.0, name="fidelity_smoke")
FULL = {"preset": "fidelity", "steps": 2000, "eval_every": 100, "seeds": 3, "batch_size": 4, "lr": 2e-3}
FULL.update(val_windows=256, val_batch_size=32, corpus_bytes=10**9, collective_timeout_s=600.0, name="fidelity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {FULL['steps']})")
    p.add_argument("--seeds", type=int, help=f"seeds of the multi-seed methods and baselines (default {FULL['seeds']})")
    p.add_argument("--methods", default="default", help="comma-separated, 'default' or 'all'; baselines are added")
    p.add_argument(
        "--all-seeds",
        action="store_true",
        help="every selected method runs --seeds seeds, not only the multi-seed ones",
    )
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations (default {FULL['eval_every']})")
    p.add_argument("--name", help=f"output stem (default {FULL['name']}; --smoke: {SMOKE['name']})")
    p.add_argument("--out", help="output folder (default benchmarks/results; --render: the JSON's folder)")
    p.add_argument("--smoke", action="store_true", help="tiny model and run (the test's size; seconds)")
    p.add_argument("--preset", help="bench_model preset (default fidelity; --smoke: fidelity_smoke)")
    p.add_argument("--batch-size", type=int, help="windows per rank per step")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--lr-warmup", type=int, help="linear warm-up steps (default 5%% of --steps)")
    p.add_argument("--val-windows", type=int, help="held-out windows per evaluation (a multiple of 2)")
    p.add_argument("--fresh", action="store_true", help="discard an existing <name>.json instead of resuming it")
    p.add_argument("--render", metavar="JSON", help="only rebuild the .md and .png from a saved JSON")
    p.add_argument("--estimate-from", metavar="JSON", help="only print this run's expected duration from a short run")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    base = SMOKE if args.smoke else FULL
    for key in ("steps", "seeds", "eval_every", "name", "preset", "batch_size", "lr", "val_windows"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.lr_warmup is None:
        args.lr_warmup = max(1, round(0.05 * args.steps)) if not args.smoke else 3
    for key in ("steps", "seeds", "eval_every", "batch_size", "val_windows"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.steps % args.eval_every:
        p.error(
            f"--steps ({args.steps}) must be a multiple of --eval-every ({args.eval_every}): the last step is evaluated"
        )
    if args.val_windows % 2:
        p.error(f"--val-windows must be a multiple of the world size 2, got {args.val_windows}")
    if not 0 <= args.lr_warmup < args.steps:
        p.error(f"--lr-warmup must be in [0, --steps), got {args.lr_warmup}")
    try:
        args.method_list = select_methods(args.methods)
    except ValueError as e:
        p.error(str(e))
    args.config = RunConfig(
        preset=args.preset,
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_warmup=args.lr_warmup,
        val_windows=args.val_windows,
        val_batch_size=base["val_batch_size"],
        corpus_bytes=base["corpus_bytes"],
        collective_timeout_s=base["collective_timeout_s"],
    )
    return args


def select_methods(spec: str) -> list[str]:
    """``default`` / ``all`` / a comma list; every listed method's baseline is added, baselines first."""
    if spec in ("default", "all"):
        names = [m.name for m in METHODS if spec == "all" or m.in_default]
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
        unknown = [n for n in names if n not in METHOD_BY_NAME]
        if unknown or not names:
            raise ValueError(f"--methods: unknown {unknown or spec!r}; known: {', '.join(METHOD_BY_NAME)}")
    wanted = set(names) | {METHOD_BY_NAME[n].baseline for n in names if METHOD_BY_NAME[n].baseline}
    return [m.name for m in METHODS if m.name in wanted]


def schedule(methods: list[str], seeds: int, all_seeds: bool = False) -> list[tuple[str, int]]:
    """Seed-major: every method's seed 0 first, so a run stopped early still has complete pairs."""
    multi = {m for m in methods if all_seeds or METHOD_BY_NAME[m].multi_seed}
    return [(m, s) for s in range(seeds) for m in methods if s == 0 or m in multi]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def load_or_start(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run's JSON: resumed when it exists with the same settings, else a new one (``--fresh``: always)."""
    config = dataclasses.asdict(args.config)
    if path.exists() and not args.fresh:
        data = json.loads(path.read_text())
        if data["meta"]["config"] != config:
            raise SystemExit(
                f"{path} was made with other settings ({data['meta']['config']}, now {config}): "
                "pass --fresh to start over or --name for a new file"
            )
        data["meta"].setdefault("sessions", []).append(_session())
        data["errors"] = {}  # retried now
        return data
    import lightning
    import torch

    from benchmarks.bench_model import GPT, MODEL_PRESETS, num_params
    from benchmarks.fidelity_methods import load_corpus

    cmd = "python -m benchmarks.fidelity " + " ".join(shlex.quote(a) for a in args.argv)
    meta = {
        "name": args.name,
        "command": cmd.strip(),
        "config": config,
        "commit": _commit(),
        "torch": torch.__version__,
    }
    meta.update(lightning=lightning.__version__, started=_session()["started"], sessions=[_session()])
    meta.update(seq_len=MODEL_PRESETS[args.preset].seq_len, params=num_params(GPT(MODEL_PRESETS[args.preset])))
    split = load_corpus(args.config, MODEL_PRESETS[args.preset].seq_len)
    meta.update(train_bytes=split.train_bytes, val_bytes=split.val_bytes, phases=phase_steps(args.config))
    return {"meta": meta, "runs": {}, "errors": {}}


def _session() -> dict[str, str]:
    return {"started": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "commit": _commit()}


def save_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def render(data: dict[str, Any], out_dir: Path, name: str, scheduled: list[tuple[str, int]] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{name}.md"
    md.write_text(render_markdown(data, scheduled))
    png = plot(data, out_dir / f"{name}.png")
    print(f"[fidelity] wrote {md}" + (f" and {png}" if png else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        path = Path(args.render)
        data = json.loads(path.read_text())
        render(data, Path(args.out) if args.out else path.parent, path.stem)
        return 0
    if args.estimate_from:
        probe = json.loads(Path(args.estimate_from).read_text())
        lines, total = estimate(
            probe, schedule(args.method_list, args.seeds, args.all_seeds), dataclasses.asdict(args.config)
        )
        print("\n".join(lines) + f"\ntotal: {total / 60:.1f} min (+ the pair's start-up)")
        return 0
    out_dir = Path(args.out) if args.out else REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"
    data = load_or_start(path, args)
    save_json(path, data)
    planned = schedule(args.method_list, args.seeds, args.all_seeds)
    todo = [c for c in planned if run_key(*c) not in data["runs"]]
    print(f"[fidelity] {len(planned)} configurations, {len(planned) - len(todo)} already in {path}", flush=True)
    from benchmarks.fidelity_worker import run_pair

    t0 = time.perf_counter()
    while todo:
        err = run_pair(todo, args.config, path)
        data = json.loads(path.read_text())
        todo = [c for c in todo if run_key(*c) not in data["runs"]]
        if err is None or not todo:
            break
        failed = todo.pop(0)  # the pair stopped on the first unfinished configuration
        data["errors"][run_key(*failed)] = err
        save_json(path, data)
        print(f"[fidelity] {run_key(*failed)} FAILED: {last_line(err)}", flush=True)
    data["meta"]["sessions"][-1]["wall_s"] = round(time.perf_counter() - t0, 1)
    save_json(path, data)
    render(data, out_dir, args.name, planned)
    fits = [r["fit_s"] for r in data["runs"].values()]
    if fits:
        print(f"[fidelity] {len(fits)} runs, {sum(fits):.0f} s of training (median {statistics.median(fits):.1f} s)")
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
