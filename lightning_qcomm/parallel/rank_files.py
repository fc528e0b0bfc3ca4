"""Per-rank checkpoint state in side files: each rank writes and reads its own (entry-point layer; docs/design.md,
"Per-rank checkpoints").

State that differs per rank (error-feedback residuals, 1-bit error buffers, Local SGD's per-rank optimizer states,
CommVolumeLogger's totals) is not gathered into rank 0's file: every rank writes its own entries through the
strategy's ``CheckpointIO`` to ``<checkpoint>.qcomm-rank<r>of<N>-<token>.pt``, and rank 0's checkpoint gets a
manifest ``{"world_size": N, "token": token, "keys": [...]}`` under ``MANIFEST_KEY``.

Invariants: the side files are on disk (barrier) before rank 0 writes the checkpoint that names them, and older
side files of the same path are removed after, so an interrupted save leaves the previous checkpoint whole; on load
each rank reads its own file into ``checkpoint[RANK_STATE_KEY]`` when the world size matches, else nothing (each
owner resets with a warning); a missing side file raises ``FileNotFoundError`` naming it; removing a checkpoint
removes its side files (``CheckpointIO.remove_checkpoint``). One filesystem shared by all ranks, as Lightning.
Owners ``stash`` their entries before the save and get them back with ``own_entry``; Trainer strategies call
``save`` / ``load`` / ``remove``; a callback under another strategy calls ``attach(trainer.strategy)``.

Example::

    stash(checkpoint, "onebit_adam", optimizer.rank_state_dict())     # in on_save_checkpoint, every rank
    mine = own_entry(checkpoint, "onebit_adam")                        # in on_load_checkpoint, every rank
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem

log = logging.getLogger(__name__)

RANK_STATE_KEY = "qcomm_rank_state"  # this rank's entries in its in-memory checkpoint dict (never in a file)
MANIFEST_KEY = "qcomm_rank_files"  # in rank 0's checkpoint: which side files belong to it
_MARK = ".qcomm-rank"


def stash(checkpoint: dict[str, Any], key: str, entry: Any) -> None:
    """Queue this rank's ``entry`` under ``key`` for its side file (written by the strategy's save)."""
    checkpoint.setdefault(RANK_STATE_KEY, {})[key] = entry


def own_entry(checkpoint: dict[str, Any], key: str) -> Any:
    """This rank's entry ``key`` read back at load (None: none saved, or saved by another number of ranks)."""
    return (checkpoint.get(RANK_STATE_KEY) or {}).get(key)


def saved_world_size(checkpoint: dict[str, Any]) -> int | None:
    """The number of ranks that wrote the checkpoint's side files (None: it has none)."""
    manifest = checkpoint.get(MANIFEST_KEY)
    return None if manifest is None else int(manifest["world_size"])


def _local(path: Any, resolve: bool = False) -> str:
    """``path`` as a string; an absolute (``resolve``: symlink-free) one when it is on the local filesystem."""
    path = os.fspath(path)
    if "://" in path:
        return path
    return os.path.realpath(path) if resolve else os.path.abspath(path)


def side_path(path: Any, rank: int, world: int, token: str) -> str:
    """Where rank ``rank`` of ``world`` keeps its state of the checkpoint at ``path`` saved with ``token``."""
    return f"{_local(path)}{_MARK}{rank}of{world}-{token}.pt"


def _side_files(path: Any) -> list[str]:
    """Every side file of ``path`` on its filesystem (any token, any world size), named as ``side_path`` names them."""
    path = _local(path)
    fs = get_filesystem(path)
    found = fs.glob(glob.escape(path) + _MARK + "*.pt")
    return sorted(fs.unstrip_protocol(f) if "://" in path else f for f in found)


def save(
    strategy: Any,
    checkpoint: dict[str, Any],
    path: Any,
    write_main: Callable[[], None],
    storage_options: Any = None,
) -> None:
    """Collective (every rank): write this rank's stashed entries, then ``write_main()`` (rank 0's file, with the
    manifest added to ``checkpoint``), then drop older side files of ``path``. Without stashed entries on this
    rank only ``write_main()`` runs; every rank must agree on that (the same owners run on all ranks)."""
    entries = checkpoint.pop(RANK_STATE_KEY, None)
    if not entries:
        write_main()
        return
    rank, world = strategy.global_rank, strategy.world_size
    token = secrets.token_hex(4) if rank == 0 else None
    if world > 1:
        token = strategy.broadcast(token, src=0)
    strategy.checkpoint_io.save_checkpoint(
        entries, side_path(path, rank, world, token), storage_options=storage_options
    )
    if world > 1:
        strategy.barrier("lightning_qcomm.rank_files.save")
    checkpoint[MANIFEST_KEY] = {"world_size": world, "token": token, "keys": sorted(entries)}
    write_main()
    if rank == 0:
        keep = {side_path(path, r, world, token) for r in range(world)}
        _remove_side_files(strategy, path, keep=keep)


