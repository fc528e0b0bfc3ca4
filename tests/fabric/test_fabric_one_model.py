"""Fabric's GAN pattern, ``fabric.setup(G, opt_g)`` then ``fabric.setup(D, opt_d)``, on the strategies whose per-step
state belongs to one model (2 gloo ranks).

LocalSGDFabricStrategy kept one ``LocalSGD`` and QuantDDPFabricStrategy one hook state, each replaced by the second
model's: the generator was never averaged (its replicas drifted apart), or its hook stayed at step 0 (fp32 for the
whole run past ``start_step``). A second model is now refused on every rank with the way out in the message, and
that way (both models as one module, both optimizers through ``setup_optimizers``) trains them in sync.
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

ITERS = 4


def _agree(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], e) for e in every)


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _nets():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    d = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return g, d


def _train(fabric, gan, opt_g, opt_d) -> None:
    gen = torch.Generator().manual_seed(1 + fabric.global_rank)  # each rank its own data
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for _ in range(ITERS):
        z, real = torch.randn(16, 8, generator=gen), torch.randn(16, 16, generator=gen) + 2
        opt_g.zero_grad()
        fabric.backward(F.binary_cross_entropy_with_logits(gan(z, "fake"), ones))
        opt_g.step()
        opt_d.zero_grad()
        loss = F.binary_cross_entropy_with_logits(gan(real, "real"), ones)
        fabric.backward(loss + F.binary_cross_entropy_with_logits(gan(z, "detached"), zeros))
        opt_d.step()


class GAN(nn.ModuleDict):
    """Both models in one module; every forward goes through the strategy's wrapper (DDP's hooks see it)."""

    def forward(self, x, part):
        g, d = self["generator"], self["discriminator"]
        if part == "real":
            return d(x)
        return d(g(x).detach() if part == "detached" else g(x))


def _case(fabric, strategy) -> dict:
    res = {}
    g, d = _nets()
    fabric.setup(g, torch.optim.SGD(g.parameters(), lr=0.1))
    try:
        fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.1))
        res["refused"] = None
    except ValueError as err:
        res["refused"] = str(err)
    strategy._module = None  # start again on the same processes: one module this time
    g, d = _nets()
    gan = fabric.setup_module(GAN({"generator": g, "discriminator": d}))
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    )
    _train(fabric, gan, opt_g, opt_d)
    res["g_agree"], res["d_agree"] = _agree(_flat(g)), _agree(_flat(d))
    return res


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning.fabric import Fabric

    from lightning_qcomm import LocalSGDFabricStrategy, QuantDDPFabricStrategy

    res = {}
    strategy = LocalSGDFabricStrategy(sync="constant", period=ITERS)  # 2 optimizer steps per iteration
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    res["local_sgd"] = _case(fabric, strategy)
    strategy.local_sgd.sync()
    res["local_sgd"]["g_agree"], res["local_sgd"]["d_agree"] = (
        _agree(_flat(strategy._module["generator"])),
        _agree(_flat(strategy._module["discriminator"])),
    )

    strategy = QuantDDPFabricStrategy(codec="uniform", bits=8, min_quant_numel=0, find_unused_parameters=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    res["quant_ddp"] = _case(fabric, strategy)
    res["quant_ddp"]["hook_step"] = strategy.hook_state.step
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2, timeout_s=240)
        return rank_results(d, 2, "rank{rank}.pkl")


@pytest.mark.parametrize("name", ["local_sgd", "quant_ddp"])
def test_a_second_model_is_refused_with_the_way_out(results, name):
    for r in results:
        msg = r[name]["refused"]
        assert msg is not None, "the second fabric.setup was accepted"
        assert "one model per strategy" in msg and "Sequential after Sequential" in msg
        assert "torch.nn.ModuleDict" in msg and "setup_optimizers" in msg


@pytest.mark.parametrize("name", ["local_sgd", "quant_ddp"])
def test_both_models_as_one_module_train_in_sync(results, name):
    for r in results:
        assert r[name]["g_agree"] and r[name]["d_agree"]


def test_quant_ddp_hook_counts_both_optimizers_steps(results):
    for r in results:
        assert r["quant_ddp"]["hook_step"] == 2 * ITERS
