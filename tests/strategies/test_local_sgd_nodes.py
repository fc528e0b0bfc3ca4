"""Local SGD across nodes (``scope="inter_node"``) and its DiLoCo form, on 4 real gloo ranks as 2 nodes x 2 ranks.

One spawn of 4 ranks, each with the variables a launcher sets per node (``NODE_RANK``, ``LOCAL_RANK``, ...), runs
``Trainer(accelerator="cpu", devices=2, num_nodes=2)`` fits in-process (as tests/strategies/test_hierarchical_training.py
does) and the plain-torch ``LocalSGD``. Checked: with H=1 and no codec, Local SGD across nodes of plain SGD is
plain DDP (to fp32 rounding); the ranks of a node are identical after every step, the nodes only every H steps;
the inter-node group carries parameter averages only at syncs (ledger tags); DiLoCo with outer_lr=1 and
outer_momentum=0 is plain averaging (derived identity: θ_prev − 1·(θ_prev − mean) = mean), with Nesterov it is
not; a DiLoCo run resumed from a mid-round checkpoint is bit-exact (outer state restored); overlapped DiLoCo keeps
a node's ranks identical and makes the nodes equal at the last sync; one node warns and
runs the global form; bad settings are refused naming the argument.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result
from _siblings import from_test_file

BATCH, N_SAMPLES, _dataset, _full_loss, _module, _params, _hier_fit = from_test_file(
    "strategies/test_hierarchical_training",
    "BATCH",
    "N_SAMPLES",
    "_dataset",
    "_full_loss",
    "_module",
    "_params",
    "_fit",
)

STEPS = 12
PERIOD = 3
SAVE_AT = 8  # one epoch (1024 / 4 ranks / 32); mid-round for PERIOD=3 (rounds end at 3, 6, 9, 12)
DILOCO_CKPT = f"diloco-step={SAVE_AT}.ckpt"
ONE_NODE = "runs the global form"


def _fit(strategy, callbacks=(), ckpt_path=None, momentum=0.0, max_steps=STEPS, **kw):
    """test_hierarchical_training's 2 x 2 fit, with SGD (``momentum``) as the module's optimizer."""

    def make():
        module = _module()
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.05, momentum=momentum)
        return module

    return _hier_fit(4, 2, strategy, callbacks, ckpt_path, max_steps=max_steps, make_module=make, **kw)


def _local(**kw):
    from lightning_qcomm import LocalSGDStrategy

    return LocalSGDStrategy(**{"sync": "constant", "period": PERIOD, "scope": "inter_node", **kw})


def _every_rank(module) -> list[torch.Tensor]:
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return every


class _Agreement:
    """After every step: (ranks of node 0 equal, ranks of node 1 equal, node 0 equals node 1)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class Probe(pl.Callback):
            def __init__(self) -> None:
                self.steps = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                r = _every_rank(pl_module)
                self.steps.append(
                    (trainer.global_step, torch.equal(r[0], r[1]), torch.equal(r[2], r[3]), torch.equal(r[0], r[2]))
                )

        return Probe()


def _calls(ledger) -> dict:
    return {f"{op}:{tag}": t.calls for (op, tag), t in ledger.cumulative.items()}


