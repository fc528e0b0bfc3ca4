"""Every package of the source tree is installed: pyproject.toml lists its packages one by one (the top-level
``kernels/`` and ``configs/`` install inside the package), so a new folder missing from the list would be absent
from a wheel and from an editable install's finder, and importing it would fail for users only."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "lightning_qcomm").rglob("__init__.py")
    }
    assert on_disk - listed == set(), f"add to pyproject.toml's packages: {sorted(on_disk - listed)}"
