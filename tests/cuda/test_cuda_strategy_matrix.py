"""Every strategy and callback in every precision on one CUDA device.

Runs ``tests/cuda/strategy_matrix_run.py --accelerator cuda`` in one subprocess (a fresh process: Lightning
initialises a one-rank NCCL group) and checks each cell: it trains to finite losses within the CPU matrix's
band (a precision may cost a method no more than it costs plain DDP, up to 3%), or is refused before its
first step naming the precision. Skipped without CUDA; the script runs on CPU too (``--accelerator cpu``,
about 1.5 minutes, not part of the suite: tests/strategies/test_strategy_matrix.py covers CPU with 2 ranks).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cuda_checks import NO_CUDA

SCRIPT = Path(__file__).with_name("strategy_matrix_run.py")
BAND = 0.03  # tests/strategies/test_strategy_matrix.py's PRECISION_BAND


def _run(accelerator: str, tmp_path: Path) -> dict:
    out = tmp_path / f"matrix_{accelerator}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--accelerator", accelerator, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check(cells: dict) -> None:
    for key, cell in cells.items():
        name, precision = key.split("/")
        if "refused" in cell:
            assert cell["step"] == 0, f"{key} refused after training started: {cell}"
            assert precision in cell["refused"], f"{key}: the refusal does not name the precision: {cell['refused']}"
            continue
        assert cell["loss"] is not None and math.isfinite(cell["loss"]), cell
        cost = cell["loss"] / cells[f"{name}/32-true"]["loss"]
        ddp_cost = cells[f"ddp/{precision}"]["loss"] / cells["ddp/32-true"]["loss"]
        assert cost <= (1 + BAND) * ddp_cost, f"{key}: x{cost:.3f} of its fp32 loss, DDP x{ddp_cost:.3f}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_matrix_on_cuda(tmp_path):
    _check(_run("cuda", tmp_path))