def _two_by_two(outdir: str) -> dict:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    res: dict = {}
    _, ddp, _, _ = _fit(DDPStrategy())
    res["ddp"] = _params(ddp)
    trainer, h1, ledger, caught = _fit(_local(period=1))
    res["h1"] = {"params": _params(h1), "calls": _calls(ledger), "warnings": caught}
    res["topology"] = trainer.strategy.topology

    probe = _Agreement()
    _, avg, ledger, _ = _fit(_local(), callbacks=[probe], momentum=0.9)
    res["avg"] = {"params": _params(avg), "steps": probe.steps, "calls": _calls(ledger)}
    probe = _Agreement()
    _, quant, ledger, _ = _fit(_local(codec="uniform", bits=8), callbacks=[probe], momentum=0.9)
    res["quant8"] = {"loss": _full_loss(quant), "steps": probe.steps, "calls": _calls(ledger)}
    res["avg"]["loss"] = _full_loss(avg)
    _, same, _, caught = _fit(_local(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0), momentum=0.9)
    res["diloco_1_0"] = {"params": _params(same), "warnings": caught}

    # DiLoCo with Nesterov: straight, saving at SAVE_AT (mid-round); then resumed from that checkpoint
    ckpt_dir = os.path.join(outdir, "ckpt")
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="diloco-{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    probe = _Agreement()
    trainer, straight, ledger, _ = _fit(
        _local(outer_optimizer="nesterov"), callbacks=[mc, probe], momentum=0.9, enable_checkpointing=True
    )
    outer = trainer.strategy.local_sgd.outer.state_dict()
    res["diloco"] = {
        "params": _params(straight),
        "steps": probe.steps,
        "calls": _calls(ledger),
        "loss": _full_loss(straight),
        "init_loss": _full_loss(_module()),
        "outer_same_on_ranks": _same_on_ranks(outer["momentum"]),
        "momentum_nonzero": all(bool(m.abs().sum() > 0) for m in outer["momentum"]),
    }
    res["diloco"]["inter_wire"] = _inter_wire_per_call(ledger)
    # quantized DiLoCo: the inter-node average of the pseudo-gradients at 8 bits feeds the outer step
    probe = _Agreement()
    trainer, quant, ledger, caught = _fit(
        _local(outer_optimizer="nesterov", codec="uniform", bits=8), callbacks=[probe], momentum=0.9
    )
    outer = trainer.strategy.local_sgd.outer.state_dict()
    res["diloco8"] = {
        "loss": _full_loss(quant),
        "steps": probe.steps,
        "calls": _calls(ledger),
        "inter_wire": _inter_wire_per_call(ledger),
        "outer_steps": outer["num_steps"],
        "outer_same_on_ranks": _same_on_ranks(outer["global_params"]) and _same_on_ranks(outer["momentum"]),
        "momentum_nonzero": all(bool(m.abs().sum() > 0) for m in outer["momentum"]),
        "params_are_global": all(torch.equal(p, g) for p, g in zip(_params(quant), outer["global_params"])),
        "warnings": caught,
    }
    saved = torch.load(os.path.join(ckpt_dir, DILOCO_CKPT), weights_only=False)["local_sgd"]
    res["saved_outer"] = {k: len(v) for k, v in saved["outer"].items() if isinstance(v, list)}
    _, resumed, _, _ = _fit(
        _local(outer_optimizer="nesterov"), momentum=0.9, ckpt_path=os.path.join(ckpt_dir, DILOCO_CKPT)
    )
    res["diloco_resumed"] = _params(resumed)

    # DiLoCo with each inter-node average applied a round later (overlap=True, on a second set of node groups)
    probe = _Agreement()
    _, over, ledger, _ = _fit(_local(outer_optimizer="nesterov", overlap=True), callbacks=[probe], momentum=0.9)
    res["diloco_overlap"] = {"steps": probe.steps, "calls": _calls(ledger), "loss": _full_loss(over)}
    res["diloco_overlap"]["final"] = _every_rank(over)

    # node_size=4: one node of 4 ranks -> warned, the global form (flat tags)
    _, _, ledger, caught = _fit(_local(node_size=4), max_steps=PERIOD)
    res["one_node"] = {"calls": _calls(ledger), "warnings": caught}
    try:
        _fit(_local(node_size=3), max_steps=1)
        res["bad_node_size"] = None
    except ValueError as err:
        res["bad_node_size"] = str(err)
    res["plain"] = _plain_torch()
    res["fabric"] = _fabric()
    dist.barrier()
    return res


def _inter_wire_per_call(ledger) -> float:
    t = ledger.cumulative[("all_reduce", "param_average@inter")]
    return t.wire_bytes / t.calls


def _same_on_ranks(tensors) -> bool:
    """Every tensor of ``tensors`` bit-identical on all ranks (gathered)."""
    return all(all(torch.equal(e[0], e[i]) for i in range(len(e))) for e in map(_gather, tensors))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return every


QSR_H = 4  # QSR's H from lr 0.05: max(h_base=2, floor((0.1 / 0.05) ** 2))


