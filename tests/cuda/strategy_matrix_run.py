"""The precision x strategy matrix on one device, run as one process.

``python tests/cuda/strategy_matrix_run.py --accelerator cuda OUT.json`` trains tests/strategies/test_strategy_matrix.py's
classifier with every strategy and callback (plain DDP, QuantDDP + error feedback, QSDP W8G8, Local SGD,
DDP + OneBitAdamCallback, DDP + ActivationQuantization) in every precision, ``Trainer(devices=1)``, and writes
per cell the last training loss or the refusal message. ``--accelerator cpu`` runs the same on CPU (how the
script itself is checked without a GPU). One device means a world of one: what this checks is that every
code path runs on the device in every precision (kernels, dtypes, streams), not the exchange.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "_helpers"))  # _siblings: tests/strategies/test_strategy_matrix.py

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
STRATEGIES = ("ddp", "quant_ddp_ef", "qsdp", "local_sgd", "onebit_adam", "activation_quant")
STEPS = 32


def _strategy(name: str):
    from _siblings import from_test_file

    from lightning_qcomm import QSDPStrategy

    cpu_strategy = from_test_file("strategies/test_strategy_matrix", "_strategy")
    if name == "qsdp":
        return QSDPStrategy(bits=8, min_quant_numel=0), []
    return cpu_strategy(name)


def _cell(accelerator: str, name: str, precision: str) -> dict:
    import lightning.pytorch as pl
    from _siblings import from_test_file

    _make_classifier = from_test_file("strategies/test_strategy_matrix", "_make_classifier")

    pl.seed_everything(0)
    strategy, callbacks = _strategy(name)
    trainer = None
    try:  # a refusal may come from Lightning's Trainer (precision x strategy) or from our setup
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=1,
            precision=precision,
            strategy=strategy,
            callbacks=callbacks,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(_make_classifier()())
    except (ValueError, TypeError, RuntimeError) as e:
        return {"refused": str(e)[:500], "step": 0 if trainer is None else trainer.global_step}
    loss = float(trainer.callback_metrics["train_loss"])
    return {"loss": loss if math.isfinite(loss) else None, "step": trainer.global_step}


def main() -> None:
    accelerator, out = sys.argv[sys.argv.index("--accelerator") + 1], sys.argv[-1]
    warnings.filterwarnings("ignore")
    results = {}
    for precision in PRECISIONS:
        if accelerator == "cuda" and precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
            continue
        for name in STRATEGIES:
            results[f"{name}/{precision}"] = _cell(accelerator, name, precision)
            print(name, precision, results[f"{name}/{precision}"], flush=True)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
