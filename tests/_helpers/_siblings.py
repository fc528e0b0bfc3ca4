"""Another test file's module or names, for a test that reuses its model, data or inputs.

pytest imports each test file under a name made from its path (``tests.codecs.test_codecs``: the ``importlib``
import mode, pyproject.toml) and puts no folder of tests/ on ``sys.path``, so ``import test_codecs`` finds nothing.
This returns the module pytest imported, under that name, or imports it under that name where pytest has not
(yet): in the test session, in a spawned rank, in a file run as a script under Triton's interpreter. One module
object per file, whichever imports it first.

Example::

    extreme_values = load_test_module("codecs/test_codecs").extreme_values
    N_FEAT, N_CLS = from_test_file("strategies/test_quant_ddp", "N_FEAT", "N_CLS")
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from _launch import _module_at

TESTS = Path(__file__).resolve().parents[1]


def load_test_module(path: str) -> ModuleType:
    """The module of ``tests/<path>.py`` (``path`` relative to tests/, without ``.py``), named as pytest names it."""
    file = TESTS / f"{path}.py"
    if not file.is_file():
        raise ValueError(f"load_test_module(path={path!r}): no file {file}; allowed: a test file's path under tests/")
    return _module_at(".".join(("tests", *Path(path).parts)), str(file))


def from_test_file(path: str, *names: str) -> Any:
    """``from <test file> import <names>``: the one object for one name, else the tuple of them in order."""
    module = load_test_module(path)
    found = tuple(getattr(module, name) for name in names)
    return found[0] if len(found) == 1 else found
