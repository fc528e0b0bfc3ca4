"""GPU checks (issue 19): collected by the normal test command, every test skipped with its reason without CUDA.

Run them with ``python benchmarks/gpu_check.py`` (which also times the codecs and writes
benchmarks/results/gpu_check.md) or ``python -m pytest tests/cuda``. In a source checkout without an install
``lightning_qcomm.kernels`` (which setuptools maps to the repository's ``kernels/``) is registered from there,
so the Triton kernels are what CUDA tensors use; nothing is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/_sync_guard.py
    sys.path.insert(0, str(TESTS))

NO_CUDA = "needs a CUDA device (run on a GPU: python benchmarks/gpu_check.py)"


def ensure_kernels() -> str:
    """Where ``lightning_qcomm.kernels`` comes from: the installed package, or the checkout's ``kernels/``."""
    try:
        import lightning_qcomm.kernels as kernels

        return os.path.dirname(kernels.__file__)
    except ImportError:
        pass
    import lightning_qcomm

    source = Path(lightning_qcomm.__file__).resolve().parents[1] / "kernels"
    if not (source / "__init__.py").exists():
        raise ImportError(f"lightning_qcomm.kernels is not installed and {source} does not exist")
    spec = importlib.util.spec_from_file_location(
        "lightning_qcomm.kernels", source / "__init__.py", submodule_search_locations=[str(source)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_qcomm.kernels"] = module
    spec.loader.exec_module(module)
    lightning_qcomm.kernels = module
    return str(source)


def has_triton() -> bool:
    try:
        ensure_kernels()
    except ImportError:
        return False
    from lightning_qcomm import kernels

    return bool(kernels.HAS_TRITON)
