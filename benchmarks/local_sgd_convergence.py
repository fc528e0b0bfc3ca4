"""Small CPU convergence comparison: data-parallel AdamW (DDP) vs Local AdamW (constant H) vs QSR vs post-local.

Two gloo ranks on CPU, Lightning ``accelerator="cpu", devices=2`` (spawn). Task: classify inputs labelled
by a fixed random teacher MLP (32 -> 10 classes); student MLP 32-128-128-10 (~22k parameters); AdamW,
linear warmup (10%) then cosine decay to 0, per-rank batch 32. All runs see the same data in the same
order; only the synchronization differs. Reported per run: communication rounds (optimizer steps with a
collective), bytes on the wire per rank (ledger for Local SGD, 2(N-1)/N * 4 * numel per step for DDP),
final validation loss / accuracy of the averaged model (validation is a sync point), wall time.

    OMP_NUM_THREADS=1 python benchmarks/local_sgd_convergence.py [--steps 400] [--alphas 0.004,0.006]

The wall time on this shared 2-core machine is disturbed by other processes and says nothing about a
network-bound run (see ``python -m benchmarks.netbench`` for that); the loss and round counts are what this measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_qcomm.comm.ledger import CommLedger, get_ledger, set_ledger  # noqa: E402
from lightning_qcomm.strategies.local_sgd import LocalSGDStrategy  # noqa: E402

IN, CLASSES, HIDDEN = 32, 10, 128
N_TRAIN, N_VAL = 8192, 2048
BATCH = 32


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(IN, 64, generator=g), torch.randn(64, CLASSES, generator=g)
    gx = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=gx)
    logits = torch.tanh(x @ w1) @ w2
    y = logits.argmax(-1)
    flip = torch.rand(n, generator=gx) < 0.1  # 10% label noise
    y = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=gx), y)
    return TensorDataset(x, y)


class Student(L.LightningModule):
    def __init__(self, steps: int, peak_lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN),
            torch.nn.GELU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.GELU(),
            torch.nn.Linear(HIDDEN, CLASSES),
        )
        self.steps, self.peak_lr = steps, peak_lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.peak_lr, weight_decay=0.05)
        warm = max(1, self.steps // 10)

        def factor(t: int) -> float:
            if t < warm:
                return (t + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warm) / (self.steps - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(N_TRAIN, 1), batch_size=BATCH, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(make_data(N_VAL, 2), batch_size=512)


class Report(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage):
        set_ledger(CommLedger())

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        s = trainer.strategy
        numel = sum(p.numel() for p in pl_module.parameters())
        out = {"steps": trainer.global_step, "numel": numel}
        if isinstance(s, LocalSGDStrategy):
            totals = CommLedger.summarize(get_ledger().cumulative, by="all").get("all")
            out.update(rounds=s.num_syncs, forced=s.num_forced_syncs, wire_bytes=totals.wire_bytes if totals else 0.0)
        else:
            n = trainer.world_size
            out.update(
                rounds=trainer.global_step, forced=0, wire_bytes=trainer.global_step * 2 * (n - 1) / n * 4 * numel
            )
        with open(self.path, "w") as f:
            json.dump(out, f)


def run(name: str, strategy, steps: int, peak_lr: float, workdir: str) -> dict:
    path = os.path.join(workdir, f"{name}.json")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=steps,  # one validation, at the last step, on the averaged model
        callbacks=[Report(path)],
    )
    t0 = time.perf_counter()
    trainer.fit(Student(steps, peak_lr))
    wall = time.perf_counter() - t0
    with open(path) as f:
        out = json.load(f)
    out.update(
        name=name,
        wall_s=wall,
        val_loss=float(trainer.callback_metrics["val_loss"]),
        val_acc=float(trainer.callback_metrics["val_acc"]),
    )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--peak-lr", type=float, default=3e-3)
    p.add_argument("--alphas", type=str, default="0.004,0.006")
    p.add_argument("--h-base", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    warm = max(1, args.steps // 10)
    configs = [("ddp_adamw", L.pytorch.strategies.DDPStrategy(start_method="spawn"))]
    configs.append(
        (f"local_adamw_h{args.h_base}", LocalSGDStrategy(sync="constant", period=args.h_base, start_method="spawn"))
    )
    for a in (float(s) for s in args.alphas.split(",") if s):
        configs.append(
            (
                f"qsr_alpha{a:g}",
                LocalSGDStrategy(sync="qsr", h_base=args.h_base, alpha=a, warmup_steps=warm, start_method="spawn"),
            )
        )
    configs.append(
        (
            f"post_local_switch{warm}_h{args.h_base}",
            LocalSGDStrategy(sync="post_local", switch_step=warm, period=args.h_base, start_method="spawn"),
        )
    )
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name, strategy in configs:
            results.append(run(name, strategy, args.steps, args.peak_lr, d))
            r = results[-1]
            print(json.dumps(r), flush=True)
    base = results[0]
    print(f"\nsteps={args.steps} peak_lr={args.peak_lr} warmup={warm} cosine, 2 ranks, per-rank batch {BATCH}")
    print("| run | comm rounds | % of steps | wire MB/rank | val loss | vs DDP | val acc | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['rounds']} (+{r['forced']} forced) | {100 * r['rounds'] / r['steps']:.1f}% | "
            f"{r['wire_bytes'] / 1e6:.2f} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / base['val_loss'] - 1):+.1f}% | "
            f"{r['val_acc']:.4f} | {r['wall_s']:.0f} |"
        )
    return results


if __name__ == "__main__":
    main()
