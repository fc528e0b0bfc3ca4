"""The code cites the repository's docs, never the issue tracker: an issue number in a module, a benchmark or a
test outlives the issue and means nothing to a reader of the code (history goes to CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# The pages a user reads carry what holds now: no issue numbers, no dated run notes, no "was X, now Y". History
# goes to CHANGELOG.md and benchmarks/results/history.md, dates into the results files (both exempt).
PAGES = ("README.md", "BENCHMARKS.md", "RELIABILITY.md", "docs")
LAB_NOTES = {
    "an issue number": re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE),
    "a dated run note": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d\d:\d\d UTC\b"),
    "a was/now history line": re.compile(
        r"\b(?:was|were)\s+[-+−]?\d|\bbefore\b[^.|]*\bnow\b|\bnow\b[^.|]*\b(?:was|before)\b|\bbefore[,)]"
        r"|\bbefore:|\bBefore this\b|\bup from\b|\bpreviously\b|\|\s*(?:on main )?before\s*\|",
    ),
}


def page_paths() -> list[Path]:
    paths = []
    for name in PAGES:
        path = ROOT / name
        paths += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return [p for p in paths if "_build" not in p.parts]


def lab_notes(text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in LAB_NOTES.items():
            m = pattern.search(line)
            if m:
                hits.append(f"{n}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return hits


def test_no_lab_notes_in_the_pages_users_read():
    hits = [f"{p.relative_to(ROOT)}:{hit}" for p in page_paths() for hit in lab_notes(p.read_text())]
    assert not hits, "lab notes in the user-facing pages (history: CHANGELOG.md, benchmarks/results/history.md):\n" + (
        "\n".join(hits)
    )


def test_the_lab_note_check_can_fail():
    assert lab_notes("fixed in issue 17") and lab_notes("see #17") and lab_notes("run of 2026-12-04")
    assert lab_notes("1.057x DDP's, was 1.288x") and lab_notes("| case | before | now |")
    assert not lab_notes("averaged before validation; the `#` of a heading; the step before the freeze")


def test_the_pages_stay_readable():
    """A user reads the README and BENCHMARKS.md whole: history and investigations go elsewhere."""
    limits = {"README.md": 450, "BENCHMARKS.md": 500}
    long = {name: n for name, limit in limits.items() if (n := len((ROOT / name).read_text().splitlines())) > limit}
    assert not long, f"pages over their line limit {limits}: {long}"
