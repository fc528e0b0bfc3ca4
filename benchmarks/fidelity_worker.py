"""The fidelity benchmark's processes: one pair of gloo ranks that trains every scheduled configuration in turn.

``run_pair`` spawns the two ranks (``tests._helpers._launch.spawn``) and returns None, or the error text when the pair
stopped early. Each rank makes the process group once, pins itself to one core (when there are two), loads the
corpus once, then per configuration seeds everything, builds the method (``fidelity_methods.build_method``)
and fits a fresh ``Trainer`` (validation every ``eval_every`` steps and once before training: the step-0 loss).
Rank 0 adds each finished configuration to the JSON at once (write to a temporary file, then rename).

Per run it records the validation curve, the training loss averaged over each evaluation interval and over
both ranks, the median training-step time (``on_train_batch_start`` to ``_end``: no evaluation inside), the
time spent evaluating, and the wire bytes per step: the ``CommLedger``'s when lightning_qcomm sent anything,
else torch.distributed's calls counted by netbench's ``TorchCollectiveCounter`` (as netbench does).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_pair(todo: list[tuple[str, int]], cfg: Any, json_path: Path) -> str | None:
    """Train ``todo`` (method, seed) in order on two fresh ranks; None when all finished, else the error."""
    sys.path.insert(0, str(REPO))
    from tests._helpers._launch import free_port, spawn

    spec = {"todo": todo, "config": dataclasses.asdict(cfg), "json": str(json_path)}
    spec_path = json_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    os.environ["OMP_NUM_THREADS"] = "1"
    # SIGTERM -> SystemExit, so spawn's cleanup kills the ranks instead of leaving them training
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        # the limit only arms spawn's kill-on-exit; hung collectives fail after cfg.collective_timeout_s
        spawn(_worker, free_port(), str(spec_path), nprocs=2, timeout_s=3600.0 * len(todo))
    except Exception as e:  # noqa: BLE001 - reported per configuration by the caller
        return f"{type(e).__name__}: {e}"[-6000:]
    finally:
        signal.signal(signal.SIGTERM, previous)
        spec_path.unlink(missing_ok=True)
    return None


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_qcomm", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(rank: int, port: int, spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.bench_model import MODEL_PRESETS
    from benchmarks.fidelity_methods import RunConfig, load_corpus
    from benchmarks.fidelity_report import run_key
    from tests._helpers._launch import lightning_env

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    ncpu = os.cpu_count() or 1
    if ncpu >= 2 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % ncpu})  # one core per rank, as netbench pins them
    _quiet()
    spec = json.loads(Path(spec_path).read_text())
    cfg = RunConfig(**spec["config"])
    os.environ.update(lightning_env(rank, 2, port))
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=2, timeout=timedelta(seconds=cfg.collective_timeout_s)
    )
    split = load_corpus(cfg, MODEL_PRESETS[cfg.preset].seq_len)
    json_path = Path(spec["json"])
    for method, seed in spec["todo"]:
        dist.barrier()
        result = run_one(method, seed, cfg, split)
        gc.collect()  # the finished Trainer, model and process-group wrappers, before the next run
        if rank == 0:
            data = json.loads(json_path.read_text())
            data["runs"][run_key(method, seed)] = result
            tmp = json_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(json_path)
            print(
                f"[fidelity] {run_key(method, seed):<24} val {result['val_loss'][0]:.3f} -> {result['val_loss'][-1]:.4f}"
                f"  {result['fit_s']:6.1f} s  step {1e3 * result['step_median_s']:6.1f} ms"
                f"  eval {result['eval_s']:5.1f} s",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def _clock():
    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        """Training-step durations (batch start to end) and the total time in validation."""

        def __init__(self) -> None:
            self.steps: list[float] = []
            self.eval_s = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.steps.append(time.perf_counter() - self._t)

        def on_validation_start(self, *args: Any) -> None:
            self._v = time.perf_counter()

        def on_validation_end(self, *args: Any) -> None:
            self.eval_s += time.perf_counter() - self._v

    return StepClock()


def _wire(ledger: Any) -> tuple[float, int]:
    total = ledger.summarize(ledger.cumulative, by="all").get("all")
    return (total.wire_bytes, total.calls) if total is not None else (0.0, 0)


def run_one(method: str, seed: int, cfg: Any, split: Any) -> dict[str, Any]:
    """Fit ``method`` from ``seed`` for ``cfg.steps`` steps on this rank; the run's record (same on both ranks)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment

    from benchmarks.fidelity_methods import build_method
    from benchmarks.netbench.worker import TorchCollectiveCounter
    from lightning_qcomm.comm import CommLedger, set_ledger

    pl.seed_everything(seed, verbose=False)
    strategy, module_cls, module_kw, callbacks = build_method(method, cfg)
    module = module_cls(
        preset=cfg.preset,
        lr=cfg.lr,
        total_steps=cfg.steps,
        warmup_steps=cfg.lr_warmup,
        batch_size=cfg.batch_size,
        seed=seed,
        **module_kw,
    )
    module.attach_data(split, cfg.val_batch_size)
    clock = _clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[LightningEnvironment()],
        max_steps=cfg.steps,
        val_check_interval=cfg.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the whole validation set before the first step: the step-0 point
        use_distributed_sampler=False,  # the module shards and seeds its own data
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, clock],
    )
    lq_ledger, dist_ledger = CommLedger(), CommLedger()
    set_ledger(lq_ledger)
    t0 = time.perf_counter()
    try:
        with TorchCollectiveCounter(dist_ledger):
            trainer.fit(module)
    finally:
        set_ledger(None)
    fit_s = time.perf_counter() - t0
    eval_steps = [s for s, _ in module.val_curve]
    expected = list(range(0, cfg.steps + 1, cfg.eval_every))
    if eval_steps != expected or len(module.train_losses) != cfg.steps:
        raise RuntimeError(f"{method}: evaluated at {eval_steps}, trained {len(module.train_losses)} steps")
    # training loss per evaluation interval, averaged over both ranks (each trains on its own batches)
    losses = torch.tensor(module.train_losses, dtype=torch.float64).view(-1, cfg.eval_every).mean(dim=1)
    dist.all_reduce(losses)
    (lq_bytes, lq_calls), (dist_bytes, _) = _wire(lq_ledger), _wire(dist_ledger)
    bytes_total = lq_bytes if lq_calls > 0 else dist_bytes
    times = torch.tensor([statistics.median(clock.steps), fit_s, clock.eval_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank's
    extra = {k: getattr(strategy, k) for k in ("num_syncs", "num_forced_syncs") if hasattr(strategy, k)}
    return {
        "method": method,
        "seed": seed,
        "eval_steps": eval_steps,
        "val_loss": [v for _, v in module.val_curve],
        "train_loss": [None, *(float(x) / 2 for x in losses)],  # None: no training before step 0
        "step_median_s": float(times[0]),
        "fit_s": float(times[1]),
        "eval_s": float(times[2]),
        "wire_bytes_per_step": bytes_total / cfg.steps,
        "bytes_source": "lightning_qcomm CommLedger" if lq_calls > 0 else "torch.distributed call counter",
        "params": module.describe()["params"],
        **extra,
    }


__all__ = ["run_one", "run_pair"]
