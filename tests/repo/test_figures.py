"""Every figure the user-facing pages quote is read from a results file that the measuring command wrote.

The convention (BENCHMARKS.md, "Methodology", describes it for writers), two forms:

* one figure: the number, then an HTML comment naming its source entry, e.g.
  ``5.55×<!-- fig: netbench_final_1204.json table/100.0/rows/onebit_adam/speedup_vs_fp32 -->``. The file is
  under ``benchmarks/results/``; in a ``.json`` file the key is a ``/``-separated path (list items by index),
  in a ``.md`` file it is ``row|column`` of the first table with that row (first cell, or ``a & b``: the row
  holding both cells) and that column header (inside a Markdown table write that pipe as ``\\|``, or it splits the cell);
  ``FILE.md#text`` reads only the tables under the first heading that contains ``text`` (``_`` for a space). The printed number
  must equal the source rounded to the printed decimals (half a unit of the last printed digit).
* a whole table: ``<!-- fig-table: FILE.md#text -->`` on the line before a Markdown table. Every column header
  of the page's table must be a column of a source table, and every row must be a row of such a table, read in
  the page's columns, with the same text in every cell (bold marks aside).

A figure that looks measured (a ratio such as ``3.74×`` or a signed percentage such as ``+3.30%``) without a
source fails the test, outside code and after a goal sign (``≤ +1%`` and ``≤ 0.04×`` are goals, not figures). Add a figure in
one line: write the number and its comment; this test reads it.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
TAGGED = re.compile(rf"(?P<num>{NUMBER})(?P<unit>[^\s<|*]{{0,4}})[*_]*\s*<!-- fig: (?P<file>\S+) (?P<key>.+?) -->")
TABLE_TAG = re.compile(r"<!-- fig-table: (?P<file>\S+) -->")
# what reads as a measured figure: 3.74× / 3.74x (not 4×64), +3.30% / −0.5% (not after a goal sign)
UNTAGGED = re.compile(
    r"(?<![≤≥<>~]\s)(?<![≤≥<>~])(?:(?<![\w.])\d+(?:\.\d+)?[×x](?![\w])|(?<![\w]\s)(?<![\w.])[+−]\d+(?:\.\d+)?%)"
)


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def strip_code(text: str) -> str:
    """The page without fenced code blocks and inline code (commands hold settings, not figures)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def to_decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", "").replace("−", "-").lstrip("+"))


def md_tables(path: Path, section: str | None) -> list[tuple[list[str], list[list[str]]]]:
    """The Markdown tables of a results file (header, rows), under ``section`` if given."""
    lines = path.read_text().splitlines()
    if section is not None:
        section = section.replace("_", " ")  # a tag holds no space: FILE.md#100_Mbit/s
        starts = [i for i, line in enumerate(lines) if line.startswith("#") and section in line]
        if not starts:
            raise KeyError(f"{path.name}: no heading contains {section!r}")
        lines = lines[starts[0] + 1 :]
        end = next((i for i, line in enumerate(lines) if line.startswith("#")), len(lines))
        lines = lines[:end]
    tables, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            header = cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def cells(line: str) -> list[str]:
    return [c.strip().replace("**", "").strip() for c in line.strip().strip("|").split("|")]


def source_value(file: str, key: str):
    key = key.replace("\\|", "|")  # in a table cell the key's pipe is escaped, or it would split the cell
    name, _, section = file.partition("#")
    path = RESULTS / name
    if not path.is_file():
        raise KeyError(f"no results file benchmarks/results/{name}")
    if name.endswith(".json"):
        value, parts = json.loads(path.read_text()), key.split("/")
        while parts:  # a dict key may itself hold "/" ("0/onebit"): the longest one that exists
            if isinstance(value, list):
                value, parts = value[int(parts[0])], parts[1:]
                continue
            n = next((n for n in range(len(parts), 0, -1) if "/".join(parts[:n]) in value), None)
            if n is None:
                raise KeyError(f"{name}: no key {parts[0]!r} on the path {key!r}")
            value, parts = value["/".join(parts[:n])], parts[n:]
        return value
    row, _, column = key.partition("|")
    for header, rows in md_tables(path, section or None):
        found = [r for r in rows if r[0] == row or (" & " in row and all(c in r for c in row.split(" & ")))]
        if column in header and found:
            return found[0][header.index(column)]
    raise KeyError(f"{file}: no table with row {row!r} and column {column!r}")


