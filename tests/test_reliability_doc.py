"""docs/RELIABILITY.md claims only what a test shows: every row of its tables names tests,
and every test it names exists (a renamed or removed test leaves its claim unbacked)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
NAMED = re.compile(r"`(?:tests/)?(?:reliability/)?([\w]+\.py)?(?:::([\w]+)(\.\.\.)?)?`")


def _test_functions() -> dict[str, set[str]]:
    found = {}
    for file in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(file.read_text())
        found[file.name] = {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
    return found


def claimed_tests(doc: str) -> list[tuple[int, str, list[tuple[str, str | None, bool]], str]]:
    """(line, the row's first cell, [(file, test or None, named by a prefix)], the test cell)
    of each row of the tables whose last column is "test"."""
    rows, in_table = [], False
    for number, line in enumerate(doc.splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[-1] == "test":
            in_table = True
            continue
        if not in_table or set(cells[0]) <= {"-"}:
            continue
        named, file = [], None
        for match in NAMED.finditer(cells[-1]):
            file = match.group(1) or file
            if file:
                named.append((file, match.group(2), bool(match.group(3))))
        rows.append((number, cells[0], named, cells[-1]))
    return rows


def test_every_claim_names_tests_that_exist():
    functions = _test_functions()
    problems, previous = [], []
    rows = claimed_tests(DOC.read_text())
    assert len(rows) > 40  # the tables were read
    for number, claim, named, cell in rows:
        if not named and cell == "same test":
            named = previous
        if not named:
            problems.append(f"line {number} ({claim[:50]}): names no test")
        for file, test, prefix in named:
            if file not in functions:
                problems.append(f"line {number}: no test file {file}")
            elif test and not any(
                f == test or (prefix and f.startswith(test)) for f in functions[file]
            ):
                problems.append(f"line {number}: no test {file}::{test}")
        previous = named
    assert not problems, "docs/RELIABILITY.md:\n" + "\n".join(problems)
