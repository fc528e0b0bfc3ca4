"""``QuantDDPConfig(codec="auto")``: the width is chosen by timed trial steps, deterministically given the measured
step times and alike on every rank (``comm.auto_trial``).

No timing in any assertion: the trial's clock is injected. Unit tests: the schedule (32, then 8 .. ``min_bits``,
one untimed step each), the figure of a candidate (the minimum of its timed steps), the decision (the widest
width within the tolerance of the fastest), the agreed figures deciding rather than this rank's, the re-check,
the checkpointed state. On 2 gloo ranks a Trainer whose ranks "measure" differently runs, at every step, the width
the schedule and the agreed (slowest) figures imply, on both ranks, as the ledger's bytes per step show; with the
real clock the ranks end with one choice (QSDP's trial: ``test_auto_width_qsdp.py``).
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
from lightning_qcomm.comm import auto_trial
from lightning_qcomm.comm.auto_trial import UNCOMPRESSED, WidthTrial, candidate_widths, choose_measured


def _clock(durations):
    """A clock read once per ``step_done``: at the end of step k it reads durations[0] + ... + durations[k], so
    step k (k >= 1) lasted durations[k]."""
    readings = iter(torch.tensor(durations, dtype=torch.float64).cumsum(0).tolist())
    return lambda: next(readings)


def _run(trial: WidthTrial, steps: int, agree=lambda xs: xs) -> list[int]:
    widths = []
    for step in range(steps):
        widths.append(trial.width(step))
        trial.step_done(step, agree)
    return widths


def test_the_widest_width_within_the_tolerance_of_the_fastest_is_chosen():
    assert choose_measured({32: 0.100, 8: 0.099, 4: 0.120}) == 32  # 8-bit is 1% faster: not enough
    assert choose_measured({32: 0.300, 8: 0.150, 4: 0.120}) == 4
    assert choose_measured({32: 0.300, 8: 0.121, 4: 0.120}) == 8  # a near-tie goes to the wider width
    assert choose_measured({4: 0.5, 8: 0.5, 32: 0.7}) == 8  # whatever the order
    assert choose_measured({32: 1.0, 8: 0.9}, tolerance=0.2) == 32
    with pytest.raises(ValueError, match="empty"):
        choose_measured({})


def test_the_schedule_times_every_candidate_and_keeps_the_fastest():
    # per candidate: 1 untimed step, then 3 timed; the untimed step of 8 bits is made the fastest of all, so a
    # trial that counted it would choose 8
    durations = [9.0, 1.0, 1.1, 1.2] + [0.01, 0.8, 0.9, 0.7] + [5.0, 0.5, 0.6, 0.55] + [0.4] * 4
    trial = WidthTrial(candidate_widths(4), measured_steps=3, clock=_clock(durations))
    widths = _run(trial, 16)
    assert widths == [32] * 4 + [8] * 4 + [4] * 4 + [4] * 4
    assert trial.figures == pytest.approx({32: 1.0, 8: 0.7, 4: 0.5})  # the minimum of the timed steps
    assert (trial.chosen, trial.decided_at) == (4, 12)


def test_the_agreed_figures_decide_not_this_ranks():
    calls = []

    def agree(mine):  # the other rank measured 4 bits slower: the maximum is its figure
        calls.append(list(mine))
        return [max(a, b) for a, b in zip(mine, [1.0, 0.7, 0.95])]

    durations = [1.0] * 4 + [0.7] * 4 + [0.5] * 4 + [0.1] * 4
    trial = WidthTrial((32, 8, 4), measured_steps=3, clock=_clock(durations))
    widths = _run(trial, 16, agree)
    assert len(calls) == 1  # one all-reduce, at the trial's last step
    assert calls[0] == pytest.approx([1.0, 0.7, 0.5])  # alone this rank would choose 4
    assert trial.chosen == 8 and widths[12:] == [8] * 4


def test_a_fast_link_keeps_fp32_and_the_trial_starts_at_start():
    durations = [0.5] * 2 + [1.0] * 2 + [1.3] * 2 + [1.5] * 2 + [1.0] * 4
    trial = WidthTrial((32, 8, 4), measured_steps=1, start=2, clock=_clock(durations))
    widths = _run(trial, 12)
    assert widths[:2] == [32, 32]  # before ``start``: the first candidate, not timed
    assert widths[2:8] == [32, 32, 8, 8, 4, 4]
    assert trial.chosen == UNCOMPRESSED and widths[8:] == [32] * 4


def test_the_recheck_runs_the_trial_again_and_may_change_the_choice():
    # first trial: 8 bits fastest; after 4 steps at it the link got slower and 4 bits wins the second trial
    durations = [1.0, 1.0, 0.5, 0.5, 0.9, 0.9] + [0.5] * 4 + [2.0, 2.0, 1.0, 1.0, 0.6, 0.6] + [0.6] * 2
    trial = WidthTrial((32, 8, 4), measured_steps=1, recheck_steps=4, clock=_clock(durations))
    widths = _run(trial, 18)
    assert widths[:6] == [32, 32, 8, 8, 4, 4] and widths[6:10] == [8] * 4
    assert widths[10:16] == [32, 32, 8, 8, 4, 4] and widths[16:] == [4, 4]
    assert (trial.chosen, trial.decided_at) == (4, 16)


def test_one_candidate_is_chosen_without_a_trial():
    trial = WidthTrial((UNCOMPRESSED,), clock=lambda: pytest.fail("nothing is timed"))
    assert trial.chosen == UNCOMPRESSED and trial.width(0) == UNCOMPRESSED


def test_a_checkpointed_choice_continues_and_a_missing_one_starts_a_trial():
    trial = WidthTrial((32, 8, 4), measured_steps=1, clock=_clock([1.0, 1.0, 0.5, 0.5, 0.9, 0.9]))
    _run(trial, 6)
    resumed = WidthTrial((32, 8, 4), measured_steps=1, clock=lambda: pytest.fail("nothing is timed"))
    resumed.load_state_dict(trial.state_dict(), step=40)
    assert (resumed.chosen, resumed.decided_at, resumed.figures) == (8, 6, trial.figures)
    assert resumed.width(40) == 8
    fresh = WidthTrial((32, 8, 4), measured_steps=1)
    fresh.load_state_dict(None, step=40)  # a checkpoint of a fixed width: a trial from step 40
    assert fresh.chosen is None and [fresh.width(s) for s in (40, 42, 44)] == [32, 8, 4]


def test_a_resumed_hook_without_a_choice_trials_after_the_warm_up():
    """A checkpoint with no choice (one written mid-trial, or on another world size) starts a new trial, but not
    before ``start_step``: steps before it are uncompressed whatever their width, so timing them compares nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        p = torch.nn.Parameter(torch.zeros(4))
        state = QuantDDPHookState(QuantDDPConfig(codec="auto", start_step=10), {p: "p"})
        state.load_state_dict({"step": 3})
        assert (state.trial.start, state.trial.chosen) == (10, None)
        state.load_state_dict({"step": 30})
        assert state.trial.start == 30
    finally:
        dist.destroy_process_group()
    alone = WidthTrial((UNCOMPRESSED,))
    alone.load_state_dict(None, step=5)  # one candidate: nothing to try, even without a saved choice
    assert alone.chosen == UNCOMPRESSED