def load(strategy: Any, checkpoint: dict[str, Any], path: Any) -> dict[str, Any]:
    """Every rank: put this rank's side file entries into ``checkpoint[RANK_STATE_KEY]`` when ``checkpoint`` (loaded
    from ``path``) names side files written by as many ranks as now (logged otherwise). Returns ``checkpoint``."""
    manifest = checkpoint.get(MANIFEST_KEY)
    if manifest is None:
        return checkpoint
    world = int(manifest["world_size"])
    if world != strategy.world_size:
        log.warning(
            "lightning_qcomm: the checkpoint's per-rank state was written by %d ranks, now %d: it is not loaded "
            "(each feature applies its world-size policy)",
            world,
            strategy.world_size,
        )
        return checkpoint
    source = _local(path, resolve=True)  # a symlinked last.ckpt: the side files sit beside its target
    mine = side_path(source, strategy.global_rank, world, manifest["token"])
    if not get_filesystem(mine).exists(mine):
        raise FileNotFoundError(
            f"{path} names per-rank state files it was saved with, and this rank's ({mine}) is missing; copy a "
            f"checkpoint together with its '{os.path.basename(os.fspath(source))}{_MARK}*' files"
        )
    checkpoint[RANK_STATE_KEY] = strategy.checkpoint_io.load_checkpoint(mine)
    return checkpoint


def read_all(path: Any) -> list[dict[str, Any]]:
    """Every rank's side-file entries of the checkpoint at ``path``, in rank order, in this process (for tools
    and tests: it holds N ranks' state at once, which training never does)."""
    import torch

    manifest = torch.load(os.fspath(path), map_location="cpu", weights_only=False).get(MANIFEST_KEY)
    if manifest is None:
        return []
    world, token = int(manifest["world_size"]), manifest["token"]
    source = _local(path, resolve=True)
    return [torch.load(side_path(source, r, world, token), map_location="cpu", weights_only=True) for r in range(world)]


def remove(strategy: Any, path: Any) -> None:
    """Rank 0 (as Lightning removes checkpoints): the side files of ``path`` (``CheckpointIO.remove_checkpoint``)."""
    if strategy.global_rank == 0:
        _remove_side_files(strategy, path)


def _remove_side_files(strategy: Any, path: Any, keep: set[str] = frozenset()) -> None:
    for f in _side_files(path):
        if f not in keep:
            strategy.checkpoint_io.remove_checkpoint(f)


def attach(strategy: Any) -> None:
    """Make a Trainer strategy that does not handle side files itself (``writes_rank_files`` unset) write, read
    and remove them: its ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` are wrapped once."""
    if getattr(strategy, "writes_rank_files", False) or getattr(strategy, "_qcomm_rank_files_attached", False):
        return
    save_main, load_main, remove_main = strategy.save_checkpoint, strategy.load_checkpoint, strategy.remove_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        save(strategy, checkpoint, filepath, lambda: save_main(checkpoint, filepath, storage_options=storage_options))

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return load(strategy, load_main(checkpoint_path, *args, **kwargs), checkpoint_path)

    def remove_checkpoint(filepath: Any) -> None:
        remove_main(filepath)
        remove(strategy, filepath)

    strategy.save_checkpoint = save_checkpoint
    strategy.load_checkpoint = load_checkpoint
    strategy.remove_checkpoint = remove_checkpoint
    strategy._qcomm_rank_files_attached = True


def this_rank_entries(per_rank: Sequence[Sequence[Any]], saved_world: Any, world_size: int, rank: int) -> list | None:
    """From lists holding one entry per rank (optimizer states gathered at save), this rank's entry of each; None
    (logged: every rank then keeps rank 0's) when the checkpoint was written by another number of ranks."""
    if saved_world != world_size:
        log.warning(
            "checkpoint holds optimizer states of %s ranks, this run has %s: every rank loads rank 0's",
            saved_world,
            world_size,
        )
        return None
    return [ranks[rank] for ranks in per_rank]


__all__ = [
    "MANIFEST_KEY",
    "RANK_STATE_KEY",
    "attach",
    "load",
    "own_entry",
    "read_all",
    "remove",
    "save",
    "saved_world_size",
    "side_path",
    "stash",
    "this_rank_entries",
]
