"""``QSDPStrategy(hsdp=True)`` in a Trainer launched as 2 nodes x 2 ranks, in one spawn of 4 ranks.

Each rank gets the variables a launcher sets (``LOCAL_RANK`` / ``NODE_RANK`` / ``WORLD_SIZE``, node-major, as
``_launch.lightning_env``), so Lightning sees ``Trainer(num_nodes=2, devices=2)`` with global rank !=
local rank. Checks: the job trains with 8-bit gradients across nodes; the replicas of each shard (ranks 0/2,
1/3) stay bit-identical; a sharded checkpoint saved at step 4 resumes with exactly the saved weights and
optimizer state and continues; ``node_size=1`` (no second level) warns and trains as flat QSDP;
``QSDPFabricStrategy(hsdp=True)`` under Fabric keeps the replicas identical too; Lightning's GAN pattern (manual
optimization, two optimizers, ``toggle_optimizer``) trains and resumes, replicas identical. Then the 2 x 2
checkpoint resumes on another topology: the same 4 processes relaunched as 4 nodes x 1 (``NODE_RANK`` = rank), and
a spawn of 2 ranks as 1 node x 2: weights and optimizer state resharded exactly, the RNG step kept, one warning
naming both topologies (docs/design.md, "Another topology on resume"). ``grad_bits="auto"`` chooses one width
across nodes on every rank and keeps it through a resume.
"""

from __future__ import annotations

import os
import traceback

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result
from _siblings import from_test_file

GAN, RootGAN = from_test_file("strategies/test_qsdp_flows", "GAN", "RootGAN")
Net = from_test_file("parallel/test_qsdp_hsdp", "Net")

WORLD, NODE = 4, 2
ANOTHER_TOPOLOGY = "the checkpoint was written on 2 nodes x 2 ranks (HSDP)"


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
        self.seen["start_opt"] = _opt_checksums(self.trainer.optimizers[0])

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


def _sharded_checksums(module) -> dict:
    """``_checksums`` with every FSDP group resharded first: an FSDP root whose last forward had no backward (the
    generator in the discriminator's phase) stays gathered after the step."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return _checksums(module)


def _opt_checksums(optimizer) -> list[float]:
    """Sums of every optimizer state tensor (full tensors: collective), in parameter and key order."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, v in sorted(optimizer.state.get(p, {}).items()):
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                out.append(float(full.double().sum()))
    return out


