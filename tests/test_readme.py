"""The command blocks of the README and docs/USAGE.md run as written, so they cannot drift
from the code (the README's sections read here are run by tests/test_vllm_serve.py and
tests/test_ray_cluster.py).

docs/USAGE.md's "Models and generation" section: its first block runs verbatim on the tiny
models; its SmolLM2 block runs with the tiny target in place of SmolLM2, as the section says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT

SMOLLM2 = "$(grpo-specdec models prepare smollm2)"
TINY_TARGET = "runs/tiny/target"


def section_commands(title: str, doc: str = "README.md") -> list[list[str]]:
    """Each ```bash block of section `title` of `doc` as its list of commands (a trailing
    backslash continues a line; comments are dropped)."""
    text = (ROOT / doc).read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{doc} has no section '## {title}'"
    blocks = re.findall(r"```bash\n(.*?)```", match.group(1), re.S)
    assert blocks, f"{doc} section '{title}' shows no bash block"
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
        commands.append([line for line in lines if line and not line.startswith("#")])
    return commands


def run(command: str, cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"documented command failed: {command}\n{proc.stderr[-3000:]}"


def run_in_order(commands: list[str], cwd: Path) -> None:
    for command in commands:
        run(command, cwd)


@pytest.mark.slow
def test_models_and_generation_commands_run_as_written(tmp_path):
    tiny_block, smollm2_block = section_commands("Models and generation", "docs/USAGE.md")
    assert any(SMOLLM2 in c for c in smollm2_block)
    run(tiny_block[0], tmp_path)  # the tiny models, which both blocks use
    # Then each block in order, the two side by side: each command is a fresh process
    # that spends much of its time starting up on one core.
    chains = [tiny_block[1:], [c.replace(SMOLLM2, TINY_TARGET) for c in smollm2_block]]
    with ThreadPoolExecutor(len(chains)) as pool:
        for done in [pool.submit(run_in_order, chain, tmp_path) for chain in chains]:
            done.result()
    for name in (
        "out.json",
        "out_spec.json",
        "out_sampled.json",
        "out_ca.json",
        "profile.json",
        "eval.json",
    ):
        assert (tmp_path / name).is_file(), f"documented commands wrote no {name}"


def test_the_gpu_section_simulates_as_written():
    (block,) = section_commands("On a GPU: what to expect (modelled)")
    for command in block:
        run(command, ROOT)
