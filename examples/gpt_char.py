"""Byte-level GPT on the Python standard library's own sources, trained with a compressed strategy.

No download: the corpus is the stdlib's top-level ``*.py`` files (``lightning_qcomm.demo.StdlibBytes``); the
model is ``lightning_qcomm.demo.ByteGPT`` (read it there: one screen). Two CPU processes by default:

    python examples/gpt_char.py                                  # plain DDP + byte accounting (ratio 1.0)
    python examples/gpt_char.py --strategy quant_ddp             # 8-bit QSGD gradients
    python examples/gpt_char.py --strategy qsdp --max-steps 300  # QSDP, 8-bit weights and gradients

``CommVolumeLogger`` logs ``comm/bytes_sent`` vs ``comm/baseline_bytes`` and prints a summary table at the end.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

import lightning_qcomm  # noqa: F401  (registers "qsdp", "quant_ddp", "local_sgd_qsr", ...)
from lightning_qcomm.callbacks import CommVolumeLogger
from lightning_qcomm.demo import ByteGPT, StdlibBytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp", help="a Lightning strategy name, e.g. ddp, quant_ddp, qsdp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    args = parser.parse_args()

    pl.seed_everything(42)
    model = ByteGPT(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=128)
    data = StdlibBytes(block_size=128, batch_size=16, max_bytes=1_000_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=8,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=CSVLogger("runs", name=f"gpt_char_{args.strategy}"),
        callbacks=[CommVolumeLogger()],
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
