"""Shared test setup: single-threaded torch, flushed denormals, and no environment leaking between tests.

LightningCLI's ``seed_everything`` writes ``PL_GLOBAL_SEED`` (which seeds every later DistributedSampler),
and launchers write MASTER_PORT and friends; each test gets back the environment it started with.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _isolate_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