def check_tagged(text: str) -> list[str]:
    problems = []
    for m in TAGGED.finditer(text):
        where = f"{m.group('num')}{m.group('unit')} <- {m.group('file')} {m.group('key')}"
        try:
            value = source_value(m.group("file"), m.group("key"))
        except (KeyError, IndexError, ValueError) as e:
            problems.append(f"{where}: {e}")
            continue
        if isinstance(value, str):
            found = re.search(NUMBER, value)
            if not found:
                problems.append(f"{where}: the source cell {value!r} holds no number")
                continue
            value = found.group(0)
        printed = to_decimal(m.group("num"))
        exponent = printed.as_tuple().exponent
        if abs(to_decimal(str(value)) - printed) > Decimal(5).scaleb(exponent - 1) + Decimal("1e-12"):
            problems.append(f"{where}: the source says {value}")
    return problems


def check_tables(text: str) -> list[str]:
    problems, lines, plain = [], text.splitlines(), strip_code(text).splitlines()
    for n, plain_line in enumerate(plain):
        m = TABLE_TAG.search(plain_line)
        if not m:
            continue
        name, _, section = m.group("file").partition("#")
        body = []
        for row in lines[n + 1 :]:
            if not row.startswith("|"):
                break
            body.append(row)
        if len(body) < 3:
            problems.append(f"line {n + 1}: fig-table {m.group('file')} is not followed by a table")
            continue
        header, rows = cells(body[0]), [cells(row) for row in body[2:]]
        try:
            tables = md_tables(RESULTS / name, section or None)
        except (KeyError, FileNotFoundError) as e:
            problems.append(f"line {n + 1}: {e}")
            continue
        # each row must be a source row read in the page's columns (rows are matched whole, not by a key)
        sources = [[[r[t[0].index(h)] for h in header] for r in t[1]] for t in tables if set(header) <= set(t[0])]
        if not sources:
            problems.append(f"line {n + 1}: no table of {m.group('file')} has the columns {header}")
            continue
        for row in rows:
            if not any(row in source for source in sources):
                near = [r for source in sources for r in source if r[0] == row[0]]
                problems.append(f"line {n + 1}: row {row} is in no table of the source; rows named so: {near}")
    return problems


def untagged(text: str) -> list[str]:
    text = strip_code(text)
    hits, lines = [], text.splitlines()
    in_table = False
    for n, line in enumerate(lines):
        if TABLE_TAG.search(line):
            in_table = True
            continue
        if in_table and line.startswith("|"):
            continue
        in_table = False
        rest = TAGGED.sub("", line)
        for m in UNTAGGED.finditer(rest):
            hits.append(f"{n + 1}: {m.group(0)!r} in {line.strip()[:110]}")
    return hits


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_figure_equals_its_results_file(page: Path):
    text = page.read_text()
    problems = check_tagged(text) + check_tables(text)
    assert not problems, f"{page.relative_to(ROOT)}: figures that differ from their source:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_figure_without_a_source(page: Path):
    hits = untagged(page.read_text())
    assert not hits, f"{page.relative_to(ROOT)}: figures without a results file:\n" + "\n".join(hits)


def unescaped_pipes_in_table_tags(text: str) -> list[str]:
    """Table rows whose figure tag holds a bare ``|``: Markdown splits the cell there and the comment shows."""
    return [
        f"{n}: {line.strip()[:100]}"
        for n, line in enumerate(strip_code(text).splitlines(), 1)
        if line.lstrip().startswith("|")
        and any(re.search(r"(?<!\\)\|", tag) for tag in re.findall(r"<!-- fig: .*? -->", line))
    ]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tags_in_table_cells_escape_their_pipe(page: Path):
    hits = unescaped_pipes_in_table_tags(page.read_text())
    assert not hits, f"{page.relative_to(ROOT)}: write the key's pipe as \\| inside a table:\n" + "\n".join(hits)


def test_the_checker_catches_a_wrong_figure():
    row = "onebit_adam"
    path = "table/100.0/rows/" + row + "/speedup_vs_fp32"
    good = f"5.55×<!-- fig: netbench_final_1204.json {path} -->"
    assert check_tagged(good) == []
    assert check_tagged(good.replace("5.55×", "8.1×"))
    assert check_tagged("3.74×<!-- fig: netbench_final_1204.md#100 qddp_nuqsgd4|speedup vs DDP fp32 -->") == []
    assert check_tagged("4.51×<!-- fig: netbench_final_1204.md#100 qddp_nuqsgd4|speedup vs DDP fp32 -->")
    assert check_tagged("+0.7%<!-- fig: fidelity.md localsgd_qsr|gap -->")  # the full run says +3.30%
    assert check_tagged("+3.30%<!-- fig: fidelity.md localsgd_qsr\\|gap -->") == []  # escaped in a table cell
    assert unescaped_pipes_in_table_tags("| a | 1.0<!-- fig: f.md r|c --> |") and not unescaped_pipes_in_table_tags(
        "| a | 1.0<!-- fig: f.md r\\|c --> |\nprose 1.0<!-- fig: f.md r|c -->"
    )
    assert untagged("QSR: val loss +0.7%, 5.6× faster") and not untagged("goal ≤ +1%, 4×64 tokens, `2.0x`")
