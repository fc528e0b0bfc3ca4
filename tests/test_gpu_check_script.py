"""benchmarks/gpu_check.py without a GPU: a clear message, a non-zero exit status, no report written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_refuses_to_run_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    report = REPO / "benchmarks" / "results" / "gpu_check.md"
    before = report.stat().st_mtime if report.exists() else None
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
    assert (report.stat().st_mtime if report.exists() else None) == before