def test_a_32_bit_step_after_compressed_ones_sends_the_residual_exactly():
    """Error feedback under ``auto``: a compressed step leaves a residual e; when the width turns to 32, the next step
    sends g + e uncompressed (exact, so the residual becomes 0) instead of keeping e for the next compressed step,
    possibly 2000 steps later. On a fake process group the all-reduce leaves each rank's own buffer, averaged by N."""
    import torch.distributed as dist
    from _launch import FakeBucket
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState, quant_ddp_comm_hook

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        p = torch.nn.Parameter(torch.zeros(4096))
        state = QuantDDPHookState(QuantDDPConfig(codec="auto", error_feedback=True, min_quant_numel=0), {p: "p"})
        state.trial.load_state_dict({"chosen": 4, "decided_at": 0}, step=0)  # a compressed step first
        p.grad = torch.randn(4096, generator=torch.Generator().manual_seed(0))
        quant_ddp_comm_hook(state, FakeBucket(0, [p])).wait()
        state.next_step()
        residual = state.ef_state_dict()["p"].clone()
        assert residual.abs().sum() > 0
        state.trial.chosen = UNCOMPRESSED  # the re-check chose 32
        p.grad = torch.randn(4096, generator=torch.Generator().manual_seed(1))
        out = quant_ddp_comm_hook(state, FakeBucket(0, [p])).wait()
        state.next_step()
        reference = FakeBucket(0, [p]).buffer() + residual  # g + e
        fresh = QuantDDPHookState(QuantDDPConfig(codec="none", min_quant_numel=0), {p: "p"})
        p.grad = reference.clone()
        expected = quant_ddp_comm_hook(fresh, FakeBucket(0, [p])).wait()  # the plain average of g + e
        assert torch.equal(out, expected)
        assert state.ef_state_dict()["p"].abs().sum() == 0
    finally:
        dist.destroy_process_group()


