"""QSDPStrategy's checkpoint files: atomic sharded saves, their completeness check, and the spawn launcher.

Sharded save (the default, ``save_distributed_checkpoint=True``): every rank writes its shard into
``.<name>.partial`` beside the target; after a barrier, rank 0 writes ``meta.pt`` and the completion
marker ``qsdp_complete.json`` there, then moves it into place (an existing checkpoint is first renamed to
``.<name>.old`` and removed after the move). A job killed while it overwrites ``last.ckpt`` therefore
leaves the previous checkpoint whole (or, in the instant between the two renames, at ``.<name>.old``),
never a folder mixing two saves. ``check_sharded_checkpoint`` refuses a folder without its data files or
one that is a leftover ``.partial``; a folder without the marker but complete otherwise (written by
``ModelParallelStrategy`` or an earlier version) is loaded with a warning. Assumes, like Lightning, one
filesystem shared by all ranks.

Example::

    save_sharded_checkpoint(strategy, checkpoint, Path("ckpts/last.ckpt"))  # collective
    check_sharded_checkpoint(Path("ckpts/last.ckpt"))                       # before loading
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

log = logging.getLogger(__name__)

METADATA_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILE = ".metadata"
COMPLETE_MARKER = "qsdp_complete.json"
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def save_sharded_checkpoint(strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
    """Collective: write ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states``, the rest) as a
    sharded folder at ``path``, atomically replacing what is there (see the module docstring)."""
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

    partial = _sibling(path, PARTIAL_SUFFIX)
    if strategy.global_rank == 0:
        if partial.exists():  # left by an interrupted save
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    strategy.barrier()
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    _distributed_checkpoint_save(state, partial)
    strategy.barrier()  # every rank's shard is on disk
    if strategy.global_rank == 0:
        torch.save(checkpoint, partial / METADATA_FILE)
        marker = {"world_size": strategy.world_size, "global_step": checkpoint.get("global_step")}
        (partial / COMPLETE_MARKER).write_text(json.dumps(marker))
        _move_into_place(partial, path)
    strategy.barrier()


def _move_into_place(partial: Path, path: Path) -> None:
    if path.is_dir():
        old = _sibling(path, OLD_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old)
    else:
        if path.exists():  # a single-file checkpoint of the same name
            path.unlink()
        os.rename(partial, path)


def check_sharded_checkpoint(path: Path) -> None:
    """Raise ValueError for a sharded checkpoint folder that is incomplete: a leftover of an interrupted save
    (``.<name>.partial``) or one without its data files; warn (once per path) for one without the marker."""
    path = Path(path)
    if path.name.startswith(".") and path.name.endswith(PARTIAL_SUFFIX):
        raise ValueError(
            f"checkpoint {str(path)!r} is incomplete: it is the temporary folder of a save that did not finish; "
            "resume from the checkpoint it was meant to replace"
        )
    missing = [f for f in (DCP_METADATA_FILE, METADATA_FILE) if not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: it has no {' / '.join(missing)}")
    if not (path / COMPLETE_MARKER).is_file():
        log.warning(
            "QSDP: checkpoint %s has no %s (written by ModelParallelStrategy or an earlier lightning_qcomm); "
            "it cannot be verified as complete",
            path,
            COMPLETE_MARKER,
        )


def missing_checkpoint_hint(path: Path) -> str:
    """A hint for a checkpoint path that does not exist: a save interrupted between its two renames leaves
    the previous checkpoint at ``.<name>.old``."""
    old = _sibling(Path(path), OLD_SUFFIX)
    if old.is_dir() and (old / COMPLETE_MARKER).is_file():
        return f"; a save was interrupted while replacing it: the previous complete checkpoint is {str(old)!r}"
    return ""


class FullStateLauncher(_MultiProcessingLauncher):
    """Multiprocessing launcher that hands the main process a *full* state dict: Lightning's default pickles
    ``state_dict()`` of the sharded module (DTensors), which the main process cannot load.

    The weights travel through a file in a private directory that the main process creates before the
    workers start and removes when ``launch`` returns or raises, so a failure on either side leaves no
    full-size copy of the model in the temporary directory.
    """

    _handoff_dir: str | None = None

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._handoff_dir = tempfile.mkdtemp(prefix="lightning_qcomm_weights_")  # travels to the workers
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            shutil.rmtree(self._handoff_dir, ignore_errors=True)
            self._handoff_dir = None

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cb = trainer.checkpoint_callback
        best_model_path = getattr(cb, "best_model_path", None) if cb else None
        full = get_model_state_dict(  # collective: every rank takes part
            trainer.lightning_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self._strategy.global_rank != 0:  # local rank 0 of node 1 is not the process that saves
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(self._handoff_dir or tempfile.mkdtemp(), "weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(full, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
