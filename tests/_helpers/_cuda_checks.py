"""What the GPU checks of tests/cuda share: the skip reason without CUDA and where the Triton kernels come from.

The tests in tests/cuda are collected by the normal test command, every one skipped with its reason without CUDA.
Run them with ``python benchmarks/gpu_check.py`` (which also times the codecs and writes
benchmarks/results/gpu_check.md) or ``python -m pytest tests/cuda``. The Triton kernels are the package's own
``lightning_qcomm.kernels``; nothing is installed.
"""

from __future__ import annotations

import os

NO_CUDA = "needs a CUDA device (run on a GPU: python benchmarks/gpu_check.py)"


def ensure_kernels() -> str:
    """Where ``lightning_qcomm.kernels`` (the Triton kernels) comes from."""
    import lightning_qcomm.kernels as kernels

    return os.path.dirname(kernels.__file__)


def has_triton() -> bool:
    try:
        ensure_kernels()
    except ImportError:
        return False
    from lightning_qcomm import kernels

    return bool(kernels.HAS_TRITON)
