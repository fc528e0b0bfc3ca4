"""QuantDDPStrategy on CPU: final loss and gradient wire bytes vs DDP fp32, torch fp16 hook, PowerSGD.

Two gloo ranks (torch.multiprocessing spawn), each running every variant in-process through Lightning
(``Trainer(accelerator="cpu", devices=2)`` with ``LOCAL_RANK`` set, so no launcher per variant). Same
seed, data, model and optimizer for every variant; what changes is how gradient buckets are reduced.

Bytes: for lightning_qcomm variants the CommLedger's wire estimate of everything tagged ``grads``
(all-reduces plus the one-off cross-rank shape check) over the fp32 ring all-reduce baseline; for the
torch hooks the analytical ratio (fp16: 1/2) or PowerSGDState's own element counts (compressed steps only).
Wall-clock on a rate-limited link is measured by ``python -m benchmarks.netbench``, not here; ms/step here is
on a shared, loaded CPU and only indicative.

    python benchmarks/quant_ddp_convergence.py --steps 160 --out benchmarks/results/quant_ddp.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests._helpers._launch
from tests._helpers._launch import free_port, spawn  # noqa: E402

N_SAMPLES, N_FEAT, N_HID, N_CLS, BATCH, LR = 2048, 64, 128, 8, 32, 0.05

# name -> ("ours", QuantDDPStrategy kwargs) | ("torch", hook name)
VARIANTS: dict[str, tuple[str, object]] = {
    "ddp_fp32": ("torch", "allreduce"),
    "torch_fp16_hook": ("torch", "fp16"),
    "torch_powersgd_r4": ("torch", "powersgd4"),
    "quant_ddp none (fp32)": ("ours", {"codec": "none"}),
    "uniform 8": ("ours", {"codec": "uniform", "bits": 8}),
    "fp8_e4m3": ("ours", {"codec": "fp8_e4m3", "bits": 8}),
    "fp8_e5m2": ("ours", {"codec": "fp8_e5m2", "bits": 8}),
    "qsgd 8": ("ours", {"codec": "qsgd", "bits": 8}),
    "qsgdinf 8": ("ours", {"codec": "qsgdinf", "bits": 8}),
    "nuqsgd 8": ("ours", {"codec": "nuqsgd", "bits": 8}),
    "uniform 4": ("ours", {"codec": "uniform", "bits": 4}),
    "qsgdinf 4": ("ours", {"codec": "qsgdinf", "bits": 4}),
    "nuqsgd 4": ("ours", {"codec": "nuqsgd", "bits": 4}),
    "nuqsgd 4 + EF": ("ours", {"codec": "nuqsgd", "bits": 4, "error_feedback": True}),
    "qsgd 4": ("ours", {"codec": "qsgd", "bits": 4}),
    "qsgd 4 + EF": ("ours", {"codec": "qsgd", "bits": 4, "error_feedback": True}),
    "uniform 2": ("ours", {"codec": "uniform", "bits": 2}),
    "uniform 2 + EF": ("ours", {"codec": "uniform", "bits": 2, "error_feedback": True}),
    "uniform 2, seed 1": ("ours", {"codec": "uniform", "bits": 2, "seed": 1}),
    "uniform 2 + EF, seed 1": ("ours", {"codec": "uniform", "bits": 2, "error_feedback": True, "seed": 1}),
    "uniform 2, seed 2": ("ours", {"codec": "uniform", "bits": 2, "seed": 2}),
    "uniform 2 + EF, seed 2": ("ours", {"codec": "uniform", "bits": 2, "error_feedback": True, "seed": 2}),
    "qsgd 2": ("ours", {"codec": "qsgd", "bits": 2}),
}


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEAT, generator=g)
    y = (torch.tanh(x @ torch.randn(N_FEAT, 32, generator=g)) @ torch.randn(32, N_CLS, generator=g)).argmax(1)
    flip = torch.rand(N_SAMPLES, generator=g) < 0.1
    y = torch.where(flip, torch.randint(0, N_CLS, (N_SAMPLES,), generator=g), y)
    return torch.utils.data.TensorDataset(x, y)


def _module():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(N_FEAT, N_HID),
                torch.nn.Tanh(),
                torch.nn.Linear(N_HID, N_HID),
                torch.nn.Tanh(),
                torch.nn.Linear(N_HID, N_CLS),
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, shuffle=True)

    return Net()


def _full_loss(model) -> float:
    ds = _dataset()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(ds.tensors[0]), ds.tensors[1]))


def _torch_strategy(kind: str):
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    class CPUHookDDP(DDPStrategy):
        """Lightning registers ``ddp_comm_hook`` only on CUDA; register it on CPU too."""

        def _register_ddp_hooks(self) -> None:
            _register_ddp_comm_hook(self.model, self._ddp_comm_state, self._ddp_comm_hook, self._ddp_comm_wrapper)

    if kind == "allreduce":
        return CPUHookDDP(ddp_comm_hook=default_hooks.allreduce_hook), None
    if kind == "fp16":
        return CPUHookDDP(ddp_comm_hook=default_hooks.fp16_compress_hook), None
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, use_error_feedback=True
    )
    return CPUHookDDP(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook), state


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    import lightning.pytorch as pl

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger
    from lightning_qcomm.strategies.quant_ddp import QuantDDPStrategy

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []
            self.curve: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.t.append(time.perf_counter() - self._t0)
            if trainer.global_step % (steps // 4) == 0:
                self.curve.append(_full_loss(pl_module))

    results = {}
    ref = None  # final parameters of the first variant (DDP fp32)
    for name, (family, spec) in VARIANTS.items():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
        os.environ["LOCAL_RANK"] = str(rank)
        ledger = CommLedger()
        set_ledger(ledger)
        psgd_state = None
        if family == "torch":
            strategy, psgd_state = _torch_strategy(spec)
        else:
            strategy = QuantDDPStrategy(**spec)
        pl.seed_everything(0, verbose=False)
        module = _module()
        timer = Timer()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(module)
        set_ledger(None)
        if family == "ours":
            grads = [t for (op, tag), t in ledger.cumulative.items() if tag == "grads"]
            wire = sum(t.wire_bytes for t in grads)
            base = sum(t.baseline_bytes for t in grads if t.baseline_bytes)
            ratio = wire / base
        elif spec == "allreduce":
            ratio = 1.0
        elif spec == "fp16":
            ratio = 0.5
        else:
            _, before, after = psgd_state.compression_stats()
            ratio = after / before
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        ref = flat if ref is None else ref
        results[name] = {
            "dist": float((flat - ref).norm() / ref.norm()),
            "loss": _full_loss(module),
            "curve": timer.curve,
            "ratio": ratio,
            "ms_per_step": 1000 * statistics.median(timer.t[5:]),
        }
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "res.pkl")
        spawn(_worker, free_port(), args.steps, path, nprocs=2)
        with open(path, "rb") as f:
            res = pickle.load(f)
    ddp = res["ddp_fp32"]["loss"]
    n_params = sum(p.numel() for p in _module().parameters())
    q = args.steps // 4
    lines = [
        "| variant | final loss | vs DDP fp32 | loss @ steps " + "/".join(str(q * i) for i in range(1, 5)) + " | "
        "grad wire bytes / fp32 ring | param distance to DDP | ms/step (indicative) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        curve = " / ".join(f"{v:.3f}" for v in r["curve"])
        rel = (r["loss"] - ddp) / ddp * 100
        lines.append(
            f"| {name} | {r['loss']:.4f} | {rel:+.2f}% | {curve} | {r['ratio']:.4f} | {r['dist']:.3f} | {r['ms_per_step']:.1f} |"
        )
    table = "\n".join(lines)
    cmd = "python benchmarks/quant_ddp_convergence.py " + " ".join(sys.argv[1:])
    header = (
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: `{cmd}`\n\n"
        f"2 gloo ranks on CPU, MLP {N_FEAT}-{N_HID}-{N_HID}-{N_CLS} ({n_params} parameters, one DDP bucket), "
        f"{N_SAMPLES} samples, batch {BATCH}/rank, SGD lr {LR} momentum 0.9, {args.steps} optimizer steps, "
        "seed 0 for every variant. QuantDDP defaults: bucket_size=512, min_quant_numel=1024 "
        "(biases travel in fp32), start_step=0. Final loss = cross-entropy of the final model on the whole "
        "data set; param distance = ||theta - theta_DDP|| / ||theta_DDP|| of the final parameters.\n"
    )
    print(header + "\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + table + "\n")


if __name__ == "__main__":
    main()
