"""Every module docstring of the package (and of the top-level ``kernels/``) is at most 25 lines: what the module
is for, its invariants, an example, a pointer to docs/design.md; the rest lives in docs/design.md and
BENCHMARKS.md. Counted in source lines from the opening quotes to the closing ones; read with ``ast``, nothing
is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 25


def docstring_lines(source: str) -> int:
    """Source lines the module docstring spans (0: none)."""
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return 0
    if not isinstance(body[0].value.value, str):
        return 0
    return body[0].end_lineno - body[0].lineno + 1


def test_the_count_spans_the_quotes():
    assert docstring_lines('"""One line."""\nx = 1\n') == 1
    assert docstring_lines('"""Title.\n\nMore.\n"""\n') == 4
    assert docstring_lines("x = 1\n") == 0


def test_every_module_docstring_is_at_most_25_lines():
    files = sorted((REPO / "lightning_qcomm").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    assert len(files) > 100, files  # the package was found
    long = {str(p.relative_to(REPO)): n for p in files if (n := docstring_lines(p.read_text())) > MAX_LINES}
    assert not long, f"module docstrings over {MAX_LINES} lines (move the detail to docs/design.md): {long}"