def test_bad_settings_are_refused_and_settings_without_effect_warned():
    with pytest.raises(ValueError, match="min_bits=3.*allowed: 2, 4, 8"):
        candidate_widths(3)
    with pytest.raises(ValueError, match="min_bits=3"):
        QuantDDPConfig(codec="auto", min_bits=3)
    with pytest.raises(ValueError, match="'auto' chooses the width"):
        QuantDDPConfig(codec="auto", bits=8)
    with pytest.raises(ValueError, match="auto_trial_steps=0"):
        QuantDDPConfig(codec="auto", auto_trial_steps=0)
    with pytest.raises(ValueError, match="no single codec"):
        QuantDDPConfig(codec="auto").build_codec()
    assert QuantDDPConfig(codec="auto").resolve_auto(32).codec == "none"
    assert QuantDDPConfig(codec="auto").resolve_auto(4).build_codec().bits == 4
    from lightning_qcomm.adapters.ddp.config import warn_if_not_contractive

    with pytest.warns(UserWarning, match="auto_recheck_steps has no effect without codec='auto'"):
        warn_if_not_contractive(QuantDDPConfig(codec="uniform", bits=8, auto_recheck_steps=10), "test")


@pytest.mark.parametrize("value", [4.0, "4"])
def test_min_bits_of_another_type_is_a_type_error(value):
    """``min_bits`` must be an int: 4.0 or "4" is refused with a TypeError naming the argument and the allowed set."""
    with pytest.raises(TypeError, match=r"min_bits.*allowed: 2, 4, 8"):
        QuantDDPConfig(codec="auto", min_bits=value)


# ---------------------------------------------------------------------------------------------- 2 ranks
STEPS = 14  # trial: 3 candidates x (1 untimed + 3 timed) = 12 steps, then 2 at the choice
# per rank, the step time at each width: alone rank 0 would choose 4 bits, rank 1 8 bits; agreed (max): 8 bits
FAKE = {0: {32: 1.0, 8: 0.5, 4: 0.45}, 1: {32: 1.0, 8: 0.5, 4: 0.9}}


