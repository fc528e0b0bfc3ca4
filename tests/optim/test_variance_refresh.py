"""The periodic variance refresh of OneBitAdam after the freeze (``optim.variance_refresh``).

Single process: the refreshed v̂ equals β2^K v̂ + (1-β2^K) · mean g² computed directly from the gradients of the
window, within the bound of the window's stochastically rounded bf16 sum (``_sr_bound``); the rounding is unbiased
where round-to-nearest would stall; nothing moves between refreshes; ``variance_refresh=0`` keeps v̂ as frozen; the window sums survive a
``rank_state_dict`` round trip mid-window and the resumed run ends bit-identical. Two gloo processes: each rank's
own gradients differ, and the refreshed v̂ on both ranks is the direct mean over ranks and window (through bf16),
with one all-reduce per refresh under the ledger tag "variance".
"""

from __future__ import annotations

import copy

import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.optim import OneBitAdam
from lightning_qcomm.optim.onebit_adam_config import OneBitAdamConfig

FREEZE, K, BETA2 = 3, 4, 0.99
U = 2.0**-7  # bf16 (8 significant bits): one place of y is at most 2^-7 |y|
FP32 = 2.0**-21  # a few fp32 roundings of the blend (2^-24 each), relative to the result


def _sr_bound(squares: list[torch.Tensor]) -> torch.Tensor:
    """|ã_K - S_K| for the window sum ã_k = SR(ã_(k-1) + x_k), x_k >= 0, S_k = x_1 + .. + x_k: each rounding moves
    y_k = ã_(k-1) + x_k by less than one place, < 2^-7 y_k, and ã_(k-1) <= (1+2^-7)^(k-1) S_(k-1), so
    |ã_K - S_K| < 2^-7 Σ_k (1+2^-7)^(k-1) S_k."""
    bound, partial = torch.zeros_like(squares[0]), torch.zeros_like(squares[0])
    for k, x in enumerate(squares):
        partial = partial + x
        bound = bound + U * (1 + U) ** k * partial
    return bound


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(model: torch.nn.Module, step: int, rank: int = 0) -> None:
    """Deterministic per-(step, rank) gradients (no autograd: the test controls exactly what enters g²)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * (1 + step % 3)


def _run(model, opt, steps, start=0, rank=0, record=None):
    for t in range(start, steps):
        _grads(model, t, rank)
        if record is not None:
            record.append([p.grad.clone() for p in model.parameters()])
        opt.step()


def test_refresh_equals_the_direct_blend_and_nothing_moves_between_refreshes():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, betas=(0.9, BETA2), freeze_step=FREEZE, variance_refresh=K)
    _run(model, opt, FREEZE)
    params = list(model.parameters())
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    window: list[list[torch.Tensor]] = []
    _run(model, opt, FREEZE + K - 1, start=FREEZE, record=window)
    for p, v in zip(params, frozen):  # inside the window v̂ stays as frozen
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
    _run(model, opt, FREEZE + K, start=FREEZE + K - 1, record=window)
    decay = BETA2**K
    for i, (p, v) in enumerate(zip(params, frozen)):
        squares = [w[i] ** 2 for w in window]
        expected = decay * v + (1 - decay) * torch.stack(squares).mean(0)
        tol = (1 - decay) / K * _sr_bound(squares) + FP32 * expected
        assert ((opt.state[p]["exp_avg_sq"] - expected).abs() <= tol).all()
    assert all(not s.any() for s in opt.variance_refresh.sums.values())  # the next window starts at zero


def test_zero_keeps_the_variance_frozen():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, variance_refresh=0)
    _run(model, opt, FREEZE)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    _run(model, opt, FREEZE + 3 * K, start=FREEZE)
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(model.parameters(), frozen))
    assert opt.variance_refresh.sums == {}


def test_l2_weight_decay_enters_the_window_as_adams_v_sees_it():
    """Adam with L2 (``decoupled_weight_decay=False``): v sees g + λp, and so does the refresh (p as the step left
    it: the window is summed after the update)."""
    model = _model()
    wd = 0.5
    opt = OneBitAdam(
        model.parameters(), lr=1e-2, betas=(0.9, BETA2), weight_decay=wd, decoupled_weight_decay=False,
        freeze_step=FREEZE, variance_refresh=1,
    )  # fmt: skip
    _run(model, opt, FREEZE)
    params = list(model.parameters())
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    _grads(model, FREEZE)
    g = [p.grad.clone() for p in params]
    opt.step()
    for p, v, gi, p0 in zip(params, frozen, g, [p.detach().clone() for p in params]):
        square = (gi + wd * p0) ** 2
        expected = BETA2 * v + (1 - BETA2) * square
        tol = (1 - BETA2) * _sr_bound([square]) + FP32 * expected  # one rounding of the window sum
        assert ((opt.state[p]["exp_avg_sq"] - expected).abs() <= tol).all()
        # without λp the window would miss (by far more than the bound) where λp matters
        assert ((opt.state[p]["exp_avg_sq"] - BETA2 * v - (1 - BETA2) * gi**2).abs() > tol).any()


def test_window_sums_survive_a_rank_state_round_trip_and_the_resumed_run_is_exact():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, variance_refresh=K)
    _run(model, opt, FREEZE + K // 2)  # mid-window
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt, saved_rank = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.rank_state_dict())
    assert any(s is not None and s.any() for s in saved_rank["variance_window"])
    _run(model, opt, FREEZE + 2 * K + 1, start=FREEZE + K // 2)

    resumed = _model(seed=7)
    resumed.load_state_dict(saved_model)
    opt2 = OneBitAdam(resumed.parameters(), lr=1e-2, freeze_step=FREEZE, variance_refresh=K)
    opt2.load_state_dict(saved_opt)
    opt2.load_rank_state_dict(saved_rank)
    _run(resumed, opt2, FREEZE + 2 * K + 1, start=FREEZE + K // 2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])

    # without the rank state the window restarts at zero, and the run differs
    resumed3 = _model(seed=7)
    resumed3.load_state_dict(saved_model)
    opt3 = OneBitAdam(resumed3.parameters(), lr=1e-2, freeze_step=FREEZE, variance_refresh=K)
    opt3.load_state_dict(saved_opt)
    _run(resumed3, opt3, FREEZE + 2 * K + 1, start=FREEZE + K // 2)
    assert not all(torch.equal(opt.state[p]["exp_avg_sq"], opt3.state[q]["exp_avg_sq"])
                   for p, q in zip(model.parameters(), resumed3.parameters()))  # fmt: skip


def test_the_window_sum_is_unbiased_where_rounding_to_nearest_stalls():
    """a = 1, then 127 terms of 2^-10 (an eighth of a bf16 place at 1): a bf16 sum rounded to nearest stays at 1
    (each term is below half a place), 0.124 short. Stochastic rounding keeps E[ã] = S: over 4096 coordinates
    (independent bits) the mean error has a standard deviation below √127 · 2^-7/2 / √4096 = 6.9e-4; 5 of them
    bound it. And the window is deterministic per (step, rank): the same steps give the same bits."""
    from lightning_qcomm.optim.variance_refresh import VarianceRefresh

    p = torch.nn.Parameter(torch.zeros(4096))
    groups = [{"params": [p], "weight_decay": 0.0, "decoupled_weight_decay": True}]
    state = {p: {"exp_avg": torch.zeros(4096), "exp_avg_sq": torch.zeros(4096)}}
    sums = []
    for _ in range(2):
        refresh = VarianceRefresh(128, bucket_numel=1 << 20)
        for step in range(128):
            p.grad = torch.full((4096,), 1.0 if step == 0 else 2.0**-5)
            refresh.accumulate(groups, state, step=step, rank=0)
        sums.append(refresh.sums[p].float())
    exact = 1 + 127 * 2.0**-10
    assert abs(sums[0].mean().item() - exact) <= 5 * 127**0.5 * 2.0**-8 / 64
    assert sums[0].max() > 1  # moved at all, per coordinate
    assert torch.equal(sums[0], sums[1])


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "128"])
def test_bad_variance_refresh_raises_naming_class_argument_value_and_allowed(value):
    with pytest.raises(ValueError, match=r"OneBitAdam\(variance_refresh=.*allowed 0 .* an int >= 1"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], variance_refresh=value)
    with pytest.raises(ValueError, match=r"OneBitAdam\(variance_refresh="):
        OneBitAdamConfig(variance_refresh=value)


def test_defaults_refresh_every_128_steps_with_a_scale_per_block_of_256():
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(2))])
    assert (opt.config.variance_refresh, opt.config.scale_block) == (128, 256)


# ---------------------------------------------------------------------------------------------------- two ranks
def _two_rank_worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()  # the same start on both ranks
        opt = OneBitAdam(
            model.parameters(), lr=1e-2, betas=(0.9, BETA2), freeze_step=FREEZE, variance_refresh=K, overlap=False
        )
        for t in range(FREEZE):  # warm-up: the averaged gradient, as DDP would give it
            _grads(model, t, rank)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(2)
            opt.step()
        frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        ledger = CommLedger()
        set_ledger(ledger)
        window: list[list[torch.Tensor]] = []
        _run(model, opt, FREEZE + K, start=FREEZE, rank=rank, record=window)
        set_ledger(None)
        write_rank_result(
            outdir,
            rank,
            {
                "frozen": frozen,
                "window": window,
                "refreshed": [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
                "variance_calls": ledger.cumulative[("all_reduce", "variance")].calls,
                "variance_bytes": ledger.cumulative[("all_reduce", "variance")].payload_bytes,
                "d": sum(p.numel() for p in model.parameters()),
            },
            "rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_refresh_with_the_mean_over_ranks_and_window(tmp_path):
    spawn(_two_rank_worker, free_port(), str(tmp_path), nprocs=2)
    r0, r1 = rank_results(str(tmp_path), 2, "rank{rank}.pt")
    decay = BETA2**K
    for i in range(len(r0["frozen"])):
        assert torch.equal(r0["frozen"][i], r1["frozen"][i])
        assert not torch.equal(r0["window"][0][i], r1["window"][0][i])  # each rank's own gradients
        squares = [[w[i] ** 2 for w in r["window"]] for r in (r0, r1)]
        total = sum(torch.stack(sq).sum(0) for sq in squares)
        exact = decay * r0["frozen"][i] + (1 - decay) * total / (2 * K)
        # each rank's window sum within _sr_bound; the wire's bf16 sum of the two rounds once more (to nearest:
        # half a place, 2^-8 of what it sums)
        held = sum(_sr_bound(sq) for sq in squares)
        tol = (1 - decay) / (2 * K) * (held + 2.0**-8 * (total + held)) + FP32 * exact
        assert ((r0["refreshed"][i] - exact).abs() <= tol).all()
        assert torch.equal(r0["refreshed"][i], r1["refreshed"][i])
    assert r0["variance_calls"] == 1  # one all-reduce per refresh (the model fits one piece)
    assert r0["variance_bytes"] == 2 * r0["d"]  # bf16: 16 bits per element
