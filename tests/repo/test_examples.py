"""examples/: every ``--method`` trains on 2 CPU ranks with ``--accelerator cpu --devices 2``, as a user runs it.

* ``examples/gpt_char.py``, each method for 3 steps with a one-layer model, run as a real subprocess from a directory
  without configs/ (Lightning launches the second rank by re-running the script): the strategy and callbacks that
  trained are the ones the method names, the communication summary covers both ranks, and 1-bit Adam reaches its
  compressed phase.
* ``--strategy`` replaces a callback method's strategy (activation quantization on QuantDDP).
* ``examples/vision.py`` with a callback method, where scikit-learn (its data) is installed.
* The options themselves: the method table covers every method, ``--devices`` takes Lightning's string forms, and
  ``--freeze-step`` without 1-bit Adam warns that it has no effect.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY = ["--accelerator", "cpu", "--devices", "2", "--max-steps", "3", "--n-layer", "1", "--n-embd", "32"]
TINY += ["--batch-size", "4"]
EXPECTED = {  # method -> (strategy class, our callbacks in order)
    "ddp": ("DDPStrategy", "CommVolumeLogger"),
    "quant_ddp": ("QuantDDPStrategy", "CommVolumeLogger"),
    "qsdp": ("QSDPStrategy", "CommVolumeLogger"),
    "local_sgd": ("LocalSGDStrategy", "CommVolumeLogger"),
    "onebit_adam": ("DDPStrategy", "OneBitAdamCallback, CommVolumeLogger"),
    "activation_quant": ("DDPStrategy", "ActivationQuantization, CommVolumeLogger"),
}


def _methods_module():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import _methods
    finally:
        sys.path.remove(str(EXAMPLES))
    return _methods


def _run(script: str, args: list[str], cwd: Path) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_every_method_has_an_expected_run():
    assert set(_methods_module().METHODS) == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_gpt_char_method_trains_on_two_cpu_ranks(method, tmp_path):
    freeze = ["--freeze-step", "1"] if method == "onebit_adam" else []  # 1-bit Adam compresses from step 2
    out = _run("gpt_char.py", ["--method", method, *TINY, *freeze], tmp_path)
    strategy, callbacks = EXPECTED[method]
    assert f"trained with {strategy} + {callbacks} on 2 cpu process(es)" in out, out[-3000:]
    assert "lightning_qcomm communication summary: 2 rank(s), 3 optimizer steps" in out, out[-3000:]
    if method == "onebit_adam":
        assert "compressed since (1-bit momentum for 2 steps)" in out, out[-3000:]
    if method == "activation_quant":
        (metrics,) = tmp_path.glob("runs/gpt_char_activation_quant/version_*/metrics.csv")
        assert "actq/ratio" in metrics.read_text().splitlines()[0]


@pytest.mark.slow
def test_strategy_replaces_the_methods_strategy(tmp_path):
    out = _run("gpt_char.py", ["--method", "activation_quant", *TINY, "--strategy", "quant_ddp_nuqsgd4"], tmp_path)
    assert "trained with QuantDDPStrategy + ActivationQuantization, CommVolumeLogger on 2 cpu" in out, out[-3000:]


@pytest.mark.slow
def test_vision_with_a_callback_method(tmp_path):
    pytest.importorskip("sklearn")
    args = ["--method", "onebit_adam", "--freeze-step", "1", "--accelerator", "cpu", "--devices", "2"]
    out = _run("vision.py", [*args, "--epochs", "1", "--max-steps", "3"], tmp_path)
    assert "trained with DDPStrategy + OneBitAdamCallback, CommVolumeLogger on 2 cpu process(es)" in out, out[-3000:]


def test_options_devices_forms_and_freeze_step_without_onebit_warns():
    methods = _methods_module()
    parser = argparse.ArgumentParser()
    methods.add_arguments(parser)
    assert parser.parse_args([]).accelerator == "auto"
    assert [parser.parse_args(["--devices", d]).devices for d in ("4", "auto", "0,1", "-1")] == [4, "auto", "0,1", -1]
    args = parser.parse_args(["--method", "qsdp", "--freeze-step", "5"])
    with pytest.warns(UserWarning, match="--freeze-step 5 has no effect with --method qsdp"):
        strategy, callbacks = methods.method_parts(args)
    assert strategy == "qsdp" and [type(cb).__name__ for cb in callbacks] == ["CommVolumeLogger"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--method", "powersgd"])
