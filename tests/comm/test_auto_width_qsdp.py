"""``QSDPStrategy(weight_bits="auto", grad_bits="auto")``: the widths chosen by timed trial steps, deterministically
given the measured step times and alike on every rank (``comm.auto_trial``, as QuantDDP's).

No timing in any assertion: the trial's clock is injected. Bad settings are refused naming the argument, the value
and what is allowed; YAML reaches the config. On 2 gloo ranks (one spawn): a Trainer whose ranks "measure"
differently runs, at every step, the width the schedule and the agreed (slowest) figures imply, for weights and
gradients, as the ledger's bytes per step show against fixed-width runs; a resumed run continues the choice; with
the real clock both ranks choose alike; Fabric trials the "auto" direction and keeps the fixed one. One rank:
32, no trial.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState
from lightning_qcomm.adapters.fsdp2.shim import installed_comms
from lightning_qcomm.comm import auto_trial
from lightning_qcomm.comm.auto_trial import UNCOMPRESSED
from lightning_qcomm.parallel.qsdp import auto_codecs, new_trial
from lightning_qcomm.parallel.qsdp_config import QSDPConfig


def test_one_rank_runs_32_bits_without_a_trial():
    state = QSDPCommState()
    weights, grads = auto_codecs(QSDPConfig(bits="auto"), state, 1, "test")
    assert weights == {UNCOMPRESSED: None} and grads == {UNCOMPRESSED: None}
    assert state.trial.chosen == UNCOMPRESSED and state.trial.candidates == (UNCOMPRESSED,)
    assert new_trial(QSDPConfig(bits="auto", min_bits=2), 4, 7, "test").candidates == (32, 8, 4, 2)


def test_the_fixed_direction_keeps_its_codec_at_every_width():
    state = QSDPCommState()
    weights, grads = auto_codecs(QSDPConfig(weight_bits="auto", grad_bits=8), state, 2, "test")
    assert {b: None if c is None else c.bits for b, c in weights.items()} == {32: None, 8: 8, 4: 4}
    assert grads.bits == 8  # one codec, not one per width
    assert state.trial.candidates == (32, 8, 4) and state.trial.chosen is None


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"min_bits": 3, "bits": "auto"}, ValueError, r"min_bits=3\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": 16, "bits": "auto"}, ValueError, r"min_bits=16\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": 4.0, "bits": "auto"}, ValueError, r"min_bits=4.0\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": True, "bits": "auto"}, ValueError, r"min_bits=True\) is not allowed"),
        ({"weight_bits": "Auto"}, ValueError, r"weight_bits='Auto'\) is not allowed; allowed: an int, 'auto' or None"),
        ({"grad_bits": "8"}, ValueError, r"grad_bits='8'\) is not allowed; allowed: an int, 'auto' or None"),
        ({"bits": 8.0}, TypeError, r"bits=8.0\) is not allowed; allowed: an int, 'auto' or None"),
        ({"weight_bits": "auto", "weight_codec": "none"}, ValueError, r"weight_codec='none'.*allowed: .*uniform"),
        ({"grad_bits": "auto", "grad_codec": "fp8_e4m3"}, ValueError, r"grad_codec='fp8_e4m3'.*\(8, 4\).*allowed"),
        (
            {"grad_bits": "auto", "grad_codec": "lz4"},
            ValueError,
            r"grad_codec='lz4'\) cannot be used.*allowed: uniform",
        ),
        ({"weight_bits": "auto", "hsdp": True}, ValueError, r"hsdp=True, weight_bits='auto'\) is not supported"),
        ({"bits": "auto", "quantize_master": True}, ValueError, r"quantize_master=True, weight_bits='auto'"),
    ],
)
def test_bad_auto_settings_are_refused_naming_argument_value_and_allowed(kwargs, error, match):
    from lightning_qcomm import QSDPFabricStrategy, QSDPStrategy

    with pytest.raises(error, match=match):
        QSDPConfig(**kwargs)
    for owner in (QSDPStrategy, QSDPFabricStrategy):  # the class the user called is named
        with pytest.raises(error, match=f"{owner.__name__}\\("):
            owner(**kwargs)


def test_auto_forms_resolve_and_report_what_is_left():
    both = QSDPConfig(bits="auto", min_bits=2)
    assert (both.weight_bits, both.grad_bits, both.has_auto) == ("auto", "auto", True)
    mixed = QSDPConfig(bits=8, grad_bits="auto")  # bits is the default of the direction not given
    assert (mixed.weight_bits, mixed.grad_bits, mixed.auto_weights, mixed.auto_grads) == (8, "auto", False, True)
    assert QSDPConfig(grad_bits="auto", grad_codec="fp8_e4m3", min_bits=8).auto_grads  # 8 bits is all it needs
    with pytest.raises(ValueError, match="weight_bits='auto' has no single codec"):
        both.build_weight_codec()
    resolved = both.resolve_auto(32, 4)
    assert (resolved.weight_bits, resolved.grad_bits, resolved.has_auto, resolved.min_bits) == (32, 4, False, 4)
    assert resolved.build_weight_codec() is None and resolved.build_grad_codec().bits == 4
    assert mixed.resolve_auto(None, 2).weight_bits == 8
    with pytest.raises(ValueError, match="leaves an 'auto' width"):
        both.resolve_auto(8, None)
    with pytest.warns(UserWarning, match=r"min_bits=2\) has no effect"):
        QSDPConfig(bits=8, min_bits=2)


def test_yaml_through_lightning_cli(tmp_path, monkeypatch):
    import yaml

    from lightning_qcomm.cli import make_cli

    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    strategy = {"class_path": "QSDPStrategy", "init_args": {"weight_bits": "auto", "grad_bits": 8, "min_bits": 2}}
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy, "logger": False},
        "model": "lightning_qcomm.demo.ByteGPT",
        "data": "lightning_qcomm.demo.StdlibBytes",
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = make_cli(["--config", str(path)], run=False).trainer.strategy.config
    assert (config.weight_bits, config.grad_bits, config.min_bits) == ("auto", 8, 2)


# ---------------------------------------------------------------------------------------------- 2 ranks
STEPS = 14  # trial: 3 candidates x (1 untimed + 3 timed) = 12 steps, then 2 at the choice
# per rank, the step time at each width: alone rank 0 would choose 4 bits, rank 1 8 bits; agreed (max): 8 bits
FAKE = {0: {32: 1.0, 8: 0.5, 4: 0.45}, 1: {32: 1.0, 8: 0.5, 4: 0.9}}
TAGS = ("weights", "grads")


def _fit(strategy, max_steps: int = STEPS, save: str | None = None, resume: str | None = None) -> dict:
    import lightning.pytorch as pl
    from _siblings import from_test_file

    GPTModule = from_test_file("strategies/test_qsdp", "GPTModule")

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    ledger = CommLedger()
    set_ledger(ledger)
    per_step, widths, seen = [], [], {t: 0.0 for t in TAGS}

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            trial = strategy.comm_state.trial
            widths.append(None if trial is None else trial.width(strategy.comm_state.step))

        def on_train_batch_end(self, trainer, *args) -> None:
            totals = ledger.summarize(ledger.cumulative, by="tag")
            now = {t: totals[t].wire_bytes if t in totals else 0.0 for t in TAGS}
            per_step.append([now[t] - seen[t] for t in TAGS])
            seen.update(now)

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
    trainer.fit(GPTModule(), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    set_ledger(None)
    trial = strategy.comm_state.trial
    out = {"bytes": per_step, "widths": widths, "bits": [strategy.weight_bits, strategy.grad_bits]}
    if trial is not None:
        out.update(chosen=trial.chosen, decided_at=trial.decided_at, figures=trial.figures)
    return out


def _lightning(rank: int, out: str, result: dict) -> None:
    from _siblings import from_test_file
    from lightning.fabric import Fabric

    TinyGPT = from_test_file("strategies/test_qsdp", "TinyGPT")

    from lightning_qcomm import QSDPFabricStrategy, QSDPStrategy

    state = {"t": 0.0, "strategy": None}

    def fake_clock() -> float:  # each reading adds the duration of the step that just ended, at its width
        comm = state["strategy"].comm_state
        state["t"] += FAKE[rank][comm.trial.width(comm.step)]
        return state["t"]

    def auto() -> QSDPStrategy:
        return QSDPStrategy(bits="auto", min_bits=4, overlap_comm=False)

    real_time = auto_trial.time
    auto_trial.time = types.SimpleNamespace(perf_counter=fake_clock)
    ckpt = os.path.join(out, "qsdp_auto_ckpt")
    state["strategy"] = auto()
    result["fake"] = _fit(state["strategy"], save=ckpt)
    state["strategy"] = auto()  # resumed: the checkpointed choice continues (a new trial would run 32 bits)
    result["resumed"] = _fit(state["strategy"], STEPS + 2, resume=ckpt)
    auto_trial.time = real_time
    result["real"] = _fit(auto())
    result["fixed"] = {b: _fit(QSDPStrategy(bits=b, overlap_comm=False))["bytes"] for b in (32, 8, 4)}

    fabric = Fabric(accelerator="cpu", devices=2, strategy=QSDPFabricStrategy(weight_bits="auto", grad_bits=8))
    fabric.launch()
    fabric.setup_module(TinyGPT())
    comms = installed_comms(fabric.strategy.qsdp.modules[0])
    trial = fabric.strategy.comm_state.trial
    result["fabric"] = {
        "candidates": list(trial.candidates),
        "installed": [getattr(c.codec, "bits", None) for c in comms],
        "bits": [fabric.strategy.config.weight_bits, fabric.strategy.config.grad_bits],
    }


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(lightning_env(rank, 2, port))
    torch.set_num_threads(1)
    result: dict = {}
    _lightning(rank, out, result)
    write_rank_result(out, rank, result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_width_qsdp")
    spawn(_worker, free_port(), str(out), nprocs=2)
    return rank_results(out, 2)


def test_ranks_agree_on_the_slowest_figures_and_choose_alike(runs):
    for r in runs:
        assert r["fake"]["figures"] == pytest.approx({"32": 1.0, "8": 0.5, "4": 0.9})  # rank 1's slower 4 bits
        assert (r["fake"]["chosen"], r["fake"]["bits"]) == (8, [8, 8])
    assert runs[0]["real"]["chosen"] == runs[1]["real"]["chosen"] in (32, 8, 4)
    assert runs[0]["real"]["figures"] == runs[1]["real"]["figures"]


def test_every_step_sends_the_bytes_of_the_width_it_ran(runs):
    """Weights and gradients: the ledger's bytes per step equal a fixed-width run's at that step's width."""
    for r in runs:
        widths = r["fake"]["widths"]
        assert widths == [32] * 4 + [8] * 4 + [4] * 4 + [8] * 2
        fixed = {int(b): v for b, v in r["fixed"].items()}
        assert r["fake"]["bytes"] == [fixed[b][i] for i, b in enumerate(widths)]
        for tag in range(len(TAGS)):
            assert fixed[32][1][tag] > fixed[8][1][tag] > fixed[4][1][tag] > 0  # told apart by their bytes


def test_a_resumed_run_continues_the_checkpointed_choice(runs):
    for r in runs:
        resumed = r["resumed"]
        assert (resumed["chosen"], resumed["decided_at"], resumed["widths"]) == (8, 12, [8, 8])
        assert resumed["bytes"] == r["fake"]["bytes"][-2:]


def test_fabric_trials_the_auto_direction_and_keeps_the_fixed_one(runs):
    for r in runs:
        assert r["fabric"] == {"candidates": [32, 8, 4], "installed": [None, 8], "bits": ["auto", 8]}
