"""Per-rank checkpoint state in side files (lightning_qcomm/parallel/rank_files.py).

Measured (2 and 4 real gloo processes, one Lightning fit each): the tensor bytes rank 0 holds for a save --
what it writes (the checkpoint and its own side file) plus every object it receives from other ranks through
``gather_object`` / ``all_gather_object`` / ``broadcast_object_list`` while saving -- with QuantDDP's
error-feedback residuals, 1-bit Adam's error buffers and CommVolumeLogger's totals, all per rank. Criterion,
fixed before measuring: at N = 4 at most 10% above N = 2 (gathering every rank's state to rank 0 adds about
2 d fp32 per extra rank: +40% here). ModelCheckpoint's top-k deletion removes the side files with their
checkpoint; a run with 4 ranks resumes from the 2-rank checkpoint with the documented policy (step kept,
residuals and 1-bit buffers reset, warned). Single-process: an interrupted save leaves the previous checkpoint
and its side files whole; a missing side file is named; a symlinked checkpoint finds its target's files.
"""

from __future__ import annotations

import glob
import os
import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_qcomm.parallel import rank_files

N_FEAT, N_HID = 32, 128  # d ~ 21k trainable parameters
STEPS = 6


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(N_FEAT, N_HID), torch.nn.Tanh(), torch.nn.Linear(N_HID, N_HID))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.body(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, N_FEAT, generator=g)), 16)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _worker(rank: int, world: int, port: int, outdir: str, resume_from: str | None) -> None:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_qcomm import CommVolumeLogger, OneBitAdamCallback, QuantDDPStrategy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    saves: list[list[int]] = []  # per save on this rank: [tensor bytes written, tensor bytes received]
    for name in ("gather_object", "all_gather_object", "broadcast_object_list"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            if saves:  # what lands in this rank's memory: the object lists filled in
                saves[-1][1] += _tensor_bytes([a for a in args if isinstance(a, list)])
            return out

        setattr(dist, name, counted)

    class Measure(pl.Callback):
        """First callback: its state_dict opens a save's record (callbacks' state_dict and on_save_checkpoint,
        where per-rank state used to be gathered, and the strategy's save all come after it)."""

        def setup(self, trainer, pl_module, stage):
            io = trainer.strategy.checkpoint_io
            save = io.save_checkpoint

            def save_checkpoint(checkpoint, path, storage_options=None):
                saves[-1][0] += _tensor_bytes(checkpoint)
                return save(checkpoint, path, storage_options=storage_options)

            io.save_checkpoint = save_checkpoint

        def state_dict(self):
            saves.append([0, 0])
            return {}

    def fit(ckpt_dir, ckpt_path=None, max_steps=STEPS, extra=()):
        pl.seed_everything(0, verbose=False)
        mc = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=1)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=QuantDDPStrategy(codec="uniform", bits=4, error_feedback=True, min_quant_numel=0),
            callbacks=[Measure(), OneBitAdamCallback(freeze_step=2), CommVolumeLogger(), mc, *extra],
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = _Net()
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, module

    ckpt_dir = os.path.join(outdir, f"world{world}")
    _, module = fit(ckpt_dir)
    res = {"d": sum(p.numel() for p in module.parameters()), "saves": saves[:]}
    res["held"] = max(written + received for written, received in saves)
    res["received"] = sum(received for _, received in saves)
    dist.barrier()
    res["files"] = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ckpt_dir, "*")))

    if resume_from is not None:  # another world size: step kept, per-rank state reset
        seen = {}

        class StartProbe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                ef = trainer.strategy.hook_state.ef_state_dict()
                seen["step"] = trainer.strategy.hook_state.step
                seen["ef_zero"] = all(bool((v == 0).all()) for v in ef.values())

        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            fit(os.path.join(outdir, "resumed"), ckpt_path=resume_from, max_steps=STEPS + 2, extra=[StartProbe()])
        seen["warnings"] = [str(w.message) for w in warned]
        res["resumed"] = seen
    write_rank_result(outdir, rank, res, f"world{world}-rank{{rank}}.json")


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, free_port(), d, None, nprocs=2)
        two_rank_ckpt = sorted(glob.glob(os.path.join(d, "world2", "*.ckpt")))[-1]
        spawn(_worker, 4, free_port(), d, two_rank_ckpt, nprocs=4)
        yield {world: rank_results(d, 1, f"world{world}-rank{{rank}}.json")[0] for world in (2, 4)}


