"""OneBitAdam vs DDP + AdamW on the shared benchmark GPT: final loss and ledger bytes per step in each phase.

Two gloo ranks on loopback (torch.multiprocessing spawn), each running every variant in-process through
Lightning (``Trainer(accelerator="cpu", devices=2)`` with ``LOCAL_RANK`` set). Same seed, data, model
(``benchmarks/bench_model.py``: GPT preset, AdamW, linear warm-up + cosine lr) and number of optimizer steps
for every variant; what changes is the optimizer/communication:

* ``ddp_adamw``: DDP whose gradient all-reduce is torch's default reduction plus one ledger record per bucket
  (``CommVolumeLogger``'s counting hook, registered on CPU), i.e. the fp32 baseline;
* ``onebit f=X%``: DDP + ``OneBitAdamCallback(freeze_step=X% of the steps)``;
* ``onebit auto``: the same with ``auto_freeze_threshold`` (the fixed freeze_step is only an upper bound);
* ``quant_ddp u8 + onebit``: warm-up gradients through QuantDDP's 8-bit uniform codec, then 1-bit momentum.

Bytes are the CommLedger's wire estimates (bytes one rank sends per step), median over the steps of each
phase, and their ratio to the fp32 ring all-reduce of all d parameters (2(N-1)/N * 4d). The overall ratio
is the run's total over the fp32 total. Loss: training loss averaged over the last 10 steps and both ranks,
and the validation loss of the final model. Wall-clock on a rate-limited link is ``python -m benchmarks.netbench``'s
job (row ``onebit_adam``); ms/step here is on a shared CPU, loopback, and only indicative.

    python benchmarks/onebit_adam_convergence.py --steps 200 --out benchmarks/results/onebit_adam.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from tests._helpers._launch import free_port, rank_results, spawn, write_rank_result  # noqa: E402


def _variants(steps: int) -> dict[str, dict]:
    return {
        "ddp_adamw": {"kind": "ddp"},
        "onebit f=15%": {"kind": "onebit", "cb": {"freeze_step": max(1, int(0.15 * steps))}},
        "onebit f=25%": {"kind": "onebit", "cb": {"freeze_step": max(1, int(0.25 * steps))}},
        "onebit auto": {
            "kind": "onebit",
            "cb": {
                "freeze_step": max(1, steps // 2),
                "auto_freeze_threshold": 0.1,
                "auto_freeze_interval": 10,
                "auto_freeze_patience": 3,
            },
        },
        "quant_ddp u8 + onebit f=15%": {"kind": "quant_ddp", "cb": {"freeze_step": max(1, int(0.15 * steps))}},
    }


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    import lightning.pytorch as pl
    from bench_model import BenchLM
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_qcomm.callbacks import OneBitAdamCallback
    from lightning_qcomm.callbacks.comm_logger import counting_allreduce_hook
    from lightning_qcomm.comm.ledger import CommLedger, get_ledger, set_ledger
    from lightning_qcomm.strategies.quant_ddp import QuantDDPStrategy

    class CPUHookDDP(DDPStrategy):
        """Lightning registers ``ddp_comm_hook`` only on CUDA; register it on CPU too."""

        def _register_ddp_hooks(self) -> None:
            if self._ddp_comm_hook is not None:
                _register_ddp_comm_hook(self.model, self._ddp_comm_state, self._ddp_comm_hook, self._ddp_comm_wrapper)

    class PerStep(pl.Callback):
        """Per optimizer step: wall time and the ledger's wire bytes by tag."""

        def __init__(self) -> None:
            self.t: list[float] = []
            self.bytes: list[dict[str, float]] = []
            self.r: list[tuple[int, float]] = []  # (step, variance change) at each auto-freeze check

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._t0 = time.perf_counter()
            self._b0 = {k: t.wire_bytes for k, t in get_ledger().cumulative.items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.t.append(time.perf_counter() - self._t0)
            opt = trainer.optimizers[0]
            cfg = getattr(opt, "config", None)
            if (
                cfg is not None
                and cfg.auto_freeze_threshold is not None
                and not (opt.frozen and opt.frozen_at < opt.num_steps)
            ):
                if opt.num_steps % cfg.auto_freeze_interval == 0:
                    self.r.append((opt.num_steps, opt.last_variance_change))
            step: dict[str, float] = {}
            for (op, tag), t in get_ledger().cumulative.items():
                step[tag] = step.get(tag, 0.0) + t.wire_bytes - self._b0.get((op, tag), 0.0)
            self.bytes.append(step)

    results = {}
    variants = _variants(args.steps)
    names = list(variants) if args.variants == "all" else ["ddp_adamw"] + [v for v in args.variants.split(",") if v]
    for name in dict.fromkeys(names):
        spec = variants[name]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
        os.environ["LOCAL_RANK"] = str(rank)
        ledger = CommLedger()
        set_ledger(ledger)
        callbacks: list = []
        onebit = None
        if spec["kind"] == "ddp":
            strategy = CPUHookDDP(ddp_comm_hook=counting_allreduce_hook)
        elif spec["kind"] == "quant_ddp":
            strategy = QuantDDPStrategy(codec="uniform", bits=8)
        else:
            strategy = CPUHookDDP()
        if "cb" in spec:
            onebit = OneBitAdamCallback(**spec["cb"])
            callbacks.append(onebit)
        per_step = PerStep()
        callbacks.append(per_step)
        pl.seed_everything(0, verbose=False)
        module = BenchLM(
            preset=args.preset,
            lr=args.lr,
            total_steps=args.steps,
            warmup_steps=args.lr_warmup,
            batch_size=args.batch,
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=callbacks,
        )
        trainer.fit(module)
        set_ledger(None)
        module.eval()
        with torch.no_grad():
            val = [float(module._loss(b)) for b in module.val_dataloader()]
        d = sum(p.numel() for p in module.parameters())
        frozen_at = onebit.optimizer.frozen_at if onebit is not None else None
        results[name] = {
            "train_tail": statistics.fmean(module.train_losses[-10:]),
            "val": statistics.fmean(val),
            "frozen_at": frozen_at,
            "bytes": per_step.bytes,
            "t": per_step.t,
            "d": d,
            "total_wire": sum(t.wire_bytes for t in ledger.cumulative.values()),
            "total_base": sum(t.baseline_bytes for t in ledger.cumulative.values()),
            "variance_changes": per_step.r,
        }
    write_rank_result(out, rank, results, "rank{rank}.pkl")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default="bench", help="bench_model preset (bench: 3.3M params)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--variants", default="all", help="comma list of variant names (ddp_adamw always runs) or all")
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    args = ap.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, free_port(), args, tmp, nprocs=2)
        res = rank_results(tmp, 2, "rank{rank}.pkl")
    duration = time.perf_counter() - start

    r0 = res[0]
    d = r0["ddp_adamw"]["d"]
    fp32_step = 2 * (2 - 1) / 2 * 4 * d  # fp32 ring all-reduce wire bytes per rank and step
    ddp_val = r0["ddp_adamw"]["val"]
    lines = [
        "| variant | freeze step | train loss (last 10) | val loss | val vs DDP | warm-up B/step | ratio | "
        "compression B/step | ratio | whole run vs fp32 | ms/step warm-up / compression (indicative) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in r0:
        a, b = r0[name], res[1][name]
        f = a["frozen_at"] if a["frozen_at"] is not None else args.steps
        per = [sum(s.values()) for s in a["bytes"]]
        warm, comp = per[:f], per[f:]
        t = [max(x, y) for x, y in zip(a["t"], b["t"])]  # the slower rank
        tw, tc = t[3:f], t[f + 1 :]
        train = (a["train_tail"] + b["train_tail"]) / 2
        rel = (a["val"] - ddp_val) / ddp_val * 100
        lines.append(
            f"| {name} | {a['frozen_at'] if a['frozen_at'] is not None else '-'} | {train:.4f} | {a['val']:.4f} | "
            f"{rel:+.2f}% | {_median(warm):,.0f} | {_median(warm) / fp32_step:.4f} | "
            f"{_median(comp):,.0f} | {_median(comp) / fp32_step:.4f} | {a['total_wire'] / a['total_base']:.4f} | "
            f"{1000 * _median(tw):.0f} / {1000 * _median(tc):.0f} |"
        )
    for name in r0:
        if r0[name]["variance_changes"]:
            tr = ", ".join(f"{step}: {r:.3f}" for step, r in r0[name]["variance_changes"])
            lines.append(
                f"\n{name}: variance change r = ||v_hat_t - v_hat_(t-k)|| / ||v_hat_t|| at each check (step: r): {tr}"
            )
    table = "\n".join(lines)
    cmd = "python benchmarks/onebit_adam_convergence.py " + " ".join(sys.argv[1:])
    header = (
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC ({duration:.0f} s): `{cmd}`\n\n"
        f"2 gloo ranks on CPU loopback; bench_model GPT preset {args.preset!r} ({d:,} parameters; fp32 ring "
        f"all-reduce = {fp32_step:,.0f} B sent per rank and step), batch {args.batch} x seq/rank, AdamW "
        f"lr {args.lr} (linear warm-up {args.lr_warmup} steps, cosine to 10%), {args.steps} optimizer steps, "
        "seed 0 for every variant. B/step = ledger wire bytes one rank sends, median over the steps of the "
        "phase (warm-up = steps before the freeze); ratio = that / fp32 ring all-reduce of all parameters.\n"
    )
    print(header + "\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + table + "\n")


if __name__ == "__main__":
    main()
