"""OneBitAdam vs DDP + AdamW on models with a large vocabulary: Lightning's demo transformer and a GPT-2 shape.

Two gloo ranks (torch.multiprocessing spawn, ``OMP_NUM_THREADS=1``), each running every variant in-process through
Lightning (``Trainer(accelerator="cpu", devices=2)``). Models:

* ``demo``: ``lightning.pytorch.demos.Transformer`` (the model of ``LightningTransformer``: ``nn.Transformer``
  encoder-decoder, 200-wide, 2+2 layers, dropout 0.2) with a 24,113-token vocabulary. Its data set (WikiText-2) is a
  download, which this machine cannot make; the tokens here are synthetic but learnable (below);
* ``gpt2``: ``transformers.GPT2LMHeadModel`` with GPT-2's 50,257-token vocabulary, tied embeddings, 2 layers,
  128 wide, 2 heads.

Data: a Zipf-distributed token stream (exponent 1.1 over a fixed random ranking of the vocabulary, as word
frequencies are), where each token is followed by its fixed successor with probability 0.7 and by a fresh Zipf draw
otherwise: learnable (a bigram table), and like text most vocabulary rows see a gradient only rarely. Each rank
draws its own stream (seeded by seed and rank); every variant sees the same batches.

Variants: ``ddp_adamw`` (DDP's fp32 gradient all-reduce, counted), ``quant_<codec>_<bits>``
(``QuantDDPStrategy(codec=<codec>, bits=<bits>)``, its defaults otherwise), ``onebit`` (DDP +
``OneBitAdamCallback(freeze_step=F)``), ``onebit_exact`` (the same, but the momentum average is exact fp32: the
frozen variance alone, without 1-bit compression; a diagnostic, its bytes are not 1-bit's), ``onebit_vreplace``
(a diagnostic of the variance refresh: v̂ is replaced by the window's mean square gradient instead of blended with
β2^K).

Reported: training loss (mean of both ranks) over the last 10 steps (and the last 5), its ratio to DDP+AdamW's, and the ledger's
wire bytes per step after the freeze over the fp32 ring all-reduce of all parameters (median and mean over the steps;
the mean counts the variance refresh every ``variance_refresh`` steps). ``--diag`` also records per
tensor, on steps around the freeze, the update's RMS and its largest row RMS (dim 0: a token's row of an embedding
or output layer) in units of lr -- Adam's per-coordinate step is about lr or less.

    python benchmarks/onebit_vocab_convergence.py --model demo --steps 500 --seeds 0 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from tests._helpers._launch import free_port, rank_results, spawn, write_rank_result  # noqa: E402

VOCAB = {"demo": 24113, "gpt2": 50257}


def zipf_bigram_tokens(vocab: int, n: int, seed: int, follow: float = 0.7, alpha: float = 1.1) -> torch.Tensor:
    """``n`` tokens of a Zipf bigram stream (see the module doc); the successor table depends on ``vocab`` only."""
    table = torch.Generator().manual_seed(12345)
    rank_of = torch.randperm(vocab, generator=table)  # token of each frequency rank
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** alpha
    succ = rank_of[torch.multinomial(probs, vocab, replacement=True, generator=table)]
    g = torch.Generator().manual_seed(seed)
    fresh = rank_of[torch.multinomial(probs, n, replacement=True, generator=g)]
    keep = torch.rand(n, generator=g) < follow
    out = torch.empty(n, dtype=torch.long)
    out[0] = fresh[0]
    for i in range(1, n):  # n is small (steps * batch * seq), a Python loop is fine
        out[i] = succ[out[i - 1]] if keep[i] else fresh[i]
    return out


def _module(model: str, lr: float, seq: int):
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if model == "demo":
                from lightning.pytorch.demos import Transformer

                self.model = Transformer(vocab_size=VOCAB["demo"])
            else:
                from transformers import GPT2Config, GPT2LMHeadModel

                cfg = GPT2Config(
                    vocab_size=VOCAB["gpt2"], n_positions=seq, n_embd=128, n_layer=2, n_head=2, tie_word_embeddings=True
                )
                self.model = GPT2LMHeadModel(cfg)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if model == "demo":  # LightningTransformer.training_step
                loss = F.nll_loss(self.model(x, y), y.view(-1))
            else:
                loss = F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.reshape(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LM()


def _exact_average(x, worker_error, server_error, group=None, **kw):
    """Stand-in for ``onebit_all_reduce``: the exact fp32 mean (the ``onebit_exact`` diagnostic)."""
    import torch.distributed as dist

    dist.all_reduce(x, group=group)
    x.div_(dist.get_world_size(group))
    return x


def _replace_refresh(self, param_groups, state, process_group=None):
    """``VarianceRefresh.refresh`` with v̂ <- s (the window's mean square gradient) instead of the β2^K blend."""
    entries = [
        (g, [p for p in g["params"] if p.requires_grad and "exp_avg_sq" in state.get(p, {})]) for g in param_groups
    ]
    params = [p for _, ps in entries for p in ps]
    for p in params:
        self.sums.setdefault(p, torch.zeros_like(state[p]["exp_avg_sq"]))
    self._average_([self.sums[p] for p in params], process_group)
    for p in params:
        state[p]["exp_avg_sq"].copy_(self.sums[p]).div_(self.every)
        self.sums[p].zero_()


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_qcomm.adapters.onebit import sync as onebit_mod
    from lightning_qcomm.callbacks import OneBitAdamCallback
    from lightning_qcomm.callbacks.comm_logger import counting_allreduce_hook
    from lightning_qcomm.comm.ledger import CommLedger, get_ledger, set_ledger
    from lightning_qcomm.optim.variance_refresh import VarianceRefresh

    blend_refresh = VarianceRefresh.refresh

    class CPUHookDDP(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            if self._ddp_comm_hook is not None:
                _register_ddp_comm_hook(self.model, self._ddp_comm_state, self._ddp_comm_hook, self._ddp_comm_wrapper)

    class PerStep(pl.Callback):
        """Ledger bytes per step; with ``diag`` the update sizes per tensor (units of lr) on chosen steps."""

        def __init__(self, diag_steps: set[int], lr: float) -> None:
            self.bytes: list[float] = []
            self.diag_steps, self.lr = diag_steps, lr
            self.diag: dict[int, dict[str, tuple[float, float]]] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._b0 = sum(t.wire_bytes for t in get_ledger().cumulative.values())
            self._before = None
            if trainer.global_step in self.diag_steps:
                self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.bytes.append(sum(t.wire_bytes for t in get_ledger().cumulative.values()) - self._b0)
            if self._before is None:
                return
            stats = {}
            for n, p in pl_module.named_parameters():
                d = (p.detach() - self._before[n]).double() / self.lr
                rows = d.reshape(d.shape[0], -1) if d.dim() > 1 else d.reshape(-1, 1)
                stats[n] = (float(d.pow(2).mean().sqrt()), float(rows.pow(2).mean(1).sqrt().max()))
            self.diag[trainer.global_step - 1] = stats

    n = args.steps * args.batch * (args.seq + 1)
    results = {}
    for seed in args.seeds:
        tokens = zipf_bigram_tokens(VOCAB[args.model], n, seed=1000 * seed + rank).view(-1, args.seq + 1)
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        for name in args.variants:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
            os.environ["LOCAL_RANK"] = str(rank)
            ledger = CommLedger()
            set_ledger(ledger)
            callbacks: list = []
            onebit = None
            onebit_mod.onebit_all_reduce = _exact_average if name == "onebit_exact" else args.real_reduce
            VarianceRefresh.refresh = _replace_refresh if name == "onebit_vreplace" else blend_refresh
            if name == "ddp_adamw":
                strategy = CPUHookDDP(ddp_comm_hook=counting_allreduce_hook)
            elif name.startswith("quant_"):  # quant_<codec>_<bits>: QuantDDPStrategy(codec=..., bits=...)
                from lightning_qcomm import QuantDDPStrategy

                codec, bits = name[len("quant_") :].rsplit("_", 1)
                strategy = QuantDDPStrategy(codec=codec, bits=int(bits))
            else:
                strategy = CPUHookDDP()
                cb = dict(args.cb)
                if name.startswith("onebit_b"):  # onebit_b<B>: one 1-bit scale per block of B elements (0: per chunk)
                    cb["scale_block"] = int(name[len("onebit_b") :])
                onebit = OneBitAdamCallback(freeze_step=args.freeze, **cb)
                callbacks.append(onebit)
            f = args.freeze
            diag = set(range(f - 3, f + 8)) | {f + 20, f + 50, f + 100} if args.diag else set()
            per_step = PerStep(diag, args.lr)
            callbacks.append(per_step)
            pl.seed_everything(seed, verbose=False)
            module = _module(args.model, args.lr, args.seq)
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
            trainer.fit(module, DataLoader(data, batch_size=args.batch, shuffle=False))
            set_ledger(None)
            results[(seed, name)] = {
                "losses": module.losses,
                "bytes": per_step.bytes,
                "d": sum(p.numel() for p in module.parameters()),
                "frozen_at": None if onebit is None else onebit.optimizer.frozen_at,
                "change_at_freeze": getattr(onebit and onebit.optimizer, "change_at_freeze", None),
                "unusable_at_freeze": getattr(onebit and onebit.optimizer, "unusable_at_freeze", None),
                "diag": per_step.diag,
            }
    write_rank_result(out, rank, results, "rank{rank}.pkl")


def summarize(res: list[dict], args: argparse.Namespace) -> dict:
    """Per seed and variant: last-10 training loss (mean over ranks), its ratio to DDP+AdamW's, bytes ratio."""
    r0, r1 = res
    rows = {}
    for (seed, name), a in r0.items():
        b = r1[(seed, name)]
        losses = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"])]
        fp32 = 2 * (2 - 1) / 2 * 4 * a["d"]
        after = a["bytes"][a["frozen_at"] :] if a["frozen_at"] is not None else []
        rows[f"{seed}/{name}"] = {
            "tail": statistics.fmean(losses[-10:]),
            "tail5": statistics.fmean(losses[-5:]),
            "curve": [round(statistics.fmean(losses[i : i + 10]), 4) for i in range(0, len(losses), 10)],
            "bytes_after_freeze_ratio": statistics.median(after) / fp32 if after else None,
            "bytes_after_freeze_mean_ratio": statistics.fmean(after) / fp32 if after else None,
            "d": a["d"],
            "change_at_freeze": a.get("change_at_freeze"),
            "unusable_at_freeze": a.get("unusable_at_freeze"),
            "diag": {str(k): v for k, v in a["diag"].items()},
        }
    for key, row in rows.items():
        seed = key.split("/")[0]
        base = rows.get(f"{seed}/ddp_adamw")
        row["vs_adamw"] = row["tail"] / base["tail"] if base else None
        row["vs_adamw5"] = row["tail5"] / base["tail5"] if base else None
    return rows


def _cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``) and core count, for the results file."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    except OSError:
        names = []
    return f"CPU: {names[0] if names else 'unknown'} ({os.cpu_count()} cores), 2 gloo ranks, 1 thread each"


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(VOCAB), default="demo")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--freeze", type=int, default=None, help="freeze_step (default: 20%% of --steps)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--seeds", default="0", help="comma list")
    ap.add_argument(
        "--variants",
        default="ddp_adamw,onebit",
        help="comma list of ddp_adamw, onebit, onebit_exact, onebit_vreplace, onebit_b<B> (scale_block=B), "
        "quant_<codec>_<bits> (QuantDDPStrategy(codec=<codec>, bits=<bits>), e.g. quant_eden_2)",
    )
    ap.add_argument("--cb", default="{}", help="extra OneBitAdamCallback arguments as JSON")
    ap.add_argument("--diag", action="store_true", help="record update sizes per tensor around the freeze")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    args.freeze = args.freeze or max(1, args.steps // 5)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.variants = args.variants.split(",")
    args.cb = json.loads(args.cb)
    from lightning_qcomm.adapters.onebit import sync as onebit_mod

    args.real_reduce = onebit_mod.onebit_all_reduce
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, free_port(), args, tmp, nprocs=2)
        res = rank_results(tmp, 2, "rank{rank}.pkl")
    rows = summarize(res, args)
    meta = {
        "command": "python benchmarks/onebit_vocab_convergence.py " + " ".join(sys.argv[1:]),
        "utc": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        "seconds": round(time.perf_counter() - start),
        "freeze_step": args.freeze,
        "device": _cpu_name(),
        "torch": torch.__version__,
        "commit": _commit(),
    }
    if args.out:  # before the summary lines: a run's figures are never lost to a print
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    for key, row in rows.items():
        br, vs = row["bytes_after_freeze_ratio"], row["vs_adamw"]
        print(
            f"{key}: loss(last 10) {row['tail']:.4f}  vs AdamW {'-' if vs is None else f'{vs:.4f}'}  "
            f"loss(last 5) {row['tail5']:.4f}  vs AdamW {row['vs_adamw5'] or 0:.4f}  bytes after "
            f"freeze {'-' if br is None else f'{br:.4f}'}x fp32 (mean {row['bytes_after_freeze_mean_ratio'] or 0:.4f}x)"
            f"  curve {row['curve']}"
        )


if __name__ == "__main__":
    main()