def test_rank0_holds_o_of_d_whatever_the_world_size(runs):
    held = {world: runs[world]["held"] for world in (2, 4)}
    assert runs[2]["d"] == runs[4]["d"]
    print(f"tensor bytes rank 0 holds per save (d = {runs[2]['d']}): {held}")
    assert held[4] <= 1.1 * held[2], f"bytes rank 0 holds per save: {held}"
    assert runs[4]["received"] == 0, "rank 0 received other ranks' state during the save"


def test_top_k_deletion_removes_side_files_with_their_checkpoint(runs):
    for world in (2, 4):
        files = runs[world]["files"]
        ckpts = [f for f in files if f.endswith(".ckpt")]
        assert len(ckpts) == 1, files  # save_top_k=1: the older checkpoints were removed ...
        sides = [f for f in files if not f.endswith(".ckpt")]
        assert len(sides) == world and all(f.startswith(ckpts[0] + ".qcomm-rank") for f in sides), (
            files
        )  # ... with theirs


def test_another_world_size_keeps_the_step_and_resets_per_rank_state(runs):
    seen = runs[4]["resumed"]
    assert seen["step"] == STEPS and seen["ef_zero"]
    assert any("written by 2 ranks, now 4" in w for w in seen["warnings"]), seen["warnings"]
    assert any("1-bit error buffers were written by 2" in w for w in seen["warnings"]), seen["warnings"]


# ---------------------------------------------------------------------------------------------- one process
class _Strategy:
    """What rank_files reads of a strategy, for one rank of one."""

    global_rank, world_size = 0, 1

    def __init__(self) -> None:
        self.checkpoint_io = TorchCheckpointIO()


def _save(path, value, fail=False):
    strategy = _Strategy()
    checkpoint = {"value": torch.tensor(value)}
    rank_files.stash(checkpoint, "mine", {"state": torch.full((3,), float(value))})

    def write_main():
        if fail:
            raise OSError("disk full")
        strategy.checkpoint_io.save_checkpoint(checkpoint, path)

    rank_files.save(strategy, checkpoint, path, write_main)


def _load(path):
    strategy = _Strategy()
    return rank_files.own_entry(rank_files.load(strategy, strategy.checkpoint_io.load_checkpoint(path), path), "mine")


def test_an_interrupted_save_leaves_the_previous_checkpoint_whole(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _save(path, 1.0)
    with pytest.raises(OSError, match="disk full"):
        _save(path, 2.0, fail=True)  # its side file is written, the checkpoint naming it is not
    assert torch.equal(_load(path)["state"], torch.full((3,), 1.0))
    _save(path, 3.0)
    assert torch.equal(_load(path)["state"], torch.full((3,), 3.0))
    assert len(glob.glob(path + ".qcomm-rank*")) == 1  # the earlier saves' side files are gone


def test_missing_side_file_is_named_and_symlinks_find_their_target(tmp_path):
    path = str(tmp_path / "step=4.ckpt")
    _save(path, 5.0)
    link = str(tmp_path / "last.ckpt")
    os.symlink(path, link)
    assert torch.equal(_load(link)["state"], torch.full((3,), 5.0))
    for f in glob.glob(path + ".qcomm-rank*"):
        os.remove(f)
    with pytest.raises(FileNotFoundError, match="qcomm-rank0of1"):
        _load(path)