def _trainer(strategy, steps: int, root: str, per_node: int = NODE, world: int = WORLD, callbacks=()):
    return pl.Trainer(
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def _fabric_run(steps: int = 3, **kwargs) -> dict:
    """The same HSDP under Lightning Fabric (``QSDPFabricStrategy(hsdp=True, **kwargs)``): this rank's shards after
    ``steps`` steps."""
    from lightning.fabric import Fabric

    from lightning_qcomm import QSDPFabricStrategy

    strategy = QSDPFabricStrategy(hsdp=True, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=NODE, num_nodes=WORLD // NODE, strategy=strategy)
    fabric.launch()  # processes made outside (the launcher's variables): joins them
    fabric.seed_everything(1)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for step in range(steps):
        t = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(10 * step + fabric.global_rank))
        loss = torch.nn.functional.cross_entropy(model(t).flatten(0, 1), torch.roll(t, 1, dims=1).flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    trial = strategy.comm_state.trial
    return {
        "losses": losses,
        "local": {n: p.to_local().reshape(-1)[:8].tolist() for n, p in model.named_parameters()},
        "chosen": None if trial is None else trial.chosen,
    }


def _hsdp():
    from lightning_qcomm import QSDPStrategy

    return QSDPStrategy(hsdp=True, grad_bits=8, bucket_size=256)


def _resume(out: str, steps: int, per_node: int, world: int) -> dict:
    """Resume the 2 x 2 checkpoint ``hsdp.ckpt`` (saved at step 4) on ``world // per_node`` nodes of ``per_node``."""
    import warnings

    module = LitNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(_hsdp(), steps, out, per_node, world)
        trainer.fit(module, ckpt_path=os.path.join(out, "hsdp.ckpt"))
    return {
        "start": module.seen["start"],
        "start_opt": module.seen["start_opt"],
        "rng_step": trainer.strategy.comm_state.step,
        "global_step": trainer.global_step,
        "loss": float(trainer.callback_metrics["loss"]),
        "topology_warnings": [str(w.message) for w in caught if "checkpoint was written on" in str(w.message)],
    }


def _gan_run(out: str, module_cls, batches: int, resume: bool) -> dict:
    """The GAN (two optimizers, manual optimization) under HSDP for ``batches`` batches (2 optimizer steps each);
    with ``resume``, saved there and resumed for as many more."""
    before = _checksums(module_cls())
    module = module_cls()
    trainer = _trainer(_hsdp(), 2 * batches, out)
    trainer.fit(module)
    res = {
        "global_step": trainer.global_step,
        "rng_step": trainer.strategy.comm_state.step,
        "losses": module.g_losses + module.d_losses,
        "saved": _sharded_checksums(module),
        "before": before,
    }
    if resume:
        ckpt = os.path.join(out, f"{module_cls.__name__}.ckpt")
        trainer.save_checkpoint(ckpt)
        resumed = module_cls()
        seen = {}

        class Start(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                seen["start"] = _checksums(pl_module)

        trainer = _trainer(_hsdp(), 4 * batches, out, callbacks=[Start()])
        trainer.fit(resumed, ckpt_path=ckpt)
        res.update(
            resumed_start=seen["start"],
            resumed_step=trainer.global_step,
            resumed_rng_step=trainer.strategy.comm_state.step,
            resumed_losses=resumed.g_losses + resumed.d_losses,
            resumed_end=_sharded_checksums(resumed),
        )
    return res


def _auto_run(out: str) -> dict:
    """``grad_bits="auto"`` under HSDP in the Trainer: the 12-step trial (32, 8, 4 bits), two steps at the choice,
    saved, and resumed for two more (the choice and when it was made come back from the checkpoint)."""
    from lightning_qcomm import QSDPStrategy

    def strategy():
        return QSDPStrategy(hsdp=True, grad_bits="auto", min_bits=4, bucket_size=256)

    trainer = _trainer(strategy(), 14, out)
    trainer.fit(LitNet())
    trial = trainer.strategy.comm_state.trial
    res = {"chosen": trial.chosen, "decided_at": trial.decided_at, "grad_bits": trainer.strategy.grad_bits}
    ckpt = os.path.join(out, "auto.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer = _trainer(strategy(), 16, out)
    trainer.fit(LitNet(), ckpt_path=ckpt)
    trial = trainer.strategy.comm_state.trial
    res.update(resumed_chosen=trial.chosen, resumed_decided_at=trial.decided_at, resumed_step=trainer.global_step)
    return res


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
        trainer = _trainer(_hsdp(), 4, out)
        trainer.fit(first)
        result["global_rank"], result["local_rank"] = trainer.global_rank, trainer.local_rank
        result["node_rank"] = trainer.node_rank
        result["loss4"] = float(trainer.callback_metrics["loss"])
        result["saved"] = _checksums(first)
        result["saved_opt"] = _opt_checksums(trainer.optimizers[0])
        trainer.save_checkpoint(ckpt)
        resumed = _resume(out, 8, NODE, WORLD)
        result["resumed_start"] = resumed["start"]
        result["resumed_start_opt"] = resumed["start_opt"]
        result["same_topology_warnings"] = resumed["topology_warnings"]
        result["loss8"] = resumed["loss"]
        result["global_step"] = resumed["global_step"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flat = LitNet()
            _trainer(QSDPStrategy(hsdp=True, node_size=1, grad_bits=8), 2, out).fit(flat)
        result["flat_warnings"] = [str(w.message) for w in caught if "no second level" in str(w.message)]
        result["auto"] = _auto_run(out)
        result["fabric"] = _fabric_run()
        result["fabric_auto"] = _fabric_run(13, grad_bits="auto", min_bits=4, bucket_size=256)
        result["gan"] = _gan_run(out, GAN, 4, resume=True)
        result["root_gan"] = _gan_run(out, RootGAN, 4, resume=False)
        # the same processes relaunched as 4 nodes x 1 (what a launcher sets: NODE_RANK = rank, LOCAL_RANK = 0)
        os.environ.update(lightning_env(rank, WORLD, port, ranks_per_node=1))
        result["4x1"] = _resume(out, 6, 1, WORLD)
    except Exception:
        result["error"] = traceback.format_exc()
    write_rank_result(out, rank, result)


def _one_node_worker(rank: int, port: int, out: str) -> None:
    """1 node x 2 ranks: resume the 2 x 2 checkpoint."""
    os.environ.update(lightning_env(rank, NODE, port, ranks_per_node=NODE))
    torch.set_num_threads(1)
    try:
        result = _resume(out, 6, NODE, NODE)
    except Exception:
        result = {"error": traceback.format_exc()}
    write_rank_result(out, rank, result, name="one_node{rank}.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp_trainer")
    spawn(_worker, free_port(), str(out), nprocs=WORLD)
    res = rank_results(out, WORLD)
    for r in res:
        assert "error" not in r, r["error"]
    spawn(_one_node_worker, free_port(), str(out), nprocs=NODE)
    one_node = rank_results(out, NODE, name="one_node{rank}.json")
    for rank, r in enumerate(one_node):
        assert "error" not in r, r["error"]
        res[rank]["1x2"] = r
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
        assert r["resumed_start_opt"] == r["saved_opt"] and len(r["saved_opt"]) > 0
        assert r["global_step"] == 8
        assert r["loss8"] < r["loss4"]
        assert not r["same_topology_warnings"], r["same_topology_warnings"]


@pytest.mark.parametrize(("layout", "now"), [("1x2", "flat QSDP over 2 ranks"), ("4x1", "flat QSDP over 4 ranks")])
def test_resume_on_another_topology_reshards_and_warns_once(runs, layout, now):
    """2 x 2 -> 1 x 2 / 4 x 1 (both flat QSDP: no second level): the sharded checkpoint (DCP) is resharded onto the
    new layout, so every weight and optimizer state is the saved one; the RNG step is kept; QSDP holds no per-rank
    state to reset; one warning on rank 0 names both topologies."""
    ranks = [r[layout] for r in runs if layout in r]
    assert len(ranks) == int(layout[0]) * int(layout[2])
    for r in ranks:  # full-tensor sums (this rank's local slice depends on the layout)
        assert {k: v[0] for k, v in r["start"].items()} == {k: v[0] for k, v in runs[0]["saved"].items()}
        assert r["start_opt"] == runs[0]["saved_opt"]
        assert r["rng_step"] == 6 and r["global_step"] == 6  # saved at 4, two more steps
        assert r["loss"] == r["loss"]
    warned = ranks[0]["topology_warnings"]
    assert len(warned) == 1 and ANOTHER_TOPOLOGY in warned[0] and now in warned[0], warned
    assert all(not r["topology_warnings"] for r in ranks[1:])  # rank_zero_warn


@pytest.mark.parametrize("case", ["gan", "root_gan"])
def test_gan_with_two_optimizers_trains_under_hsdp(runs, case):
    """Manual optimization with toggle_optimizer (the discriminator frozen in the generator's phase and back):
    both players move, the replicas of each shard stay bit-identical, the RNG step counts both optimizers."""
    for r in runs:
        g = r[case]
        assert g["global_step"] == 8 and g["rng_step"] == 8 and len(g["losses"]) == 8
        assert all(x == x for x in g["losses"])
        moved = {k.split(".")[0] for k in g["saved"] if g["saved"][k][0] != g["before"][k][0]}
        assert {"generator", "discriminator"} <= moved, (case, moved)
    for local in range(NODE):
        a, b = runs[local][case]["saved"], runs[local + NODE][case]["saved"]
        assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}


def test_gan_resumes_on_the_same_topology(runs):
    for r in runs:
        g = r["gan"]
        assert g["resumed_start"] == g["saved"]
        assert g["resumed_step"] == 16 and g["resumed_rng_step"] == 16 and len(g["resumed_losses"]) == 8
        assert all(x == x for x in g["resumed_losses"])
    for local in range(NODE):
        a, b = runs[local]["gan"]["resumed_end"], runs[local + NODE]["gan"]["resumed_end"]
        assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}


def test_one_rank_per_node_warns_and_trains_flat(runs):
    assert len(runs[0]["flat_warnings"]) == 1
    assert all(not r["flat_warnings"] for r in runs[1:])  # rank_zero_warn


def test_auto_width_across_nodes_in_the_trainer_is_chosen_once_and_resumed(runs):
    auto = runs[0]["auto"]
    assert auto["chosen"] in (32, 8, 4) and auto["grad_bits"] == auto["chosen"]
    assert auto["decided_at"] == 12  # after 3 candidates x (1 untimed + 3 timed) steps
    for r in runs:
        assert r["auto"] == auto  # one choice on every rank
    assert (auto["resumed_chosen"], auto["resumed_decided_at"], auto["resumed_step"]) == (auto["chosen"], 12, 16)


def test_fabric_auto_width_across_nodes_is_one_choice(runs):
    chosen = runs[0]["fabric_auto"]["chosen"]
    assert chosen in (32, 8, 4)
    for r in runs:
        assert r["fabric_auto"]["chosen"] == chosen
    for local in range(NODE):
        assert runs[local]["fabric_auto"]["local"] == runs[local + NODE]["fabric_auto"]["local"]


def test_fabric_hsdp_replicas_identical(runs):
    for local in range(NODE):
        assert runs[local]["fabric"]["local"] == runs[local + NODE]["fabric"]["local"]
    assert runs[0]["fabric"]["local"] != runs[1]["fabric"]["local"]
    assert all(all(map(lambda v: v == v, r["fabric"]["losses"])) for r in runs)  # finite, ran 3 steps


def test_another_topology_message_names_both_layouts():
    from lightning_qcomm.parallel.hsdp import another_topology_message

    saved = {"rng_step": 4, "seed": 0, "world_size": 4, "topology": [2, 2]}
    assert another_topology_message("QSDPStrategy", saved, 4, [2, 2]) is None
    assert another_topology_message("QSDPStrategy", {"rng_step": 4, "seed": 0}, 2, None) is None  # not recorded
    msg = another_topology_message("QSDPFabricStrategy", saved, 8, [4, 2])
    assert msg.startswith("QSDPFabricStrategy: ") and ANOTHER_TOPOLOGY in msg and "4 nodes x 2 ranks (HSDP)" in msg
    flat = {"world_size": 2, "topology": None}
    assert "flat QSDP over 2 ranks" in another_topology_message("QSDPStrategy", flat, 4, [2, 2])
