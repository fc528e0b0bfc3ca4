"""The demo workload behind ``lightning-qcomm`` and ``examples/gpt_char.py``: a small GPT over bytes.

* ``StdlibBytes``: a ``LightningDataModule`` whose corpus is the Python standard library's own source
  (``sysconfig.get_paths()["stdlib"]``): the top-level ``*.py`` files in sorted name order, concatenated
  and capped at ``max_bytes``. Nothing is downloaded; the text is real code. Each sample is a window of
  ``block_size + 1`` bytes, cut at stride ``block_size`` (non-overlapping targets); the last
  ``val_fraction`` of the corpus is held out for validation.
* ``ByteGPT``: a GPT-2-style decoder (pre-norm blocks: LayerNorm, causal self-attention, LayerNorm,
  GELU MLP; learned positions; tied embedding/head) over the 256 byte values, trained with AdamW and
  a linear-warmup cosine learning-rate schedule (per optimizer step), which Local SGD's QSR reads.
* ``LossVsBytesPlot``: the quickstart's picture. At the end of training, rank 0 draws its training loss
  against the bytes it sent so far, beside the same losses placed at the bytes DDP fp32 would have sent
  for the same steps (read from ``CommVolumeLogger``), as a PNG next to the run's logs, and prints the
  path. Needs matplotlib (``pip install lightning-qcomm[plot]``); without it, it says so and draws nothing.

All are plain Lightning classes with typed primitive arguments, so LightningCLI configs set them.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_qcomm.callbacks.comm_logger import CommVolumeLogger

VOCAB_SIZE = 256  # bytes


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the sorted top-level ``*.py`` files of the running Python's stdlib."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise RuntimeError(f"no *.py files found under the stdlib directory {root}")
    return corpus


class ByteWindows(Dataset):
    """Windows ``data[i*block : i*block + block + 1]``; item = (input bytes, next-byte targets)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"corpus split of {data.numel()} bytes is shorter than block_size + 1 = {block_size + 1}")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : i * self.block_size + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibBytes(pl.LightningDataModule):
    """Byte-level language-modelling data from the Python standard library's sources (no download)."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str) -> None:
        hp = self.hparams
        data = torch.frombuffer(bytearray(stdlib_corpus(hp.max_bytes)), dtype=torch.uint8)
        n_val = max(int(len(data) * hp.val_fraction), hp.block_size + 1)
        self.train_set = ByteWindows(data[:-n_val], hp.block_size)
        self.val_set = ByteWindows(data[-n_val:], hp.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask (``F.scaled_dot_product_attention``)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(pl.LightningModule):
    """GPT over bytes; loss = mean next-byte cross-entropy (nats; /ln 2 for bits per byte)."""

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={n_embd}, n_head={n_head}")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)

        def lr_factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min((step - hp.warmup_steps) / max(total - hp.warmup_steps, 1), 1.0)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossVsBytesPlot(pl.Callback):
    """Draw rank 0's training loss against the bytes it sent, and against DDP fp32's bytes for the same steps.

    Needs a ``CommVolumeLogger`` in the callbacks (any order). The loss is the one ``training_step`` returned
    (last micro-batch of each optimizer step); x is megabytes sent by this rank in training steps since
    training start. The DDP-fp32 curve re-plots the *same* losses at the bytes plain DDP would have sent
    (2(N-1)/N * 4 * P per step): it shows the byte cost of the same progress, not a second training run.

    Args:
        filename: PNG name, written in ``trainer.log_dir`` (the run's log folder).

    Example::

        Trainer(strategy="qsdp", devices=2, callbacks=[CommVolumeLogger(), LossVsBytesPlot()])
    """

    def __init__(self, filename: str = "loss_vs_bytes.png") -> None:
        if not filename.endswith(".png"):
            raise ValueError(f"filename must end with .png, got {filename!r}")
        self.filename = filename
        self.path: Path | None = None  # where the last plot went
        self._loss: dict[int, float] = {}  # optimizer step (1-based) -> loss
        self._bytes: dict[int, tuple[float, float]] = {}  # step -> (sent, DDP fp32) cumulative, this rank

    def _comm_logger(self, trainer: pl.Trainer) -> CommVolumeLogger | None:
        return next((c for c in trainer.callbacks if isinstance(c, CommVolumeLogger)), None)

    def _collect(self, trainer: pl.Trainer) -> None:
        cb = self._comm_logger(trainer)
        if cb is not None:  # keyed by the step its totals are at, so the callbacks' order does not matter
            self._bytes[cb.global_step_counted] = (cb.train_bytes_sent, cb.ddp_fp32_bytes)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loss, self._bytes, self.path = {}, {}, None
        if self._comm_logger(trainer) is None:
            rank_zero_warn("LossVsBytesPlot: no CommVolumeLogger in the callbacks, so there are no bytes to plot")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._collect(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._loss[trainer.global_step] = float(loss.detach())
        self._collect(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collect(trainer)
        out_dir = Path(trainer.log_dir or trainer.default_root_dir)  # collective: every rank asks
        steps = sorted(k for k in self._loss if k in self._bytes)
        if not trainer.is_global_zero or not steps:
            return
        path = out_dir / self.filename
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            rank_zero_warn(
                f"LossVsBytesPlot: matplotlib is not installed, so {path} was not drawn; "
                "`pip install lightning-qcomm[plot]` (or `pip install matplotlib`) adds it"
            )
            return
        loss = [self._loss[k] for k in steps]
        sent = [self._bytes[k][0] / 1e6 for k in steps]
        ddp = [self._bytes[k][1] / 1e6 for k in steps]
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        name = type(trainer.strategy).__name__
        ax.plot(sent, loss, marker=".", label=f"{name}: what this run sent ({sent[-1]:.1f} MB)")
        if ddp[-1] > 0:
            ax.plot(ddp, loss, ls="--", label=f"the same steps at DDP fp32's bytes ({ddp[-1]:.1f} MB)")
            ax.set_title(f"{sent[-1] / ddp[-1]:.2f}x of DDP fp32's bytes over {steps[-1]} optimizer steps")
        else:
            ax.set_title(f"{steps[-1]} optimizer steps (one process: no DDP baseline)")
        ax.set_xlabel("MB sent by rank 0 in training steps (cumulative)")
        ax.set_ylabel("training loss (rank 0)")
        ax.grid(alpha=0.3)
        ax.legend()
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        self.path = path
        print(f"loss vs bytes: {path}", flush=True)