def _plain_torch(steps: int = 8) -> dict:
    """No Lightning: ``LocalSGD(config=LocalSGDConfig(sync="qsr", scope="inter_node", node_size=2,
    outer_optimizer="nesterov"))``: QSR sets DiLoCo's H."""
    import torch.distributed as dist

    from lightning_qcomm import LocalSGD, LocalSGDConfig
    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    x, y = _dataset().tensors
    rank = dist.get_rank()
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(rank * BATCH, N_SAMPLES, 4 * BATCH)][:steps]
    net = _module().body
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    config = LocalSGDConfig(
        sync="qsr", h_base=2, alpha=0.1, scope="inter_node", node_size=2, outer_optimizer="nesterov"
    )
    ledger = CommLedger()
    set_ledger(ledger)
    local_sgd = LocalSGD(net, opt, config, total_steps=steps)
    agree = []
    for bx, by in batches:
        torch.nn.functional.cross_entropy(net(bx), by).backward()
        opt.step()
        opt.zero_grad()
        r = _every_rank(net)
        agree.append((torch.equal(r[0], r[1]) and torch.equal(r[2], r[3]), torch.equal(r[0], r[2])))
    set_ledger(None)
    state = local_sgd.state_dict()
    return {
        "agree": agree,
        "calls": _calls(ledger),
        "has_outer": "outer" in state,
        "syncs": local_sgd.num_syncs,
        "outer_steps": local_sgd.outer.num_steps,
    }


def _fabric(steps: int = 6) -> dict:
    """``LocalSGDFabricStrategy(scope="inter_node", outer_optimizer="nesterov")`` under ``Fabric(devices=2, num_nodes=2)``."""
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_qcomm import LocalSGDFabricStrategy

    x, y = _dataset().tensors
    rank = dist.get_rank()
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(rank * BATCH, N_SAMPLES, 4 * BATCH)][:steps]
    strategy = LocalSGDFabricStrategy(
        sync="constant", period=PERIOD, scope="inter_node", outer_optimizer="nesterov", total_steps=steps
    )
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
    fabric.launch()
    net = _module().body
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    agree = []
    for bx, by in batches:
        fabric.backward(torch.nn.functional.cross_entropy(model(bx), by))
        opt.step()
        opt.zero_grad()
        r = _every_rank(net)
        agree.append((torch.equal(r[0], r[1]) and torch.equal(r[2], r[3]), torch.equal(r[0], r[2])))
    return {"agree": agree, "topology": strategy.local_sgd.topology, "outer_steps": strategy.local_sgd.outer.num_steps}


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="4",
        NODE_RANK=str(rank // 2),
        LOCAL_RANK=str(rank % 2),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    write_rank_result(outdir, rank, _two_by_two(outdir), name="rank{rank}.pkl")


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=4)
        yield rank_results(d, 4, name="rank{rank}.pkl")


def _max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


# ------------------------------------------------------------------------------------------ 2 nodes x 2 ranks
def test_node_size_from_lightning_devices(runs):
    assert runs[0]["topology"] == (2, 2)


def test_h1_without_codec_equals_plain_ddp(runs):
    """Plain SGD: the intra-node gradient mean, one local step, then the inter-node parameter mean is
    θ − lr·mean over 4 ranks of g, DDP's step; only the order of fp32 additions differs."""
    for r in runs:
        assert _max_diff(r["h1"]["params"], r["ddp"]) < 1e-5
        assert not [w for w in r["h1"]["warnings"] if ONE_NODE in w]


def test_intra_identical_every_step_inter_every_h(runs):
    for name in ("avg", "diloco", "quant8", "diloco8"):
        steps = runs[0][name]["steps"]
        assert [s for s, *_ in steps] == list(range(1, STEPS + 1))
        for step, node0, node1, across in steps:
            assert node0 and node1, (name, step)
            # (the DiLoCo run's checkpoint at SAVE_AT averages after the probe: Lightning runs ModelCheckpoint last)
            assert across == (step % PERIOD == 0), (name, step, across)


