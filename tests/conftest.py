"""Shared test setup: the helpers on the path, single-threaded torch, flushed denormals, and no environment
leaking between tests.

The test files import with pytest's ``importlib`` mode (pyproject.toml), so no folder of tests/ is put on
``sys.path``: tests/kernels or tests/codecs must never become the top-level ``kernels`` (a PyPI package
transformers probes for) or ``codecs`` (the standard library's). The one folder on the path is tests/_helpers,
put there below, whose modules (``_launch``, ``_sync_guard``, ``_interpreted``, ``_memory``, ``_siblings``,
``_cuda_checks``) the tests import by bare name; a test reuses another test file's code through ``_siblings``. The
layout is in docs/design.md, "Tests".

LightningCLI's ``seed_everything`` writes ``PL_GLOBAL_SEED`` (which seeds every later DistributedSampler),
and launchers write MASTER_PORT and friends; each test gets back the environment it started with.
"""

import os
import sys
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).resolve().parent / "_helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _isolate_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
