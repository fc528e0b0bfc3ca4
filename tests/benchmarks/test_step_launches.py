"""``benchmarks/step_launches.py`` counts a training step's launches per method and names who launched them; this
checks the counting itself at a tiny width (GPT-2 small's 148 tensors at widths x 0.02, 2 fake ranks), in a fresh
process under Triton's interpreter (``tests/_helpers/_interpreted.py``). No figure is fixed here: the checks compare the
script's own counts with each other.

* A baseline counted twice gives the same row (the count is deterministic).
* Launches added to a step are counted and attributed: the DDP step plus three ``add_`` calls made in this file
  counts three more, all under this file's function, every other caller unchanged.
* Every method's row is complete (its callers add up to its torch launches and collectives, its Triton kernels to
  its Triton launches), its baseline has no launch from lightning_qcomm and the method has some.
* QuantDDP's hook replaces DDP's all-reduce and nothing else: the step's difference from DDP's is its launches from
  lightning_qcomm and its Triton kernels less DDP's all-reduce hook's, and every other caller's count is DDP's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCALE, WORLD = 0.02, 2
METHODS = ("uniform-8", "onebit-adam", "local-sgd", "local-sgd-period", "qsdp-w8g8", "actq-4")
EXTRA = 3


def _extra(x) -> None:
    for _ in range(EXTRA):
        x.add_(1.0)


def _worker() -> dict:
    import step_launches as sl
    import step_methods as sm
    import torch
    from launch_counts import cuda_path_on_cpu, mirrored_collectives

    def with_extra(model, tokens, scale, world):
        run = sm.ddp_hooked(model, tokens, scale, world)
        plain, x = run.step, torch.zeros(4)

        def step():
            plain()
            _extra(x)

        run.step = step
        return run

    report = {}
    with cuda_path_on_cpu() as log, mirrored_collectives():
        for name in ("ddp", "fsdp2", *METHODS):
            report[name] = sl.count_step(name, SCALE, WORLD, log)
        report["ddp again"] = sl.count_step("ddp", SCALE, WORLD, log)
        report["ddp+extra"] = sl.count_step("ddp", SCALE, WORLD, log, build=with_extra)
    report["baselines"] = {m: sl.METHODS[m][0] for m in METHODS}
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 900)


def _ours(row: dict) -> float:
    return sum(v for k, v in row["by_caller"].items() if k.startswith(("lightning_qcomm/", "Triton ")))


def test_a_baseline_equals_itself(report):
    assert report["ddp again"] == report["ddp"]


def test_added_launches_are_counted_and_attributed(report):
    base, extra = report["ddp"], report["ddp+extra"]
    assert extra["total"] - base["total"] == EXTRA
    assert extra["by_caller"].pop("test_step_launches.py:_extra") == EXTRA
    assert extra["by_caller"] == base["by_caller"]


@pytest.mark.parametrize("method", ("ddp", "fsdp2", *METHODS))
def test_every_launch_has_a_caller(report, method):
    row = report[method]
    triton = sum(v for k, v in row["by_caller"].items() if k.startswith("Triton "))
    assert triton == row["triton"]
    assert sum(row["by_caller"].values()) - triton == pytest.approx(row["torch"] + row["collectives"])


@pytest.mark.parametrize("method", METHODS)
def test_the_method_launches_are_its_own(report, method):
    base = report[report["baselines"][method]]
    assert _ours(base) == 0, base["by_caller"]
    assert _ours(report[method]) > 0, report[method]["by_caller"]


def test_quant_ddp_adds_only_its_own_launches(report):
    base, quant = dict(report["ddp"]["by_caller"]), dict(report["uniform-8"]["by_caller"])
    hook = base.pop("step_methods.py:allreduce_hook")
    assert hook > 0
    added = _ours(report["uniform-8"])
    assert report["uniform-8"]["total"] - report["ddp"]["total"] == added - hook
    assert {k: v for k, v in quant.items() if not k.startswith(("lightning_qcomm/", "Triton "))} == base


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