def test_inter_group_carries_parameter_averages_only_at_syncs(runs):
    """Gradients go over the intra-node group every step; parameters cross nodes once per sync, 1/2 of them
    from each rank of a node (the hierarchical average); nothing is averaged over the flat world."""
    for r in runs:
        calls = r["avg"]["calls"]
        assert calls["all_reduce:grads@intra"] == STEPS
        assert calls["all_reduce:param_average@inter"] == STEPS // PERIOD
        assert calls["reduce_scatter:param_average@intra"] == STEPS // PERIOD
        assert not [k for k in calls if k.endswith(":param_average") or k.endswith(":grads")], calls
        h1 = r["h1"]["calls"]
        assert h1["all_reduce:param_average@inter"] == STEPS and h1["all_reduce:grads@intra"] == STEPS
        # the DiLoCo run also averages once at the checkpoint (a forced sync): STEPS // PERIOD + 1
        assert r["diloco"]["calls"]["all_reduce:param_average@inter"] == STEPS // PERIOD + 1


def test_diloco_overlapped_across_nodes(runs):
    """overlap=True across nodes: the per-step intra-node gradient means keep a node's ranks identical while an
    average is in flight; the nodes differ by their own progress after every sync but the last, which is exact."""
    r = runs[0]["diloco_overlap"]
    assert [s for s, *_ in r["steps"]] == list(range(1, STEPS + 1))
    for step, node0, node1, across in r["steps"]:
        assert node0 and node1, step
        assert across == (step == STEPS), (step, across)
    assert all(torch.equal(t, r["final"][0]) for t in r["final"])
    for rank in runs:  # 3 averages in the background (steps 3, 6, 9), the last inline (step 12)
        assert rank["diloco_overlap"]["calls"]["all_reduce:param_average@inter"] == STEPS // PERIOD
        assert rank["diloco_overlap"]["calls"]["all_reduce:grads@intra"] == STEPS
    assert r["loss"] < runs[0]["diloco"]["init_loss"]


def test_quantized_inter_node_average_close_to_fp32(runs):
    """8-bit averaging of the parameter changes across nodes: the ranks still agree (above), loss within 1%."""
    r0 = runs[0]
    assert abs(r0["quant8"]["loss"] - r0["avg"]["loss"]) / r0["avg"]["loss"] < 0.01
    assert [k for k in r0["quant8"]["calls"] if k.endswith(":param_average@inter")], r0["quant8"]["calls"]


def test_diloco_unit_outer_lr_zero_momentum_is_plain_averaging(runs):
    for r in runs:
        assert _max_diff(r["diloco_1_0"]["params"], r["avg"]["params"]) < 1e-6
        assert not [w for w in r["diloco_1_0"]["warnings"] if "no effect" in w], r["diloco_1_0"]["warnings"]
    # Nesterov (0.7, 0.9) is another trajectory, and it trains
    assert _max_diff(runs[0]["diloco"]["params"], runs[0]["avg"]["params"]) > 1e-3
    assert runs[0]["diloco"]["loss"] < runs[0]["diloco"]["init_loss"]


def test_diloco_outer_state_same_on_ranks_and_checkpointed(runs):
    n_params = len(runs[0]["ddp"])
    for r in runs:
        assert r["diloco"]["outer_same_on_ranks"] and r["diloco"]["momentum_nonzero"]
        assert r["saved_outer"] == {"global_params": n_params, "momentum": n_params}


