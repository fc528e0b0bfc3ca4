"""Sphinx configuration: the API reference is generated from the docstrings (autodoc + napoleon); the
prose pages are Markdown (myst-parser). Built in CI with warnings as errors:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, whatever else is installed

import lightning_qcomm  # noqa: E402

project = "lightning_qcomm"
author = "lightning_qcomm contributors"
release = lightning_qcomm.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"lightning_qcomm {release}"
autodoc_inherit_docstrings = False  # Lightning base-class docstrings use roles of its own docs
