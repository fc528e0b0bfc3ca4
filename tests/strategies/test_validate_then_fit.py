# ruff: noqa: B023 -- the probes are called within their own loop iteration
"""A checkpoint loaded by ``validate(ckpt_path=...)`` must not leak its per-rank comm state into a later
fresh ``fit()`` on the same Trainer (OneBitAdamCallback guarantees this, test_onebit_adam.py
``test_checkpoint_loaded_by_validate_is_not_applied_to_a_later_fit``; plain DDPStrategy has no such state).

QuantDDPStrategy kept the loaded hook state in ``_pending_state`` and LocalSGDStrategy the schedule in
``_loaded_state``, and both applied it at the next fit's setup: the fresh fit started with the checkpoint's step
counter (and error-feedback residuals / Local SGD round counters). ``fit(ckpt_path=...)`` still restores them.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn


def _module_cls():
    import lightning.pytorch as pl

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

        def training_step(self, batch, i):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def _loader(self):
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(
                torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g)
            )
            return torch.utils.data.DataLoader(ds, batch_size=16)

        train_dataloader = val_dataloader = _loader

    return M


def _trainer(strategy, root, max_steps, callbacks=(), **kw):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=1,
        **kw,
    )


def _worker(rank, port, outdir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_qcomm import LocalSGDStrategy, QuantDDPStrategy

    makers = {
        "quant_ddp": lambda: QuantDDPStrategy(codec="uniform", bits=2, error_feedback=True, min_quant_numel=0),
        "local_sgd": lambda: LocalSGDStrategy(sync="constant", period=3),
    }
    res = {}
    M = _module_cls()
    for name, make in makers.items():
        root = os.path.join(outdir, name)
        mc = ModelCheckpoint(dirpath=root, filename="x", every_n_train_steps=7, save_top_k=-1)
        _trainer(make(), root, 7, [mc], enable_checkpointing=True).fit(M())
        ckpt = os.path.join(root, "x.ckpt")

        seen = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                s = trainer.strategy
                if name == "quant_ddp":
                    seen["step"] = s.hook_state.step
                    seen["ef_max"] = max(
                        (float(e.abs().max()) for e in s.hook_state.ef_state_dict().values()), default=0.0
                    )
                else:
                    seen["schedule"] = dict(s.schedule_state)
                    seen["num_syncs"] = s.num_syncs

        trainer = _trainer(make(), os.path.join(root, "b"), 2, [Probe()], enable_checkpointing=False)
        module = M()
        trainer.validate(module, ckpt_path=ckpt, verbose=False)
        trainer.fit(module)  # a fresh fit (no ckpt_path)
        seen["global_step_at_end"] = trainer.global_step
        res[name] = seen
        # control: fit(ckpt_path=...) still restores the state
        resumed = {}

        class ResumeProbe(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                s = trainer.strategy
                resumed["step"] = s.hook_state.step if name == "quant_ddp" else s.schedule_state.get("step")

        _trainer(make(), os.path.join(root, "c"), 9, [ResumeProbe()], enable_checkpointing=False).fit(
            M(), ckpt_path=ckpt
        )
        res[name + "_resumed"] = resumed
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2, timeout_s=240)
        return rank_results(d, 2, "rank{rank}.pkl")


def test_quant_ddp_fit_after_validate_ckpt_starts_fresh(results):
    for r in results:
        seen = r["quant_ddp"]
        assert seen["step"] == 0, f"fresh fit starts at hook step {seen['step']} (the validated checkpoint's)"
        assert seen["ef_max"] == 0.0, f"fresh fit starts with error-feedback residuals of max {seen['ef_max']}"


def test_local_sgd_fit_after_validate_ckpt_starts_fresh(results):
    for r in results:
        seen = r["local_sgd"]
        assert seen["schedule"].get("step", 0) == 0, f"fresh fit starts with schedule {seen['schedule']}"
        assert seen["num_syncs"] == 0, f"fresh fit starts with num_syncs={seen['num_syncs']}"


@pytest.mark.parametrize("name", ["quant_ddp", "local_sgd"])
def test_control_fit_with_ckpt_path_still_restores(results, name):
    for r in results:
        assert r[name + "_resumed"]["step"] == 7
