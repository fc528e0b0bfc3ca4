"""docs/compatibility.md holds: every method has a row for every setting, every "tested" cell names test functions
that exist, and every "refused" or "warned" cell quotes a message that the package's source contains.

A test file is found by name anywhere under tests/ (files may move into subfolders); the function must be defined
at the top level of that file (``def`` or ``async def``). A message is searched in the source of lightning_qcomm/
with runs of whitespace made one space, so a fragment must lie inside one string literal of the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
MATRIX = REPO / "docs" / "compatibility.md"
METHODS = ("QSDP", "QuantDDP", "LocalSGD", "1-bit Adam", "ActivationQuantization", "CommVolumeLogger")
SETTINGS = (
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "torch.compile",
    "gradient accumulation",
    "gradient clipping",
    "manual optimization",
    "checkpoint resume",
    "Hugging Face models",
    "Fabric",
    "plain torch",
    "several nodes",
)
STATUSES = ("tested", "refused", "warned", "untested")
TEST_REF = re.compile(r"`(test_\w+\.py)::(test_\w+)`")
QUOTED = re.compile(r'"([^"]+)"')


def parse(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{method: {setting: (status, evidence)}} from the ``## <method>`` sections' tables."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    method = None
    for line in text.splitlines():
        if line.startswith("## "):
            method = line[3:].strip()
            out[method] = {}
        elif method and line.startswith("|") and not line.startswith(("| setting", "|---")):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 3, f"{method}: a row needs setting | status | evidence: {line!r}"
            setting, status, evidence = cells
            assert setting not in out[method], f"{method}: {setting} twice"
            out[method][setting] = (status, evidence)
    return out


def _test_functions(filename: str) -> set[str]:
    found = sorted(TESTS.rglob(filename))
    assert found, f"no {filename} under tests/"
    assert len(found) == 1, f"{filename} is ambiguous: {found}"
    tree = ast.parse(found[0].read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _package_source() -> str:
    text = "\n".join(p.read_text() for p in sorted((REPO / "lightning_qcomm").rglob("*.py")))
    return re.sub(r"\s+", " ", text)


MATRIX_CELLS = parse(MATRIX.read_text())


def test_every_method_has_every_setting_once():
    assert tuple(MATRIX_CELLS) == METHODS
    for method, rows in MATRIX_CELLS.items():
        assert tuple(rows) == SETTINGS, f"{method}: settings {list(rows)}"
        for setting, (status, _) in rows.items():
            assert status in STATUSES, f"{method} / {setting}: status {status!r}, allowed {STATUSES}"


@pytest.mark.parametrize("method", METHODS)
def test_tested_cells_name_tests_that_exist(method):
    for setting, (status, evidence) in MATRIX_CELLS[method].items():
        refs = TEST_REF.findall(evidence)
        if status == "tested":
            assert refs, f"{method} / {setting}: 'tested' names no `test_file.py::test_name`"
        for filename, name in refs:
            assert name in _test_functions(filename), f"{method} / {setting}: {filename}::{name} does not exist"


@pytest.mark.parametrize("method", METHODS)
def test_refused_and_warned_cells_quote_the_codes_message(method):
    source = _package_source()
    for setting, (status, evidence) in MATRIX_CELLS[method].items():
        if status not in ("refused", "warned"):
            continue
        quoted = QUOTED.findall(evidence)
        assert quoted, f"{method} / {setting}: '{status}' quotes no message"
        for message in quoted:
            assert re.sub(r"\s+", " ", message) in source, (
                f"{method} / {setting}: {message!r} is not in lightning_qcomm/"
            )


def test_a_missing_test_or_message_is_caught(tmp_path):
    """The checks can fail: a renamed test and a reworded message are both found."""
    assert "test_no_such_test" not in _test_functions("test_strategy_matrix.py")
    assert "QSDPStrategy does not support Trainer(precision=" in _package_source()
    assert "QSDPStrategy does not accept Trainer(precision=" not in _package_source()
    bad = parse("## X\n| setting | status | evidence |\n|---|---|---|\n| 32-true | tested | none |\n")
    assert bad == {"X": {"32-true": ("tested", "none")}} and not TEST_REF.findall(bad["X"]["32-true"][1])
