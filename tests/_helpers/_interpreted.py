"""Run a test file as a script under Triton's interpreter and return the JSON report it prints last.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when ``lightning_qcomm.kernels`` is
first imported, which the rest of the suite may already have done in this process; so the kernel tests run their
cases in a fresh process with the variable set (one thread, Triton not switched off) and assert on its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(script: str, timeout_s: float) -> dict:
    """``python script`` with ``TRITON_INTERPRET=1``; its last stdout line parsed as JSON. AssertionError with the
    output's tail when it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("LIGHTNING_QCOMM_DISABLE_TRITON", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_kind_passed(report: dict, kind: str) -> None:
    """Every case of ``report`` named ``<kind>_...`` is true, and there is at least one (the failing names shown)."""
    cases = {k: v for k, v in report.items() if k.startswith(kind + "_")}
    assert cases, kind
    assert all(cases.values()), [k for k, v in cases.items() if not v]
