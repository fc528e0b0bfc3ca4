"""Every hard dependency in pyproject.toml is imported by the package (or needed by a module it imports, named
here): none is declared and left unused."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a dependency the package uses through another library's module: the module the package imports that needs it
THROUGH = {"jsonargparse[signatures]": "lightning.pytorch.cli"}  # LightningCLI parses with jsonargparse


def _declared() -> list[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)  # Python 3.10 has no tomllib
    deps = re.findall(r'^\s*"([^"]+)"', block, re.M)
    return [re.split(r"[<>=!~; ]", d, maxsplit=1)[0] for d in deps]


def _imported() -> set[str]:
    found = set()
    for path in (REPO / "lightning_qcomm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def test_every_declared_dependency_is_imported():
    declared = _declared()
    assert "torch" in declared and "lightning" in declared  # the list was read
    imported = _imported()
    top = {name.split(".")[0] for name in imported}
    unused = [d for d in declared if (THROUGH[d] not in imported if d in THROUGH else d not in top)]
    assert not unused, f"declared in pyproject.toml but imported nowhere in lightning_qcomm/: {unused}"
