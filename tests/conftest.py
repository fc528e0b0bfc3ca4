"""Shared test setup: deterministic, single-threaded torch so multi-process tests don't oversubscribe."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_flush_denormal(True)
