"""Which layer may import which (issue 63): the benchmark library builds on the job, and
the job on what lies below it, never the other way; a module that reads a run folder
(`evaluate.py`) needs nothing of the job that writes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, at its top or inside a function."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
    return modules


@pytest.mark.parametrize(
    "lower, upper",
    [("grpo_specdec/job", "grpo_specdec.bench"), ("grpo_specdec/evaluate.py", "grpo_specdec.job")],
)
def test_a_layer_imports_nothing_of_the_one_above_it(lower, upper):
    target = ROOT / lower
    paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    reached = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in paths
        for module in imported_modules(path)
        if module == upper or module.startswith(upper + ".")
    ]
    assert not reached, reached
