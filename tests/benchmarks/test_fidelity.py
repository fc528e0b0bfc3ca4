"""Smoke tests of ``benchmarks/fidelity.py`` (the fidelity-over-a-full-run benchmark) so it can't rot.

One module-scoped pair of real runs (``--smoke``: a 30k-parameter byte GPT, 30 steps, 2 gloo ranks): first
``--methods qddp_uniform8`` alone (its baseline must be added), then the default method set with the same
name, which must resume: skip the two finished configurations and run the rest. The JSON, markdown and plot
are then checked for structure, every method's validation loss for being finite and below its step-0 value,
and the pairing of the seeds (DDP fp32 and FSDP2 fp32 compute the same update from the same weights and data
order). The report's arithmetic and the pure helpers are checked on synthetic numbers. No timing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import fidelity  # noqa: E402
from benchmarks.fidelity_methods import METHOD_BY_NAME, METHODS, RunConfig, phase_steps  # noqa: E402
from benchmarks.fidelity_report import run_key, summarize  # noqa: E402

DEFAULT = [m.name for m in METHODS if m.in_default]


def _fidelity(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "benchmarks.fidelity", "--smoke", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    first = _fidelity("--methods", "qddp_uniform8", "--out", str(out))
    partial = json.loads((out / "fidelity_smoke.json").read_text())
    second = _fidelity("--out", str(out))
    data = json.loads((out / "fidelity_smoke.json").read_text())
    return {"out": out, "partial": partial, "data": data, "logs": (first.stdout, second.stdout)}


@pytest.mark.slow
def test_subset_adds_its_baseline_and_a_rerun_resumes(smoke):
    partial, data = smoke["partial"], smoke["data"]
    assert set(partial["runs"]) == {"ddp_fp32/seed0", "qddp_uniform8/seed0"}
    assert "2 already in" in smoke["logs"][1]
    for key, run in partial["runs"].items():
        assert data["runs"][key] == run  # skipped, not trained again (its timings would differ)
    assert data["meta"]["config"] == partial["meta"]["config"] and len(data["meta"]["sessions"]) == 2


@pytest.mark.slow
def test_every_method_trains_and_its_validation_loss_drops(smoke):
    data = smoke["data"]
    assert set(data["runs"]) == {run_key(m, 0) for m in DEFAULT} and data["errors"] == {}
    for key, run in data["runs"].items():
        assert run["eval_steps"] == [0, 10, 20, 30], key
        assert all(math.isfinite(v) for v in run["val_loss"]), key
        assert all(math.isfinite(v) for v in run["train_loss"][1:]), key
        # step 0 is the untrained model: every method's held-out loss must end well below it
        assert run["val_loss"][-1] < run["val_loss"][0] - 0.5, (key, run["val_loss"])
        assert run["wire_bytes_per_step"] > 0 and run["step_median_s"] > 0, key
    runs = data["runs"]
    # same seed -> same initial weights: the unquantized forwards see the same step-0 loss ...
    assert runs["ddp_fp32/seed0"]["val_loss"][0] == pytest.approx(runs["qddp_uniform8/seed0"]["val_loss"][0], abs=1e-6)
    # ... and the same data order: FSDP2 fp32 and DDP fp32 compute the same updates
    assert runs["fsdp2/seed0"]["val_loss"] == pytest.approx(runs["ddp_fp32/seed0"]["val_loss"], rel=1e-4)
    # Local SGD really ran locally (syncs every few steps, not every step)
    assert 1 <= runs["localsgd_qsr/seed0"]["num_syncs"] < 30 // 2


@pytest.mark.slow
def test_markdown_table_and_plot(smoke):
    out, data = smoke["out"], smoke["data"]
    md = (out / "fidelity_smoke.md").read_text()
    assert "python -m benchmarks.fidelity --smoke" in md and "Not run yet" not in md
    rows = summarize(data)
    for name in DEFAULT:
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {name} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 11, line
        method = METHOD_BY_NAME[name]
        if method.goal_pct is not None:
            assert cells[8] == ("**pass**" if rows[name]["passed"] else "**FAIL**")
            assert cells[5] == f"{rows[name]['gap_pct']:+.2f}%"
        else:
            assert cells[8] == "—"
    assert (out / "fidelity_smoke.png").stat().st_size > 0
    # the report can be rebuilt from the JSON alone
    again = out / "again"
    assert fidelity.main(["--render", str(out / "fidelity_smoke.json"), "--out", str(again)]) == 0
    assert (again / "fidelity_smoke.md").read_text() == md


def _synthetic_run(method: str, seed: int, final: float) -> dict:
    return {"method": method, "seed": seed, "eval_steps": [0, 10], "val_loss": [5.5, final], "step_median_s": 0.01,
            "wire_bytes_per_step": 100.0, "eval_s": 0.1, "fit_s": 1.0}  # fmt: skip


def test_summary_gap_pass_and_pairing():
    runs = {}
    for seed, (base, q8) in enumerate([(2.0, 2.03), (2.2, 2.2)]):
        runs[run_key("ddp_fp32", seed)] = _synthetic_run("ddp_fp32", seed, base)
        runs[run_key("qddp_uniform8", seed)] = _synthetic_run("qddp_uniform8", seed, q8)
    runs[run_key("qddp_nuqsgd4", 0)] = _synthetic_run("qddp_nuqsgd4", 0, 2.05)
    runs[run_key("localsgd_qsr", 5)] = _synthetic_run("localsgd_qsr", 5, 1.0)  # no baseline for seed 5
    rows = summarize({"runs": runs})
    q8 = rows["qddp_uniform8"]
    assert q8["gap_pct"] == pytest.approx(100 * (2.115 - 2.1) / 2.1)  # 0.714% <= 1%
    assert q8["passed"] is True and q8["final_std"] == pytest.approx(math.sqrt(2) * 0.085)
    assert q8["paired_gaps_pct"] == pytest.approx([1.5, 0.0])
    # one seed is compared with the baseline's same seed, not with the baseline's mean over seeds
    assert rows["qddp_nuqsgd4"]["gap_pct"] == pytest.approx(2.5) and rows["qddp_nuqsgd4"]["passed"] is False
    assert rows["localsgd_qsr"]["gap_pct"] is None and rows["localsgd_qsr"]["passed"] is None
    assert rows["ddp_fp32"]["baseline"] is None and "fsdp2" not in rows


def test_methods_schedule_and_phases():
    assert fidelity.select_methods("qsdp_w8g8,onebit_adam") == ["ddp_fp32", "fsdp2", "qsdp_w8g8", "onebit_adam"]
    assert fidelity.select_methods("default") == DEFAULT and "qsdp_w4g4" in fidelity.select_methods("all")
    with pytest.raises(ValueError, match="nope"):
        fidelity.select_methods("ddp_fp32,nope")
    sched = fidelity.schedule(["ddp_fp32", "qddp_fp8_e4m3", "qddp_uniform8"], 3)
    assert sched == [("ddp_fp32", 0), ("qddp_fp8_e4m3", 0), ("qddp_uniform8", 0)] + [
        (m, s) for s in (1, 2) for m in ("ddp_fp32", "qddp_uniform8")
    ]
    every = fidelity.schedule(["ddp_fp32", "qddp_fp8_e4m3"], 2, all_seeds=True)  # --all-seeds
    assert every == [("ddp_fp32", 0), ("qddp_fp8_e4m3", 0), ("ddp_fp32", 1), ("qddp_fp8_e4m3", 1)]
    for steps, warmup in ((2000, 100), (30, 3), (2001, 100), (50, 0)):
        cfg = RunConfig("fidelity", steps, 10, 4, 1e-3, warmup, 32, 16, 1000, 60.0)
        switch = phase_steps(cfg)["post_local_switch"]
        assert 0 <= switch <= warmup and (switch == 0 or (steps - 1 - switch) % 4 == 0)
        assert switch > warmup - 4 or switch == 0
    assert phase_steps(RunConfig("fidelity", 2000, 100, 4, 1e-3, 100, 32, 16, 1000, 60.0))["onebit_freeze"] == 300


def test_bad_arguments_are_rejected(capsys):
    for argv, word in ((["--steps", "25"], "multiple"), (["--methods", "nope"], "nope"), (["--val-windows", "3"], "2")):
        with pytest.raises(SystemExit):
            fidelity.parse_args(["--smoke", *argv])
        assert word in capsys.readouterr().err


def test_a_failed_configuration_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    """The pair stops on a configuration: it is recorded under ``errors`` and a fresh pair runs the rest."""
    import benchmarks.fidelity_worker as worker

    calls = []

    def fake_run_pair(todo, cfg, json_path):
        calls.append(list(todo))
        data = json.loads(json_path.read_text())
        done = todo[:1] if len(calls) == 1 else todo  # the first pair dies on its second configuration
        for method, seed in done:
            data["runs"][run_key(method, seed)] = _synthetic_run(method, seed, 2.0)
        json_path.write_text(json.dumps(data))
        return "ProcessRaisedException: \n\nTraceback ...\nRuntimeError: boom\n" if len(calls) == 1 else None

    monkeypatch.setattr(worker, "run_pair", fake_run_pair)
    argv = ["--smoke", "--methods", "qddp_uniform8,qddp_nuqsgd4", "--out", str(tmp_path)]
    assert fidelity.main(argv) == 1
    assert calls == [[("ddp_fp32", 0), ("qddp_uniform8", 0), ("qddp_nuqsgd4", 0)], [("qddp_nuqsgd4", 0)]]
    data = json.loads((tmp_path / "fidelity_smoke.json").read_text())
    assert set(data["runs"]) == {"ddp_fp32/seed0", "qddp_nuqsgd4/seed0"} and list(data["errors"]) == [
        "qddp_uniform8/seed0"
    ]
    md = (tmp_path / "fidelity_smoke.md").read_text()
    assert "* `qddp_uniform8/seed0`: RuntimeError: boom" in md and "Not run yet: `qddp_uniform8/seed0`" in md
    # a rerun retries only the failed configuration
    assert fidelity.main(argv) == 0
    assert calls[2] == [("qddp_uniform8", 0)]
    assert json.loads((tmp_path / "fidelity_smoke.json").read_text())["errors"] == {}
