"""`vllm serve` with the plugin, driven by the openai client: the concurrency-aware
scheduler and the weight-swap extension in a served engine, EAGLE drafts, /metrics, and
weights hot-swapped from this (another) process through the token-checked route."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.test_readme import section_commands

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_command(start: str, target: str, draft: str, port: int, *extra: str) -> list[str]:
    """The README's command beginning with `start`, on the tiny models, sized for them."""
    blocks = section_commands("1. Inside your own stack: vLLM, `vllm serve`, TRL, verl")
    (line,) = [c for block in blocks for c in block if c.startswith(start)]
    words = shlex.split(line.replace("path/to/policy", target).replace("path/to/eagle-head", draft))
    return [
        str(BIN / words[0]),
        *words[1:],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--enforce-eager",
        *extra,
    ]


API_KEY = "test-token"
# The plugin's swap route is an endpoint plugin: vLLM loads those only when named here
# (which also names the general plugins allowed to load).
PLUGINS = {"VLLM_PLUGINS": "grpo_specdec,grpo_specdec_weights"}


def start_server(command: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**inherited, **env}
    )
    deadline = time.time() + 600
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.time() < deadline, "vllm serve did not come up"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, job_profile, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {"GRPO_SPECDEC_CONTROLLER": json.dumps({"profile": job_profile}), **PLUGINS}
    command = readme_command(
        "vllm serve", tiny_target, tiny_draft, _free_port(), "--api-key", API_KEY
    )
    proc, url = start_server(command, env, log)
    yield url
    stop_server(proc)


def test_served_engine_samples_groups_concurrently_and_reports_k(server, tiny_target, questions):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=API_KEY)

    def group(prompt):
        return client.completions.create(
            model=tiny_target, prompt=prompt, n=8, temperature=1.0, max_tokens=24, seed=None
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(group, questions[:8]))
    assert all(len(r.choices) == 8 for r in results)
    assert all(len({c.text for c in r.choices}) > 1 for r in results)  # sampled, not greedy
    with urllib.request.urlopen(f"{server}/metrics") as resp:
        metrics = resp.read().decode()
    # The engine core's k histogram, on the API server's /metrics, without PROMETHEUS_MULTIPROC_DIR set.
    count = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:grpo_specdec_num_spec_tokens_per_step_count")
    ]
    assert count and sum(count) > 0, metrics[-3000:]
    assert "vllm:num_requests_running" in metrics  # vLLM's own metrics are still there


def test_served_greedy_outputs_equal_the_plain_engine(server, tiny_target, plain_engine, questions):
    from openai import OpenAI

    from grpo_specdec.engine import SamplingSettings

    client = OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    served = client.completions.create(
        model=tiny_target, prompt=questions[:6], temperature=0.0, max_tokens=24
    )
    plain = plain_engine.generate(questions[:6], SamplingSettings(max_tokens=24), chat=False)
    texts = [c.text for c in sorted(served.choices, key=lambda c: c.index)]
    assert texts == [g[0].text for g in plain.outputs]


def _greedy(url: str, model: str, prompts: list[str]) -> list[str]:
    from openai import OpenAI

    out = OpenAI(base_url=f"{url}/v1", api_key=API_KEY).completions.create(
        model=model, prompt=prompts, temperature=0.0, max_tokens=16
    )
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def _status(url: str, method: str, headers: dict) -> int:
    request = urllib.request.Request(
        f"{url}/v1/grpo/weights",
        data=b'{"role": "policy", "path": "/nonexistent", "version": 9}'
        if method == "POST"
        else None,
        method=method,
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_weights_swap_into_the_served_engine_only_with_the_token(server, tiny_target, questions):
    from safetensors.torch import load_file

    from grpo_specdec.served import ServedWeights

    for method in ("POST", "GET"):
        assert _status(server, method, {}) == 401
        assert _status(server, method, {"Authorization": "Bearer wrong"}) == 401
    weights = ServedWeights(server, API_KEY)
    assert weights.versions() == {"policy": 0, "draft": 0}

    original = load_file(Path(tiny_target) / "model.safetensors")
    before = _greedy(server, tiny_target, questions[:4])
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in original.items()}
    assert weights.swap("policy", noisy, 1)["version"] == 1
    assert weights.versions()["policy"] == 1
    assert _greedy(server, tiny_target, questions[:4]) != before

    wrong = dict(original)
    name = next(iter(wrong))
    wrong[name] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError) as refused:
        weights.swap("policy", wrong, 2)
    assert "refused the request (400)" in str(refused.value) and name in str(refused.value)
    assert weights.versions()["policy"] == 1  # rejected: still the noisy weights

    weights.swap("policy", original, 3)
    assert _greedy(server, tiny_target, questions[:4]) == before
    weights.close()


def test_the_swap_route_refuses_to_start_without_an_api_key(monkeypatch):
    import asyncio
    from argparse import Namespace

    from starlette.datastructures import State

    from vllm_plugin.weights_endpoint import WeightsEndpoint

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="start vllm serve with --api-key"):
        asyncio.run(WeightsEndpoint().init_state(object(), State(), Namespace(api_key=None)))
    state = State()
    asyncio.run(WeightsEndpoint().init_state("engine", state, Namespace(api_key=["k"])))
    assert state.grpo_engine == "engine"


def test_trl_vllm_serve_runs_the_plugin(tiny_target, tiny_draft, job_profile, questions, tmp_path):
    """TRL's server is `vllm serve` with TRL's settings; it forwards the arguments it does
    not know, so the plugin's scheduler and extension pass through."""
    from openai import OpenAI

    trl = readme_command("trl vllm-serve", tiny_target, tiny_draft, _free_port())
    env = {"GRPO_SPECDEC_CONTROLLER": json.dumps({"profile": job_profile})}
    proc, url = start_server(trl, env, tmp_path / "trl.log")
    try:
        out = OpenAI(base_url=f"{url}/v1", api_key="unused").completions.create(
            model=tiny_target, prompt=questions[:4], n=4, temperature=1.0, max_tokens=16
        )
        assert len(out.choices) == 16
        with urllib.request.urlopen(f"{url}/metrics") as resp:
            assert "vllm:grpo_specdec_num_spec_tokens_per_step_count" in resp.read().decode()
    finally:
        stop_server(proc)
    assert (
        "--scheduler-cls vllm_plugin.scheduler.ConcurrencyAwareScheduler"
        in (tmp_path / "trl.log").read_text()
    )  # TRL printed the `vllm serve` command it ran, with the plugin in it
