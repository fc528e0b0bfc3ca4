"""Every strategy as a user runs it, on whichever torch is installed: loss against DDP's and an exact resume.

Lightning's demo ``Transformer`` (``lightning.pytorch.demos``) with a 32,768-token vocabulary, trained by
``Trainer.fit`` on CPU ranks (gloo) started the way torchrun starts them: DDP (the reference), QSDP W8G8 and W4G4,
QuantDDP, Local SGD and DDP + 1-bit Adam on 2 ranks; DDP and QSDP over HSDP (W8G8 across nodes) on 2 nodes x 2
ranks. Tokens: the running Python's standard library sources cut into byte pairs (token = 256·b0 + b1 mod 32768;
the source is mostly ASCII, so most pairs are their own token), next-token labels, nothing downloaded; the token
stream is as long as one epoch, so epoch 2 revisits epoch 1's. Two ways to feed the demo's encoder-decoder
(``--feed``):

* ``causal`` (the default): a language model that cannot see its labels. Each sample is 2T + 1 consecutive
  tokens t_0..t_2T: the encoder reads the previous window t_0..t_{T-1} (no mask: all of it is in the past), the
  decoder reads t_T..t_{2T-1} under the demo's causal mask, and position i predicts t_{T+i+1}. Every token a
  prediction sees precedes its label, so the loss stays above the text's entropy and a ratio against DDP's loss
  compares methods on a loss that does not head to 0.
* ``demo``: as ``LightningTransformer`` feeds it, ``model(inputs, target)``: the decoder reads the labels and
  the causal mask shows position i label i (and the unmasked encoder reads input i + 1 = label i), so the loss
  tends to 0 as the model learns to copy and a ratio against DDP's gets stricter the longer the run
  (BENCHMARKS.md §11 measures this).

Per strategy, three fits from the same seed: two epochs straight; one epoch then ``trainer.save_checkpoint``; and
the second epoch resumed from that checkpoint. The table gives rank 0's mean training loss over the last
``TAIL`` steps against DDP's on the same ranks ("vs DDP", the acceptance bound is 3%), and the largest difference
between the resumed second epoch's losses and the straight run's ("resume": 0 means bit for bit).

Command (one torch per environment; prints the torch version in the title)::

    OMP_NUM_THREADS=1 python benchmarks/torch_versions.py [--steps 24] [--feed causal|demo] [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB = 32768
SEQ = 32
BATCH = 8  # per rank
TAIL = 8
DIAGNOSTICS = {"qsdp_w4g8", "qsdp_w8g4", "qsdp_w4g4_b128"}  # with --only only: what W4G4's gap comes from
FEEDS = ("causal", "demo")  # module docstring


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(n: int) -> torch.Tensor:
    raw = b""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        raw += path.read_bytes()
        if len(raw) >= 2 * n:
            break
    b = torch.frombuffer(bytearray(raw[: 2 * n]), dtype=torch.uint8).long().view(-1, 2)
    return (b[:, 0] * 256 + b[:, 1]) % VOCAB


def _module():
    import lightning.pytorch as pl
    from lightning.pytorch.demos import Transformer

    class Demo(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Transformer(vocab_size=VOCAB, ninp=64, nhead=2, nhid=128, nlayers=2, dropout=0.0)
            self.losses: list[float] = []

        def predict(self, batch):
            """(log-probabilities (B*T, V), labels (B, T)) of a ``dataset`` batch of either feed."""
            if len(batch) == 3:  # causal: the previous window to the encoder, the inputs to the decoder
                src, x, y = batch
                return self.model(src, x), y
            x, y = batch  # demo: the labels to the decoder, as LightningTransformer does
            return self.model(x, y), y

        def training_step(self, batch, batch_idx):
            out, y = self.predict(batch)
            loss = torch.nn.functional.nll_loss(out, y.reshape(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    return Demo()


def _strategy(name: str):
    from lightning_qcomm import LocalSGDStrategy, QSDPStrategy, QuantDDPStrategy

    if name in ("ddp", "ddp_onebit_adam"):
        return "ddp"
    return {
        "qsdp_w8g8": lambda: QSDPStrategy(bits=8, min_wrap_numel=10_000),
        "qsdp_w4g4": lambda: QSDPStrategy(bits=4, min_wrap_numel=10_000),
        "hsdp_w8g8": lambda: QSDPStrategy(bits=8, hsdp=True, min_wrap_numel=10_000),
        "quant_ddp": lambda: QuantDDPStrategy(bits=8),
        "local_sgd": lambda: LocalSGDStrategy(sync="constant", period=4),
        # diagnostics, only with --only: which direction of W4G4 costs, and a quarter of its scale bucket
        "qsdp_w4g8": lambda: QSDPStrategy(weight_bits=4, grad_bits=8, min_wrap_numel=10_000),
        "qsdp_w8g4": lambda: QSDPStrategy(weight_bits=8, grad_bits=4, min_wrap_numel=10_000),
        "qsdp_w4g4_b128": lambda: QSDPStrategy(bits=4, bucket_size=128, min_wrap_numel=10_000),
    }[name]()


def dataset(feed: str, samples: int) -> torch.utils.data.TensorDataset:
    """``samples`` training samples for ``feed`` (module docstring): (previous window, inputs, labels) of SEQ
    tokens each for ``causal``, (inputs, labels) for ``demo``; labels are the inputs one token on.

    Example::

        src, x, y = dataset("causal", 4).tensors   # each (4, SEQ); y[:, :-1] == x[:, 1:], src precedes x
    """
    if feed not in FEEDS:
        raise ValueError(f"feed={feed!r}: allowed {FEEDS}")
    if feed == "demo":
        data = _tokens(samples * (SEQ + 1)).view(-1, SEQ + 1)
        return torch.utils.data.TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    data = _tokens(samples * (2 * SEQ + 1)).view(-1, 2 * SEQ + 1)
    parts = (data[:, :SEQ], data[:, SEQ : 2 * SEQ], data[:, SEQ + 1 :])
    return torch.utils.data.TensorDataset(*(p.contiguous() for p in parts))


def _fit(
    name: str, world: int, per_node: int, epochs: int, steps: int, feed: str, save: str | None, resume: str | None
):
    import lightning.pytorch as pl

    from lightning_qcomm import OneBitAdamCallback

    data = dataset(feed, world * BATCH * steps)
    module = _module()
    # the variance frozen after the first epoch (1-bit Adam's warm-up: a quarter to a half of a short run)
    callbacks = [OneBitAdamCallback(freeze_step=steps)] if name == "ddp_onebit_adam" else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=_strategy(name),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return module.losses


def _worker(rank: int, world: int, per_node: int, port: int, names: list[str], steps: int, feed: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        NODE_RANK=str(rank // per_node),
        LOCAL_RANK=str(rank % per_node),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    result = {}
    for name in names:
        ckpt = os.path.join(out, f"{name}.ckpt")
        straight = _fit(name, world, per_node, 2, steps, feed, None, None)
        _fit(name, world, per_node, 1, steps, feed, ckpt, None)
        resumed = _fit(name, world, per_node, 2, steps, feed, None, ckpt)
        result[name] = {"straight": straight, "resumed": resumed}
    if rank == 0:
        Path(out, f"world{world}.json").write_text(json.dumps(result))


def _rows(result: dict, reference: str, world: int) -> list[str]:
    ref = result[reference]["straight"]
    ref_tail = sum(ref[-TAIL:]) / TAIL
    rows = []
    for name, r in result.items():
        straight, resumed = r["straight"], r["resumed"]
        tail = sum(straight[-TAIL:]) / TAIL
        second = straight[len(straight) - len(resumed) :]
        gap = max((abs(a - b) for a, b in zip(resumed, second)), default=float("nan"))
        exact = "exact" if len(resumed) == len(second) and gap == 0 else f"max diff {gap:.2e}"
        ratio = tail / ref_tail - 1
        ok = "yes" if abs(ratio) <= 0.03 and exact == "exact" else "NO"
        rows.append(
            f"| {name} | {world} | {straight[0]:.3f} | {tail:.4f} | {ratio:+.2%} | {exact} ({len(resumed)} steps) | {ok} |"
        )
    return rows


PLANS = [  # (ranks, ranks per node, strategies); DDP first in each: the reference
    (2, 2, ["ddp", "qsdp_w8g8", "qsdp_w4g4", "quant_ddp", "local_sgd", "ddp_onebit_adam"]),
    (4, 2, ["ddp", "hsdp_w8g8"]),
]


def select_plans(only: str | None) -> list[tuple[int, int, list[str]]]:
    """The runs for ``--only`` (None: every plan): DDP stays in each plan that keeps another strategy, a
    diagnostic joins the 2-rank plan, and an unknown name raises ValueError with the allowed set.

    Example::

        select_plans("qsdp_w4g4,qsdp_w4g4_b128")   # [(2, 2, ["ddp", "qsdp_w4g4", "qsdp_w4g4_b128"])]
    """
    if not only:
        return [(w, n, list(names)) for w, n, names in PLANS]
    asked = only.split(",")
    planned = {x for _, _, names in PLANS for x in names}
    unknown = [x for x in asked if x not in planned | DIAGNOSTICS]
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: unknown; allowed: {', '.join(sorted(planned | DIAGNOSTICS))}")
    wanted = {"ddp", *asked}
    extra = [x for x in asked if x in DIAGNOSTICS]
    plans = [(w, n, [x for x in names if x in wanted] + (extra if w == 2 else [])) for w, n, names in PLANS]
    return [p for p in plans if len(p[2]) > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per epoch (two epochs per run)")
    parser.add_argument("--feed", default="causal", choices=FEEDS, help="how the demo is fed (module docstring)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated strategies (DDP always runs, the reference); also the diagnostics qsdp_w4g8, "
        "qsdp_w8g4, qsdp_w4g4_b128",
    )
    args = parser.parse_args()
    plans = select_plans(args.only)
    lines = [
        f"torch {torch.__version__}, {sys.platform}, CPU/gloo; Lightning demo Transformer (vocab {VOCAB}, "
        f"{SEQ} tokens x {BATCH} per rank, {args.steps} steps per epoch, 2 epochs, feed {args.feed}; loss = rank 0's "
        f"mean over the last {TAIL} steps)",
        "",
        "| strategy | ranks | first loss | final loss | vs DDP | resume from epoch 1 | within 3% and exact |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as out:
        for world, per_node, names in plans:
            mp.spawn(
                _worker, args=(world, per_node, _port(), names, args.steps, args.feed, out), nprocs=world, join=True
            )
            lines += _rows(json.loads(Path(out, f"world{world}.json").read_text()), "ddp", world)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
