"""Local SGD with the parameter average overlapped with the next round (``LocalSGDConfig(overlap=True)``).

2 gloo ranks (spawn), plain torch ``LocalSGD``: each rank trains a small MLP on its own data. The overlapped run is
compared bit for bit with a hand-written reference of the update (parallel/local_sgd_overlap.py's docstring) that
averages with ``dist.all_reduce`` on the main thread:

    end of round k:   x <- A_{k-1} + (x - s_{k-1});   s_k <- x;   A_k <- mean_r s_k     (started, applied a round later)
    last sync:        x <- A_{k-1} + (x - s_{k-1});   x <- mean_r x                       (exact)

and, with ``outer_optimizer="nesterov"``, DiLoCo's outer step taken from θ̄ = A_{k-1} before the progress is added.
The Trainer and Fabric flows run in ``test_strategy_matrix.py`` (``local_sgd_overlap``) and ``test_entry_points.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn

STEPS = 7  # rounds of 2 steps end at 2, 4, 6; the last round (step 7) is cut to one step and is exact
PERIOD = 2
LR = 0.1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data: the replicas drift apart
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _avg(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t


def _train_step(model, opt, batch) -> None:
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _reference(rank: int, outer: bool) -> list[torch.Tensor]:
    """The update written out (module docstring); returns the parameters after every step."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    theta_g = _flat(model).clone()
    momentum = torch.zeros_like(theta_g)

    def outer_step(mean: torch.Tensor) -> torch.Tensor:  # NesterovOuterOptimizer.step's operations, in order
        delta = theta_g - mean
        momentum.mul_(OUTER_MOMENTUM).add_(delta)
        theta_g.sub_(delta.add_(momentum, alpha=OUTER_MOMENTUM), alpha=OUTER_LR)
        return theta_g.clone()

    pending, trace = None, []
    for step, batch in enumerate(_batches(rank), start=1):
        _train_step(model, opt, batch)
        if step % PERIOD == 0 or step == STEPS:
            x = _flat(model)
            if pending is not None:
                s, mean = pending
                base = outer_step(mean) if outer else mean
                x = (x - s).add_(base)
                pending = None
            if step == STEPS:
                x = _avg(x.clone())
                if outer:
                    x = outer_step(x)
            else:
                pending = (x.clone(), _avg(x.clone()))
            _set_flat(model, x)
        trace.append(_flat(model).clone())
    return trace


def _overlapped(rank: int, outer: bool, codec: str | None = None) -> dict:
    from lightning_qcomm import LocalSGD, LocalSGDConfig

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    config = LocalSGDConfig(
        sync="constant",
        period=PERIOD,
        overlap=True,
        codec=codec,
        outer_optimizer="nesterov" if outer else "average",
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )
    local_sgd = LocalSGD(model, opt, config, total_steps=STEPS)
    trace, pending = [], []
    for batch in _batches(rank):
        _train_step(model, opt, batch)
        trace.append(_flat(model).clone())
        pending.append(local_sgd.overlap.pending)
    local_sgd.close()
    return {"trace": trace, "pending": pending, "num_syncs": local_sgd.num_syncs}


def _sync_worker(rank: int) -> dict:
    """``sync()`` mid-round applies the average in flight and averages exactly; ``state_dict`` refuses meanwhile."""
    from lightning_qcomm import LocalSGD, LocalSGDConfig

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    local_sgd = LocalSGD(model, opt, LocalSGDConfig(sync="constant", period=PERIOD, overlap=True), total_steps=STEPS)
    batches = _batches(rank)
    for batch in batches[:3]:  # the average of round 1 is in flight during step 3
        _train_step(model, opt, batch)
    out = {"pending_before": local_sgd.overlap.pending}
    try:
        local_sgd.state_dict()
        out["state_dict_refused"] = False
    except RuntimeError:
        out["state_dict_refused"] = True
    out["synced"] = local_sgd.sync()
    out["pending_after"] = local_sgd.overlap.pending
    out["params"] = _flat(model).clone()
    out["state"] = local_sgd.state_dict()["num_forced_syncs"]
    for batch in batches[3:]:
        _train_step(model, opt, batch)
    out["final"] = _flat(model).clone()
    local_sgd.close()
    return out


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {
        "average": _overlapped(rank, outer=False),
        "average_ref": _reference(rank, outer=False),
        "nesterov": _overlapped(rank, outer=True),
        "nesterov_ref": _reference(rank, outer=True),
        "uniform8": _overlapped(rank, outer=False, codec="uniform"),
        "sync": _sync_worker(rank),
    }
    write_rank_result(out, rank, res, "overlap_rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    spawn(_worker, free_port(), str(out), nprocs=2, timeout_s=300)
    return rank_results(out, 2, "overlap_rank{rank}.pt")


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_overlapped_update_matches_the_written_out_reference(results, outer):
    for r in results:
        assert len(r[outer]["trace"]) == STEPS
        for step, (got, want) in enumerate(zip(r[outer]["trace"], r[f"{outer}_ref"]), start=1):
            assert torch.equal(got, want), f"{outer}: rank parameters differ from the reference after step {step}"
        assert r[outer]["num_syncs"] == 4


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_replicas_differ_while_an_average_is_in_flight_and_end_equal(results, outer):
    r0, r1 = (r[outer] for r in results)
    assert r0["pending"] == [False, True, True, True, True, True, False]
    # at step 2 the inline schedule would have averaged; here each rank keeps its own parameters
    assert not torch.equal(r0["trace"][1], r1["trace"][1])
    # after the first correction (step 4) each replica holds the common average plus its own progress
    assert not torch.equal(r0["trace"][3], r1["trace"][3])
    assert torch.equal(r0["trace"][-1], r1["trace"][-1])  # the last sync is exact


def test_quantized_overlap_ends_equal_and_close_to_fp32(results):
    r0, r1 = (r["uniform8"] for r in results)
    assert torch.equal(r0["trace"][-1], r1["trace"][-1])
    # 4 averages, each two 8-bit stochastic-rounding stages off by under one unit of a bucket's range / 255, the
    # range of a 2-step delta being under ~0.2 here (lr 0.1): <= 8 * 0.2 / 255 ~ 6e-3, plus what 7 steps make of it
    diff = (r0["trace"][-1] - results[0]["average"]["trace"][-1]).abs().max().item()
    assert 0 < diff < 1e-2


def test_sync_applies_the_average_in_flight_then_averages_exactly(results):
    s0, s1 = (r["sync"] for r in results)
    assert s0["pending_before"] and s0["state_dict_refused"]
    assert s0["synced"] and not s0["pending_after"]
    assert s0["state"] == 1
    assert torch.equal(s0["params"], s1["params"])
    assert torch.equal(s0["final"], s1["final"])
