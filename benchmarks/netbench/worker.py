"""netbench worker: one rank of the two-node job (one or two ranks per node), measuring every scheduled variant (see ``benchmarks.netbench``).

Owns the measurement inside a rank: the gloo process group (created once, reused by every
``Trainer``), per-step timestamps, interface and ledger snapshots at the edges of the timed window,
and the counter that puts torch's own collectives into a ``CommLedger``. Writes one JSON line per
event ("start", "done" with the figures, or "error" - after which it exits so the orchestrator can
restart a clean pair).
"""

from __future__ import annotations

import inspect
import json
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any


class TorchCollectiveCounter:
    """Records every ``torch.distributed`` collective issued while active into a ``CommLedger``.

    Wraps the module-level functions of ``torch.distributed`` and ``distributed_c10d`` (DDP comm
    hooks, FSDP2 and the model averager call them through the module). Only the outermost call of
    nested wrappers is recorded. ``collective_bytes`` follows the ledger's convention (whole logical
    buffer), so the ledger's wire factors apply.
    """

    OPS = {
        "all_reduce": ("all_reduce", "tensor"),
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "all_gather_single": ("all_gather", "output_tensor"),
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "all_to_all_single": ("all_to_all", "input"),
        "broadcast": ("broadcast", "tensor"),
    }

    def __init__(self, ledger: Any, tag: str = "torch", ranks_per_node: int | None = None) -> None:
        self.ledger = ledger
        self.tag = tag
        self.ranks_per_node = ranks_per_node  # set: sub-group collectives get an @intra / @inter scope
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    def _wrap(self, name: str, fn: Any) -> Any:
        import torch.distributed as dist

        op, arg = self.OPS[name]
        sig = inspect.signature(fn)
        counter = self

        def wrapped(*a: Any, **k: Any) -> Any:
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                bound = sig.bind_partial(*a, **k).arguments
                t = bound[arg]
                nbytes = t.numel() * t.element_size()
                group = bound.get("group")
                counter.ledger.record(op, nbytes, nbytes, dist.get_world_size(group), tag=counter.tag_for(group))
            counter._local.depth = depth + 1
            try:
                return fn(*a, **k)
            finally:
                counter._local.depth = depth

        wrapped.__wrapped__ = fn
        return wrapped

    def tag_for(self, group: Any) -> str:
        """``tag@intra`` for a group inside one node, ``tag@inter`` for one rank per node, else ``tag`` (flat)."""
        import torch.distributed as dist

        if self.ranks_per_node is None or group is None or group is dist.group.WORLD:
            return self.tag
        nodes = [r // self.ranks_per_node for r in dist.get_process_group_ranks(group)]
        if len(nodes) > 1 and len(set(nodes)) == 1:
            return f"{self.tag}@intra"
        if len(nodes) > 1 and len(set(nodes)) == len(nodes) < dist.get_world_size():
            return f"{self.tag}@inter"
        return self.tag

    def __enter__(self) -> TorchCollectiveCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for mod in (dist, c10d):
            for name in self.OPS:
                fn = getattr(mod, name, None)
                if fn is not None:
                    self._saved.append((mod, name, fn))
                    setattr(mod, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()


def _ledger_wire(ledger: Any) -> tuple[float, int]:
    tot = ledger.summarize(ledger.cumulative, by="all").get("all")
    return (tot.wire_bytes, tot.calls) if tot is not None else (0.0, 0)


def _ledger_scopes(ledger: Any) -> dict[str, float]:
    by = ledger.summarize(ledger.cumulative, by="scope")
    return {scope: by[scope].wire_bytes if scope in by else 0.0 for scope in ("intra", "inter", "flat")}


def _make_step_timer(warmup: int, steps: int, iface: str, ledgers: dict[str, Any], scoped: bool = False):
    import lightning.pytorch as pl

    from benchmarks.netns import iface_bytes

    class StepTimer(pl.Callback):
        """Timestamps every step end; snapshots interface and ledger counters after step ``warmup``
        and after the last step (before validation traffic)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.snaps: list[dict] = []

        def snapshot(self) -> dict:
            c = iface_bytes(iface)
            snap = {"t": time.perf_counter(), "tx": c.tx, "rx": c.rx}
            for key, led in ledgers.items():
                snap[key], snap[key + "_calls"] = _ledger_wire(led)
                if scoped:
                    snap[key + "_scopes"] = _ledger_scopes(led)
            if scoped and iface != "lo":  # multi-rank nodes: the namespace's own lo carries the intra-node traffic
                snap["lo_tx"] = iface_bytes("lo").tx
            return snap

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.stamps.append(time.perf_counter())
            if len(self.stamps) in (warmup, steps):
                self.snaps.append(self.snapshot())

    return StepTimer()


def run_entry(entry: dict, spec: dict, rank: int) -> dict:
    """Train variant ``entry["variant"]`` for ``spec["steps"]`` steps with a fresh Trainer; return the figures."""
    from benchmarks.netbench.build import ablation_scope

    with ablation_scope():  # an ablation's patch must not outlive its entry (the process runs the whole schedule)
        return _train_entry(entry, spec, rank)


def _train_entry(entry: dict, spec: dict, rank: int) -> dict:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import LightningEnvironment

    from benchmarks.netbench.build import build_variant
    from lightning_qcomm.comm import CommLedger, set_ledger

    name = entry["variant"]
    steps, warmup = spec["steps"], spec["warmup"]
    rpn = spec.get("ranks_per_node", 1)
    node = rank // rpn
    pl.seed_everything(spec["seed"], verbose=False)
    lr_warmup = max(1, min(3, steps // 5))  # the model's linear lr warm-up (then cosine to 10%)
    strategy, module_cls, module_kw, callbacks = build_variant(
        name,
        warmup=warmup,
        lr=spec["lr"],
        lr_warmup=lr_warmup,
        timeout_s=spec["collective_timeout"],
        nodes=spec.get("nodes", 2),
        ranks_per_node=rpn,
    )
    module = module_cls(
        preset=spec["preset"],
        lr=spec["lr"],
        total_steps=steps,
        warmup_steps=lr_warmup,
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        **module_kw,
    )
    lq_ledger, dist_ledger = CommLedger(), CommLedger()
    set_ledger(lq_ledger)
    ledgers = {"lq": lq_ledger, "dist": dist_ledger}
    timer = _make_step_timer(warmup, steps, spec["ifaces"][node], ledgers, scoped=rpn > 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=rpn,
        num_nodes=spec.get("nodes", 2),
        strategy=strategy,
        plugins=[LightningEnvironment()],
        max_steps=steps,
        val_check_interval=steps,
        limit_val_batches=spec["val_batches"],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
    )
    t0 = time.perf_counter()
    try:
        with TorchCollectiveCounter(dist_ledger, ranks_per_node=rpn if rpn > 1 else None):
            trainer.fit(module)
    finally:
        set_ledger(None)
    fit_s = time.perf_counter() - t0
    if len(timer.snaps) != 2:
        raise RuntimeError(f"{name}: ran {len(timer.stamps)} steps, expected {steps}")
    a, b = timer.snaps
    n = steps - warmup
    durations = [t1 - t0_ for t0_, t1 in zip(timer.stamps[warmup - 1 : -1], timer.stamps[warmup:])]
    val = trainer.callback_metrics.get("val_loss")
    lq_calls = b["lq_calls"] - a["lq_calls"]
    key = "lq" if lq_calls > 0 else "dist"
    div = spec["wire_divisor"]
    extra = {}
    if rpn > 1:  # per-node figures: both ranks of a node read the same veth (inter) and lo (intra) counters
        extra = {"node": node, "local_rank": rank % rpn, "lo_tx_per_step": None}
        if "lo_tx" in b:  # netns only: on the loopback fallback lo is the machine-wide link itself
            extra["lo_tx_per_step"] = (b["lo_tx"] - a["lo_tx"]) / n
        for scope in ("intra", "inter", "flat"):
            extra[f"ledger_{scope}_per_step"] = (b[key + "_scopes"][scope] - a[key + "_scopes"][scope]) / n
    return {
        **extra,
        "variant": name,
        "repeat": entry["repeat"],
        "rank": rank,
        "steps_measured": n,
        "step_median_s": statistics.median(durations),
        "step_mean_s": (b["t"] - a["t"]) / n,
        "step_times_s": durations,
        "tx_per_step": (b["tx"] - a["tx"]) / n / div,
        "rx_per_step": (b["rx"] - a["rx"]) / n / div,
        "ledger_per_step": (b[key] - a[key]) / n,
        "ledger_source": {"lq": "lightning_qcomm CommLedger", "dist": "torch.distributed call counter"}[key],
        "lq_ledger_per_step": (b["lq"] - a["lq"]) / n,
        "lq_calls_per_step": lq_calls / n,
        "dist_per_step": (b["dist"] - a["dist"]) / n,
        "dist_calls_per_step": (b["dist_calls"] - a["dist_calls"]) / n,
        "train_losses": module.train_losses,
        "train_loss_last5": statistics.fmean(module.train_losses[-5:]),
        "val_loss": float(val) if val is not None else None,
        "fit_s": fit_s,
        "params": module.describe()["params"],
        "auto_choice": _auto_choice(strategy),
    }


def _auto_choice(strategy) -> str | None:
    """What an ``auto`` variant chose (its log line), None for the others."""
    trial = getattr(getattr(strategy, "hook_state", None), "trial", None)  # QuantDDPStrategy
    trial = trial or getattr(getattr(strategy, "comm_state", None), "trial", None)  # QSDPStrategy
    return None if trial is None else trial.describe()


def worker_main(spec_path: str, rank: int, results_path: str) -> int:
    """Run this rank's share of the schedule in ``spec_path``; one JSON line per event to ``results_path``."""
    spec = json.loads(Path(spec_path).read_text())
    import logging
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    if spec["flush_denormal"]:
        torch.set_flush_denormal(True)
    warnings.filterwarnings("ignore")
    for logger in ("lightning.pytorch", "lightning.fabric", "lightning_qcomm"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    world = spec.get("nodes", 2) * spec.get("ranks_per_node", 1)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=spec["collective_timeout"])
    )
    with open(results_path, "a", buffering=1) as out:

        def emit(event: str, entry: dict, **kw: Any) -> None:
            row = {"event": event, "id": entry["id"], "variant": entry["variant"], "repeat": entry["repeat"]}
            out.write(json.dumps({**row, "rank": rank, "rate_mbit": spec["rate_mbit"], **kw}) + "\n")

        for entry in spec["schedule"]:
            emit("start", entry)
            dist.barrier()
            try:
                res = run_entry(entry, spec, rank)
            except BaseException as e:  # noqa: BLE001 - reported; the orchestrator restarts a clean pair
                emit("error", entry, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
                return 3
            emit("done", entry, **res)
    dist.barrier()
    dist.destroy_process_group()
    return 0