def test_quantized_diloco_agrees_across_ranks_close_to_fp32_and_shrinks_inter_bytes(runs):
    """DiLoCo fed by the 8-bit inter-node average (uniform codec on the changes since the last sync): θ̄ decodes
    from the same bytes everywhere, so θ_g and the outer momentum are bit-identical on the 4 ranks and the
    parameters are θ_g after the last sync; loss within the 8-bit band (1%) of the fp32 DiLoCo run; the
    inter-node all-reduce of each rank's shard sends the codec's bytes instead of 4 per element."""
    from lightning_qcomm import LocalSGDConfig
    from lightning_qcomm.collectives import all_reduce_pieces

    n_params = sum(p.numel() for p in runs[0]["ddp"])
    shard = -(-n_params // 2)  # each rank of a node sends its half of the node's parameters across
    codec = LocalSGDConfig(codec="uniform", bits=8).build_codec()
    nodes = 2
    # per call: 2(M-1)/M x the collective; fp32: shard * 4 bytes, 8-bit: M chunks of ceil(piece / M) codes + scales
    ratio = nodes * sum(codec.nbytes(-(-n // nodes)) for _, n in all_reduce_pieces(shard, nodes, codec)) / (4 * shard)
    assert 0.25 < ratio < 0.27
    for r in runs:
        q = r["diloco8"]
        assert q["outer_same_on_ranks"] and q["momentum_nonzero"] and q["params_are_global"]
        assert q["outer_steps"] == STEPS // PERIOD
        assert q["calls"]["all_reduce:param_average@inter"] == STEPS // PERIOD
        assert q["inter_wire"] / r["diloco"]["inter_wire"] == pytest.approx(ratio, rel=1e-9)
        assert not [w for w in q["warnings"] if "no effect" in w or ONE_NODE in w], q["warnings"]
    r0 = runs[0]
    assert r0["diloco8"]["loss"] < r0["diloco"]["init_loss"]
    assert abs(r0["diloco8"]["loss"] - r0["diloco"]["loss"]) / r0["diloco"]["loss"] < 0.01


def test_diloco_resume_is_exact(runs):
    for r in runs:
        for p, q in zip(r["diloco_resumed"], r["diloco"]["params"]):
            assert torch.equal(p, q), float((p - q).abs().max())


def test_one_node_warns_and_runs_global(runs):
    r0 = runs[0]["one_node"]
    assert [w for w in r0["warnings"] if ONE_NODE in w], r0["warnings"]
    assert r0["calls"]["all_reduce:param_average"] == 1
    assert not [k for k in r0["calls"] if "@" in k], r0["calls"]


def test_node_size_not_dividing_world_refused(runs):
    for r in runs:
        assert r["bad_node_size"] is not None and "node_size=3" in r["bad_node_size"], r["bad_node_size"]


def test_plain_torch_local_sgd_across_nodes(runs):
    for r in runs:
        p = r["plain"]
        assert all(intra for intra, _ in p["agree"])
        assert [across for _, across in p["agree"]] == [(i + 1) % QSR_H == 0 for i in range(8)]
        assert p["calls"]["all_reduce:param_average@inter"] == 2 and p["has_outer"] and p["syncs"] == 2
        assert p["outer_steps"] == 2


def test_fabric_local_sgd_across_nodes(runs):
    for r in runs:
        f = r["fabric"]
        assert f["topology"] == (2, 2) and f["outer_steps"] == 2
        assert all(intra for intra, _ in f["agree"])
        assert [across for _, across in f["agree"]] == [(i + 1) % PERIOD == 0 for i in range(6)]


# ------------------------------------------------------------------------------------------ bad input (no ranks)
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(scope="nodes"), ["scope", "'nodes'", "global", "inter_node"]),
        (dict(outer_optimizer="adam"), ["outer_optimizer", "'adam'", "average", "nesterov"]),
        (dict(outer_optimizer="nesterov", outer_lr=0.0), ["outer_lr", "0.0"]),
        (dict(outer_optimizer="nesterov", outer_momentum=1.0), ["outer_momentum", "1.0"]),
        (dict(outer_optimizer="nesterov", outer_momentum=-0.1), ["outer_momentum", "-0.1"]),
        (dict(scope="inter_node", node_size=0), ["node_size", "0"]),
    ],
)
def test_bad_input_names_argument_value_and_allowed(kw, words):
    from lightning_qcomm import LocalSGDConfig, LocalSGDStrategy

    for make, owner in ((LocalSGDStrategy, "LocalSGDStrategy"), (LocalSGDConfig, "LocalSGDConfig")):
        with pytest.raises((ValueError, TypeError)) as err:
            make(**kw)
        for w in [owner, *words]:
            assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        (dict(outer_lr=0.5), "outer_lr"),
        (dict(outer_momentum=0.5), "outer_momentum"),
        (dict(node_size=2), "node_size"),
    ],
)
def test_settings_without_effect_warn(kw, word):
    from lightning_qcomm import LocalSGDStrategy

    with pytest.warns(UserWarning, match=f"{word}.*no effect"):
        LocalSGDStrategy(**kw)


def test_defaults_are_todays_global_averaging():
    from lightning_qcomm import LocalSGDConfig

    c = LocalSGDConfig()
    assert (c.scope, c.node_size, c.outer_optimizer, c.outer_lr, c.outer_momentum) == (
        "global",
        None,
        "average",
        0.7,
        0.9,
    )
