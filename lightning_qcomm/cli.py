"""``lightning-qcomm`` (and ``python -m lightning_qcomm``): LightningCLI with lightning_qcomm preloaded.

Importing the package first registers the lowercase strategy names (``strategy: quant_ddp``) and makes
our strategy and callback classes resolvable by short name (``class_path: QuantDDPStrategy``,
``--trainer.callbacks+=CommVolumeLogger``) as well as by full ``class_path``. Any LightningModule and
LightningDataModule can be named with ``--model`` / ``--data``; without them the demo workload runs:
``lightning_qcomm.demo.ByteGPT`` on ``lightning_qcomm.demo.StdlibBytes`` (no download).

    lightning-qcomm fit --config configs/quickstart.yaml
    lightning-qcomm fit --trainer.strategy quant_ddp --trainer.devices 2 --trainer.accelerator cpu
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_qcomm  # noqa: F401  (registers strategy names)
import lightning_qcomm.callbacks  # noqa: F401  (short callback names)
import lightning_qcomm.strategies  # noqa: F401  (short strategy names)

DEMO_MODEL = "lightning_qcomm.demo.ByteGPT"
DEMO_DATA = "lightning_qcomm.demo.StdlibBytes"


class QCommCLI(LightningCLI):
    """LightningCLI whose model and data default to the byte-level GPT demo."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEMO_MODEL}, "data": {"class_path": DEMO_DATA}})


def make_cli(args: list[str] | None = None, run: bool = True) -> QCommCLI:
    """Build (and with ``run`` execute) the CLI; returns it, so callers can read ``cli.trainer``, ``cli.model``.

    ``args`` defaults to ``sys.argv[1:]``; ``run=False`` only parses and instantiates (no subcommand in ``args``).
    """
    import lightning_qcomm.demo  # noqa: F401  (demo classes resolvable by short name too)

    return QCommCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point (``lightning-qcomm``); returns None so the exit status is 0 on success."""
    make_cli(args)
