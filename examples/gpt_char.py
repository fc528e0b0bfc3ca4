"""Byte-level GPT on the Python standard library's own sources, trained with a compressed strategy.

No download: the corpus is the stdlib's top-level ``*.py`` files (``lightning_qcomm.demo.StdlibBytes``); the
model is ``lightning_qcomm.demo.ByteGPT`` (read it there: one screen). Two processes by default, on GPUs where
present (NCCL), else on CPU (gloo); ``--method`` picks what is compressed (the list: ``examples/_methods.py``):

    python examples/gpt_char.py                                  # plain DDP + byte accounting (ratio 1.0)
    python examples/gpt_char.py --method quant_ddp               # 8-bit QSGD gradients
    python examples/gpt_char.py --method qsdp --max-steps 300    # QSDP, 8-bit weights and gradients
    python examples/gpt_char.py --method local_sgd               # Local SGD, QSR schedule
    python examples/gpt_char.py --method onebit_adam             # 1-bit Adam on DDP
    python examples/gpt_char.py --method activation_quant --strategy quant_ddp  # 4-bit activations + QuantDDP
    python examples/gpt_char.py --accelerator gpu --devices 8 --num-nodes 2      # per node, under srun/torchrun

``CommVolumeLogger`` logs ``comm/bytes_sent`` vs ``comm/baseline_bytes`` and prints a summary table at the end.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from _methods import add_arguments, describe, method_parts
from lightning.pytorch.loggers import CSVLogger

from lightning_qcomm.demo import ByteGPT, StdlibBytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    strategy, callbacks = method_parts(args)

    pl.seed_everything(42)
    model = ByteGPT(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=128)
    data = StdlibBytes(block_size=128, batch_size=args.batch_size, max_bytes=1_000_000)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=8,
        log_every_n_steps=min(10, args.max_steps),
        enable_checkpointing=False,
        logger=CSVLogger("runs", name=f"gpt_char_{args.method}"),
        callbacks=callbacks,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(describe(trainer))


if __name__ == "__main__":
    main()
