"""The code cites the repository's docs, never the issue tracker: an issue number in a module, a benchmark or a
test outlives the issue and means nothing to a reader of the code (history goes to CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("lightning_qcomm", "kernels", "benchmarks", "tests", "examples", "configs")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_issue_number_in_the_code():
    hits = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".py", ".yaml", ".cpp", ".h"} or path == Path(__file__).resolve():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if ISSUE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "issue numbers in the code:\n" + "\n".join(hits)
