"""``QSDPStrategy(hsdp=True)`` in a Trainer launched as 2 nodes x 2 ranks (issue 16), in one spawn of 4 ranks.

Each rank gets the variables a launcher sets (``LOCAL_RANK`` / ``NODE_RANK`` / ``WORLD_SIZE``, node-major, as
``tests/_launch.lightning_env``), so Lightning sees ``Trainer(num_nodes=2, devices=2)`` with global rank !=
local rank. Checks: the job trains with 8-bit gradients across nodes; the replicas of each shard (ranks 0/2,
1/3) stay bit-identical; a sharded checkpoint saved at step 4 resumes with exactly the saved weights and
continues; ``node_size=1`` (no second level) warns and trains as flat QSDP; and ``QSDPFabricStrategy(hsdp=True)``
under Fabric keeps the replicas identical too.
"""

from __future__ import annotations

import os
import traceback

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result
from test_qsdp_hsdp import Net

WORLD, NODE = 4, 2


class LitNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.seen: dict = {}

    def training_step(self, batch, i):
        (t,) = batch
        logits = self.net(t)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(t, 1, dims=1).flatten())
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_start(self) -> None:
        self.seen["start"] = _checksums(self)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        t = torch.randint(0, 32, (256, 16), generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(t), batch_size=8)


def _checksums(module) -> dict:
    out = {}
    for n, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = [float(full.double().sum()), p.to_local().reshape(-1)[:8].tolist() if hasattr(p, "to_local") else []]
    return out


def _trainer(strategy, steps: int, root: str):
    return pl.Trainer(
        accelerator="cpu",
        devices=NODE,
        num_nodes=WORLD // NODE,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def _fabric_run() -> dict:
    """The same HSDP under Lightning Fabric (``QSDPFabricStrategy(hsdp=True)``): 3 steps, this rank's shards."""
    from lightning.fabric import Fabric

    from lightning_qcomm import QSDPFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=NODE, num_nodes=WORLD // NODE, strategy=QSDPFabricStrategy(hsdp=True))
    fabric.launch()  # processes made outside (the launcher's variables): joins them
    fabric.seed_everything(1)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for step in range(3):
        t = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(10 * step + fabric.global_rank))
        loss = torch.nn.functional.cross_entropy(model(t).flatten(0, 1), torch.roll(t, 1, dims=1).flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "local": {n: p.to_local().reshape(-1)[:8].tolist() for n, p in model.named_parameters()}}


def _worker(rank: int, port: int, out: str) -> None:
    import warnings

    from lightning_qcomm import QSDPStrategy

    os.environ.update(lightning_env(rank, WORLD, port, ranks_per_node=NODE))
    torch.set_num_threads(1)
    result: dict = {}
    try:
        pl.seed_everything(0)
        ckpt = os.path.join(out, "hsdp.ckpt")
        first = LitNet()
        trainer = _trainer(QSDPStrategy(hsdp=True, grad_bits=8, bucket_size=256), 4, out)
        trainer.fit(first)
        result["global_rank"], result["local_rank"] = trainer.global_rank, trainer.local_rank
        result["node_rank"] = trainer.node_rank
        result["loss4"] = float(trainer.callback_metrics["loss"])
        result["saved"] = _checksums(first)
        trainer.save_checkpoint(ckpt)
        resumed = LitNet()
        trainer = _trainer(QSDPStrategy(hsdp=True, grad_bits=8, bucket_size=256), 8, out)
        trainer.fit(resumed, ckpt_path=ckpt)
        result["resumed_start"] = resumed.seen["start"]
        result["loss8"] = float(trainer.callback_metrics["loss"])
        result["global_step"] = trainer.global_step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flat = LitNet()
            _trainer(QSDPStrategy(hsdp=True, node_size=1, grad_bits=8), 2, out).fit(flat)
        result["flat_warnings"] = [str(w.message) for w in caught if "no second level" in str(w.message)]
        result["fabric"] = _fabric_run()
    except Exception:
        result["error"] = traceback.format_exc()
    write_rank_result(out, rank, result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp_trainer")
    spawn(_worker, free_port(), str(out), nprocs=WORLD)
    res = rank_results(out, WORLD)
    for r in res:
        assert "error" not in r, r["error"]
    return res


def test_launched_as_two_nodes(runs):
    assert [(r["global_rank"], r["local_rank"], r["node_rank"]) for r in runs] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]


def test_replicas_identical_and_shards_distinct(runs):
    for local in range(NODE):
        a, b = runs[local]["saved"], runs[local + NODE]["saved"]
        assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}
    assert {k: v[1] for k, v in runs[0]["saved"].items()} != {k: v[1] for k, v in runs[1]["saved"].items()}


def test_resume_restores_the_saved_weights_and_continues(runs):
    for r in runs:
        assert r["resumed_start"] == r["saved"]
        assert r["global_step"] == 8
        assert r["loss8"] < r["loss4"]


def test_one_rank_per_node_warns_and_trains_flat(runs):
    assert len(runs[0]["flat_warnings"]) == 1
    assert all(not r["flat_warnings"] for r in runs[1:])  # rank_zero_warn


def test_fabric_hsdp_replicas_identical(runs):
    for local in range(NODE):
        assert runs[local]["fabric"]["local"] == runs[local + NODE]["fabric"]["local"]
    assert runs[0]["fabric"]["local"] != runs[1]["fabric"]["local"]
    assert all(all(map(lambda v: v == v, r["fabric"]["losses"])) for r in runs)  # finite, ran 3 steps
