"""The README's "Scaling out" commands on the tiny models: two engines and two policy
ranks on the embedded Ray, on a cluster started with `ray start --head` (joined by
address), and through `ray job submit`."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_JOB_CONFIG as CONFIG
from tests.conftest import free_port, job_overrides, job_records
from tests.test_readme import run, section_commands

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
README_CONFIG = "configs/smollm2_arith.yaml"


@pytest.fixture(scope="module")
def commands() -> list[str]:
    (block,) = section_commands("Scaling out")
    assert [c.split()[:2] for c in block] == [
        ["grpo-specdec", "train"],
        ["ray", "start"],
        ["grpo-specdec", "train"],
        ["RAY_AUTH_MODE=token", "ray"],
    ]
    return block


@pytest.fixture(scope="module")
def ray_head(commands):
    """The README's `ray start --head`, on free ports (its job agent's too), as its own
    process group (stopped with it: `ray stop` would stop every Ray on the machine)."""
    port, dashboard = free_port(), free_port()
    argv = shlex.split(commands[1].replace("6379", str(port)).replace("8265", str(dashboard)))
    temp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay short
    argv[0] = str(BIN / "ray")
    head = subprocess.Popen(
        [
            *argv,
            # Ray's fixed default (52365) may be another Ray's on this machine (a job test on
            # the other xdist worker): the agent then serves no jobs and every submission
            # answers "No available agent to submit job".
            f"--dashboard-agent-listen-port={free_port()}",
            *("--block", "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={
            **os.environ,
            # jobs submitted to it find grpo-specdec where the README's shell would
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            # The raylet gives its dashboard agent 30 s to write its port file and then
            # aborts; beside the other xdist worker's vLLM engine a 2-core machine's agent took
            # longer, and the head ran on with no live node ("No node info found").
            "RAY_agent_register_timeout_ms": "300000",
        },
    )
    token = {**os.environ, "RAY_AUTH_MODE": "token"}  # as the README's `ray job` commands
    dashboard_url = f"http://127.0.0.1:{dashboard}"
    try:  # a head that never came up is stopped too: it would outlive the session
        deadline = time.time() + 120
        while subprocess.run(
            [BIN / "ray", "job", "list", "--address", dashboard_url], capture_output=True, env=token
        ).returncode:
            assert head.poll() is None, "ray start --head exited"
            assert time.time() < deadline, "the Ray head's job API did not come up"
            time.sleep(2)
        yield {"HEAD:6379": f"127.0.0.1:{port}", "HEAD:8265": f"127.0.0.1:{dashboard}"}
    finally:
        # `ray start --block` takes ~30 s to go on SIGTERM; nothing of it is needed any more.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _run_readme_command(command, addresses, target, draft, profile, tmp_path) -> dict:
    command = command.replace(README_CONFIG, CONFIG)
    for placeholder, address in addresses.items():
        command = command.replace(placeholder, address)
    out = tmp_path / "run"
    run(f"{command} {' '.join(job_overrides(target, draft, profile, out, 1))}", tmp_path)
    (record,) = job_records(out)
    assert [e["prompts"] for e in record["engines"]] == [2, 2]
    assert record["engine_policy_version"] == record.get("policy_version", 0)
    return record


def test_one_machine_command_runs(commands, tiny_target, tiny_draft, job_profile, tmp_path):
    # before the module's cluster starts: the embedded Ray must be the job's own
    _run_readme_command(commands[0], {}, tiny_target, tiny_draft, job_profile, tmp_path)


@pytest.mark.parametrize("which", [2, 3], ids=["by-address", "job-submit"])
def test_cluster_commands_run(
    which, commands, ray_head, tiny_target, tiny_draft, job_profile, tmp_path
):
    _run_readme_command(commands[which], ray_head, tiny_target, tiny_draft, job_profile, tmp_path)
