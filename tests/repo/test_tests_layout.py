"""tests/ mirrors the package: a test file lives in the folder of what it mainly tests, and no folder of tests/ is
importable under a top-level name (docs/design.md, "Tests").

The folders: one per folder of ``lightning_qcomm`` (``codecs``, ``comm``, ``collectives``, ``adapters``, ``memory``,
``optim``, ``parallel``, ``strategies``, ``fabric``, ``callbacks``), ``cli`` (``lightning_qcomm/cli.py``),
``kernels`` (the top-level ``kernels/``), ``benchmarks`` (the scripts of ``benchmarks/``), ``repo`` (the repository
as a whole: layering, docs, figures, examples, the harness), ``cuda`` (the GPU checks) and ``_helpers`` (what the
tests import by bare name; no tests). pytest imports the files in its ``importlib`` mode (pyproject.toml), so it
puts no folder of tests/ on ``sys.path``; conftest.py puts ``_helpers`` there. With tests/ itself on the path,
tests/codecs would shadow the standard library's ``codecs``, tests/kernels PyPI's ``kernels`` (which transformers
probes for), tests/cuda NVIDIA's ``cuda``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "lightning_qcomm"
PACKAGE_FOLDERS = {"codecs", "comm", "collectives", "adapters", "memory", "optim", "parallel", "strategies", "fabric"}
PACKAGE_FOLDERS |= {"callbacks"}
FOLDERS = PACKAGE_FOLDERS | {"cli", "kernels", "benchmarks", "repo", "cuda"}
HELPERS = TESTS / "_helpers"


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_is_in_one_of_the_folders():
    misplaced = [
        str(p.relative_to(TESTS))
        for p in _test_files()
        if p.relative_to(TESTS).parts[:-1] not in {(f,) for f in FOLDERS}
    ]
    assert not misplaced, f"put these in one of {sorted(FOLDERS)}: {misplaced}"


def test_the_folders_are_the_packages_and_the_named_groups():
    on_disk = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    assert on_disk == FOLDERS | {"_helpers"}, on_disk ^ (FOLDERS | {"_helpers"})
    assert all((PACKAGE / name / "__init__.py").is_file() for name in PACKAGE_FOLDERS)
    assert (
        (PACKAGE / "cli.py").is_file()
        and (TESTS.parent / "kernels").is_dir()
        and (TESTS.parent / "benchmarks").is_dir()
    )
    assert not list(HELPERS.glob("test_*.py")), "tests go in a folder of their subject, not in _helpers"
    assert not list(TESTS.rglob("__init__.py")), "an __init__.py would make pytest import its folder as a package"


def test_test_file_names_are_unique():
    """docs/compatibility.md names a test by its file name, found anywhere under tests/."""
    names = [p.name for p in _test_files()]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_folder_of_tests_is_on_the_path(request):
    assert request.config.getoption("importmode") == "importlib"
    folders = {TESTS, *(p for p in TESTS.iterdir() if p.is_dir() and p != HELPERS)}
    on_path = [p for p in sys.path if Path(p or ".").resolve() in folders]
    assert not on_path, on_path


def test_top_level_names_do_not_resolve_into_tests():
    """``codecs`` is the standard library's, ``kernels`` and ``cuda`` are installed packages' (or absent), and no
    folder of tests/ answers a top-level import."""
    for name in sorted(FOLDERS | {"codecs", "kernels", "cuda"}):
        spec = importlib.util.find_spec(name)
        places = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
        inside = [p for p in places if p and TESTS in Path(p).resolve().parents]
        assert not inside, f"import {name} finds {inside}"
    codecs = importlib.util.find_spec("codecs").origin  # "frozen" where the interpreter froze it (3.11+)
    assert codecs == "frozen" or codecs.startswith(sys.base_prefix), codecs


def test_the_helpers_names_are_their_own():
    """What the tests import by bare name is found in tests/_helpers, and no standard module has its name."""
    names = sorted(p.stem for p in HELPERS.glob("*.py"))
    assert names == ["_cuda_checks", "_interpreted", "_launch", "_memory", "_siblings", "_sync_guard"], names
    for name in names:
        assert name not in sys.stdlib_module_names, name
        assert Path(importlib.util.find_spec(name).origin).resolve().parent == HELPERS, name


def test_no_test_file_imports_another_by_bare_name():
    """``import test_codecs`` works only with its folder on the path: a test reuses another's code through
    ``_siblings.from_test_file("codecs/test_codecs", ...)``, which imports it under pytest's name for it."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [
                f"{path.relative_to(TESTS)}:{node.lineno} {n}"
                for n in names
                if any(p.startswith("test_") for p in n.split("."))
            ]
    assert not found, found
