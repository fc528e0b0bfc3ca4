"""benchmarks/gpu_check.py without a GPU: a clear message, a non-zero exit status, no report written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def test_report_names_the_kernels_each_codec_ran(tmp_path, monkeypatch):
    """A codec whose Triton kernels failed their first-use check is timed on the torch reference: the table says
    so, with the check's reason, next to its figures."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "gpu_check.md")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    rows = [
        ("uniform8", 1.0, 0.5, 0.8, 0.9, "Triton"),
        ("qsgd4", 2.0, 1.0, 0.4, 0.5, "torch reference (RuntimeError: the Triton decode differs | 3 of 9 values)"),
    ]
    tests = {"cases": [], "seconds": 1.0, "timed_out": False, "tail": ""}
    text = gpu_check.write_report("here", tests, 3000.0, rows, 60.0)
    table = [line for line in text.splitlines() if line.startswith("| uniform8") or line.startswith("| qsgd4")]
    assert table[0].endswith("| met | Triton |"), table
    assert table[1].endswith("|  | torch reference (RuntimeError: the Triton decode differs / 3 of 9 values) |"), table
