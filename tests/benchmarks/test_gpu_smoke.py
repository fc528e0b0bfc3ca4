"""benchmarks/gpu_smoke.py on CPU (gloo): two configs pass on 2 ranks and the report says so; a broken config fails
with its error in the report; too few GPUs exits 2 writing nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_smoke.py"


def _smoke(*args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_configs_pass_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "smoke.md"
    proc = _smoke("--accelerator", "cpu", "--devices", "2", "--only", "onebit_adam,qsdp_w8g8", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = out.read_text()
    assert "2 of 2 configs passed (2 ranks, 3 optimizer steps" in report, report
    assert "| onebit_adam | pass |" in report and "| qsdp_w8g8 | pass |" in report
    assert "commit: " in report and "torch " in report and "CPU processes over gloo" in report


@pytest.mark.slow
def test_a_failing_config_is_reported(tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import gpu_smoke
    finally:
        sys.path.remove(str(REPO))
    broken = tmp_path / "broken.yaml"
    broken.write_text((REPO / "configs" / "ddp_baseline.yaml").read_text().replace("strategy: ddp", "strategy: nope"))
    row = gpu_smoke.run_config(broken, "cpu", 2, 2, tmp_path, timeout_s=300)
    assert not row["passed"] and "nope" in row["detail"], row


def test_too_few_gpus_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "smoke.md"
    proc = _smoke("--devices", "2", "--out", str(out), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "0 CUDA device(s) visible, --devices 2 asked" in proc.stderr
    assert not out.exists()