def _fit(strategy, max_steps: int = STEPS, save: str | None = None, resume: str | None = None) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    ledger = CommLedger()
    set_ledger(ledger)
    per_step, widths = [], []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            hook = strategy.hook_state
            widths.append(hook.config.bits if hook.trial is None else hook.trial.width(hook.step))

        def on_train_batch_end(self, trainer, *args) -> None:
            # the gradients' all-reduces only: the cross-rank check's all-gather runs once per width, not per fit,
            # and the trial's agreement ("control") once per trial
            total = sum(
                t.wire_bytes for (op, tag), t in ledger.cumulative.items() if (op, tag) == ("all_reduce", "grads")
            )
            per_step.append(total - sum(per_step))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[Record()],
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(BoringModel(), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    trial = strategy.hook_state.trial
    if trial is None:
        return {"bytes": per_step, "widths": widths}
    return {
        "chosen": trial.chosen,
        "decided_at": trial.decided_at,
        "figures": trial.figures,
        "bytes": per_step,
        "widths": widths,
    }


def _worker(rank: int, port: int, out: str) -> None:
    from lightning_qcomm import QuantDDPStrategy

    os.environ.update(lightning_env(rank, 2, port))
    torch.set_num_threads(1)
    result = {}
    # the fake clock: each reading adds the duration of the step that just ended, at the width that step ran
    state = {"t": 0.0, "strategy": None}

    def fake_clock() -> float:
        hook = state["strategy"].hook_state
        state["t"] += FAKE[rank][hook.trial.width(hook.step)]
        return state["t"]

    real_time = auto_trial.time
    auto_trial.time = types.SimpleNamespace(perf_counter=fake_clock)
    ckpt = os.path.join(out, "auto.ckpt")
    state["strategy"] = QuantDDPStrategy(codec="auto", min_bits=4, min_quant_numel=0)
    result["fake"] = _fit(state["strategy"], save=ckpt)
    # resumed: the checkpointed choice continues (a new trial would run 32 bits first)
    state["strategy"] = QuantDDPStrategy(codec="auto", min_bits=4, min_quant_numel=0)
    result["resumed"] = _fit(state["strategy"], STEPS + 2, resume=ckpt)
    auto_trial.time = real_time
    result["real"] = _fit(QuantDDPStrategy(codec="auto", min_bits=4, min_quant_numel=0))
    result["fixed"] = {b: _fit(QuantDDPStrategy(codec="uniform", bits=b, min_quant_numel=0))["bytes"] for b in (8, 4)}
    result["fixed"][32] = _fit(QuantDDPStrategy(codec="none", min_quant_numel=0))["bytes"]
    write_rank_result(out, rank, result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_width")
    spawn(_worker, free_port(), str(out), nprocs=2)
    return rank_results(out, 2)


def test_ranks_agree_on_the_slowest_figures_and_choose_alike(runs):
    for r in runs:
        assert r["fake"]["figures"] == pytest.approx({"32": 1.0, "8": 0.5, "4": 0.9})  # rank 1's slower 4 bits
        assert r["fake"]["chosen"] == 8
    assert runs[0]["real"]["chosen"] == runs[1]["real"]["chosen"] in (32, 8, 4)
    assert runs[0]["real"]["figures"] == runs[1]["real"]["figures"]


def test_every_step_sends_the_bytes_of_the_width_it_ran(runs):
    """The ledger's bytes per step equal a fixed-width run's at that step's width: the trial and the choice are
    what travels, not only what is reported."""
    for r in runs:
        widths = r["fake"]["widths"]
        assert widths == [32] * 4 + [8] * 4 + [4] * 4 + [8] * 2
        fixed = {int(b): v for b, v in r["fixed"].items()}
        assert r["fake"]["bytes"] == [fixed[b][i] for i, b in enumerate(widths)]
        assert fixed[32][0] > fixed[8][0] > fixed[4][0]  # the widths are told apart by their bytes


def test_a_resumed_run_continues_the_checkpointed_choice(runs):
    for r in runs:
        resumed = r["resumed"]
        assert (resumed["chosen"], resumed["decided_at"]) == (8, 12)
        assert resumed["widths"] == [8, 8]
        assert resumed["bytes"] == r["fake"]["bytes"][-2:]  # 8-bit steps
