"""A small CNN on scikit-learn's 8x8 handwritten digits (1797 images shipped inside the package: no download).

Needs the example extra: ``pip install scikit-learn`` (torchvision's datasets download at run time).

    python examples/vision.py                        # 2 processes (GPUs where present), DDP + byte accounting
    python examples/vision.py --method quant_ddp     # quantized gradient all-reduce
    python examples/vision.py --method onebit_adam   # 1-bit Adam (every method: examples/_methods.py)
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _methods import add_arguments, describe, method_parts
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Digits(pl.LightningDataModule):
    """sklearn ``load_digits``: pixels 0..16 scaled to [0, 1]; a fixed 80/20 split (seeded permutation)."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        n_val = len(y) // 5
        self.train_set = TensorDataset(x[perm[n_val:]], y[perm[n_val:]])
        self.val_set = TensorDataset(x[perm[:n_val]], y[perm[:n_val]])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class SmallCNN(pl.LightningModule):
    """conv(1->32) - conv(32->64) - pool - linear(64*4*4 -> 128) - linear(128 -> 10); Adam."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop early (default: run every epoch)")
    args = parser.parse_args()
    strategy, callbacks = method_parts(args)

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        log_every_n_steps=5,
        enable_checkpointing=False,
        logger=False,
        callbacks=callbacks,
    )
    trainer.fit(SmallCNN(), Digits())
    if trainer.is_global_zero:
        print(describe(trainer))


if __name__ == "__main__":
    main()
