"""The command-line options every example shares: the method, the strategy, the accelerator and the devices.

A method is a strategy plus the callbacks it needs; ``--strategy`` replaces the method's strategy (any name
``lightning_qcomm`` registers, or a Lightning one), so a callback method composes with a compressed strategy:

    --method ddp               plain Lightning DDP, byte accounting only (ratio 1.0)
    --method quant_ddp         gradients all-reduced in 8-bit QSGD (QuantDDPStrategy)
    --method qsdp              FSDP2 with 8-bit weights and gradients on the wire (QSDPStrategy)
    --method local_sgd         Local SGD with the QSR schedule (LocalSGDStrategy)
    --method onebit_adam       DDP + OneBitAdamCallback (AdamW warm-up, then 1-bit momentum all-reduce)
    --method activation_quant  DDP + ActivationQuantization (4-bit saved activations)

Every run also gets ``CommVolumeLogger`` (bytes sent against DDP fp32, summary table at the end).

Example::

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--method", "onebit_adam", "--freeze-step", "2"])
    strategy, callbacks = method_parts(args)  # ("ddp", [OneBitAdamCallback(freeze_step=2), CommVolumeLogger()])
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, ...)
    trainer.fit(model, data)
    print(describe(trainer))  # "trained with DDPStrategy + OneBitAdamCallback, CommVolumeLogger on 2 cpu process(es)"
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

import lightning_qcomm  # noqa: F401  (registers "qsdp", "quant_ddp", "local_sgd_qsr", ...)
from lightning_qcomm.callbacks import ActivationQuantization, CommVolumeLogger, OneBitAdamCallback

METHODS = {  # method -> the strategy it trains with (the callback methods add theirs in method_parts)
    "ddp": "ddp",
    "quant_ddp": "quant_ddp",
    "qsdp": "qsdp",
    "local_sgd": "local_sgd_qsr",
    "onebit_adam": "ddp",
    "activation_quant": "ddp",
}


def _devices(text: str) -> int | str:
    """``--devices``: an int (how many), or what Lightning takes as a string ("auto", "-1", "0,1")."""
    return int(text) if text.lstrip("-").isdigit() else text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--method``, ``--strategy``, ``--accelerator``, ``--devices``, ``--num-nodes``, ``--freeze-step``."""
    parser.add_argument("--method", choices=sorted(METHODS), default="ddp", help="what to compress (see above)")
    parser.add_argument(
        "--strategy", default=None, help="replace the method's strategy: any registered name, e.g. quant_ddp_nuqsgd4"
    )
    parser.add_argument("--accelerator", default="auto", help="auto (GPUs where present), gpu or cpu")
    parser.add_argument("--devices", type=_devices, default=2, help="processes per node: an int, auto, or 0,1")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (launch one process group per node)")
    parser.add_argument(
        "--freeze-step", type=int, default=None, help="onebit_adam: AdamW warm-up steps (default OneBitAdam's)"
    )


def method_parts(args: argparse.Namespace) -> tuple[str, list[Callback]]:
    """The strategy name and the callbacks (``CommVolumeLogger`` last) that ``args`` select."""
    callbacks: list[Callback] = []
    if args.freeze_step is not None and args.method != "onebit_adam":
        warnings.warn(f"--freeze-step {args.freeze_step} has no effect with --method {args.method}", stacklevel=2)
    if args.method == "onebit_adam":
        callbacks.append(OneBitAdamCallback(freeze_step=args.freeze_step))
    elif args.method == "activation_quant":
        callbacks.append(ActivationQuantization(bits=4))
    return args.strategy or METHODS[args.method], [*callbacks, CommVolumeLogger()]


def describe(trainer: pl.Trainer) -> str:
    """One line naming what actually trained: the strategy class, our callbacks, the processes and their device."""
    ours = [type(cb).__name__ for cb in trainer.callbacks if type(cb).__module__.startswith("lightning_qcomm")]
    device = trainer.strategy.root_device.type
    return f"trained with {type(trainer.strategy).__name__} + {', '.join(ours)} on {trainer.world_size} {device} process(es)"
