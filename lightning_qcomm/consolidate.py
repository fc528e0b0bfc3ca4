"""Turn a sharded QSDP checkpoint (a folder) into one file: ``python -m lightning_qcomm.consolidate IN OUT``.

``QSDPStrategy`` saves ``last.ckpt`` and every ``ModelCheckpoint`` file as a folder by default (one shard
per rank, written with ``torch.distributed.checkpoint``, plus ``meta.pt`` with the Trainer's state).
``LightningModule.load_from_checkpoint`` and ``torch.load`` need one file, and Lightning's own
``lightning.pytorch.utilities.consolidate_checkpoint`` expects its FSDP strategy's layout (a ``"model"``
key), not this one (``"state_dict"``, ``"optimizer_0"``, ...). ``consolidate_checkpoint`` reads the shards
in one process (no process group; everything must fit in CPU memory) and writes a Lightning checkpoint:
``state_dict`` with full tensors, ``optimizer_states`` as a list (state keyed by parameter name, which
``QSDPStrategy`` and ``ModelParallelStrategy`` load when resuming from the file), and every other entry of
``meta.pt`` (epoch, loops, callbacks, hyperparameters, the QSDP RNG step). The output is written to a
temporary file beside it and renamed, so it is never left half written.

The other way to a single file: ``QSDPStrategy(save_distributed_checkpoint=False)`` gathers the full
state on rank 0 at every save.

Example::

    from lightning_qcomm import consolidate_checkpoint

    consolidate_checkpoint("checkpoints/last.ckpt", "last_single.ckpt")
    model = MyModule.load_from_checkpoint("last_single.ckpt")
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import torch

METADATA_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")

__all__ = ["consolidate_checkpoint", "main"]


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    if not folder.is_dir() or not (folder / DCP_METADATA_FILE).is_file() or not (folder / METADATA_FILE).is_file():
        raise ValueError(
            f"{str(folder)!r} is not a sharded checkpoint saved by QSDPStrategy / ModelParallelStrategy (a folder "
            f"with {DCP_METADATA_FILE!r} and {METADATA_FILE!r}); a single-file checkpoint needs no consolidation"
        )


def _to_lightning_layout(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_0``, ``optimizer_1``, ... (the sharded layout) -> ``optimizer_states`` (a list, in order)."""
    indexed = sorted((int(m.group(1)), k) for k in checkpoint if (m := _OPTIMIZER_KEY.fullmatch(k)))
    if [i for i, _ in indexed] != list(range(len(indexed))):
        raise ValueError(f"checkpoint optimizer entries {[k for _, k in indexed]} are not optimizer_0..N-1")
    if indexed:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for _, k in indexed]
    if "state_dict" not in checkpoint:
        raise ValueError(f"checkpoint has no 'state_dict' entry (entries: {sorted(checkpoint)})")
    return checkpoint


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike) -> Path:
    """Write the sharded checkpoint folder ``checkpoint_dir`` as one Lightning checkpoint file ``output_file``.

    Refuses (FileExistsError) to overwrite ``output_file``; FileNotFoundError / ValueError when
    ``checkpoint_dir`` is missing or is not a sharded checkpoint. Returns the output path.

    Example::

        consolidate_checkpoint("checkpoints/epoch=0-step=100.ckpt", "model.ckpt")   # a folder -> one file
    """
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    folder, out = Path(checkpoint_dir), Path(output_file)
    _check_folder(folder)
    if out.exists():
        raise FileExistsError(f"output {str(out)!r} already exists; choose another path or remove it first")
    checkpoint = _to_lightning_layout(_load_distributed_checkpoint(folder))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_qcomm.consolidate",
        description="Write a sharded QSDP checkpoint folder as one Lightning checkpoint file "
        "(for LightningModule.load_from_checkpoint or torch.load).",
    )
    parser.add_argument("checkpoint_dir", help="the sharded checkpoint folder, e.g. checkpoints/last.ckpt")
    parser.add_argument("output_file", help="the single file to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        out = consolidate_checkpoint(args.checkpoint_dir, args.output_file)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
