"""`vllm serve` with the plugin, driven by the openai client: the concurrency-aware
scheduler and the weight-swap extension in a served engine, EAGLE drafts, /metrics, and
weights hot-swapped from this (another) process through the token-checked route."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, free_port, plugin_log_lines, scrambled
from tests.test_readme import section_commands
from vllm_plugin.settings import CONFIG_KEY

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


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


def profile_settings(profile: str) -> list[str]:
    """The controller's settings naming the test's latency profile, as `vllm serve` takes them."""
    return ["--additional-config", json.dumps({CONFIG_KEY: {"profile": profile}})]


API_KEY = "test-token"
WEIGHTS_TOKEN = "test-weights-token"  # the swap route's own
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
def fail_loads(tmp_path_factory) -> Path:
    """Write N here and the served engine's next N weight loads fail."""
    return tmp_path_factory.mktemp("faults") / "fail-loads"


@pytest.fixture(scope="module")
def slow_loads(tmp_path_factory) -> Path:
    """Write S here and the served engine's next weight load takes S seconds longer."""
    return tmp_path_factory.mktemp("faults") / "slow-loads"


SWAP_DEADLINE_S = 15  # the server's; a tiny model's swap takes well under a second


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, job_profile, fail_loads, slow_loads, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {
        **PLUGINS,
        "GRPO_TEST_FAIL_LOADS": str(fail_loads),
        "GRPO_TEST_SLOW_LOADS": str(slow_loads),
        "GRPO_SPECDEC_SWAP_DEADLINE_S": str(SWAP_DEADLINE_S),
        "GRPO_SPECDEC_WEIGHTS_TOKEN": WEIGHTS_TOKEN,
        "PYTHONPATH": str(ROOT),
        # vLLM's RL routes too (and its other dev routes, none of them key-checked), for a
        # trainer speaking vLLM's own client
        "VLLM_SERVER_DEV_MODE": "1",
    }
    # The README's command, with the plugin's transfer backend subclassed by one whose
    # loads a test can make fail (the later option wins).
    command = readme_command(
        "vllm serve",
        tiny_target,
        tiny_draft,
        free_port(),
        "--api-key",
        API_KEY,
        "--worker-extension-cls",
        "tests.faulty_swap_extension.FaultyLoadsExtension",
        *profile_settings(job_profile),
        "--weight-transfer-config",
        '{"backend": "grpo_shm_faulty"}',
        "--max-model-len",
        "1024",
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


def _status(url: str, method: str, headers: dict, path: str = "/v1/grpo/weights") -> int:
    request = urllib.request.Request(
        f"{url}{path}",
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

    from vllm_plugin.weights.served_weights import ServedWeights

    for method in ("POST", "GET"):
        assert _status(server, method, {}) == 401
        assert _status(server, method, {"Authorization": "Bearer wrong"}) == 401
    # The inference key does not change weights: a swap needs the route's own token too.
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert _status(server, "POST", key) == 403
    assert _status(server, "POST", key | {"X-Weights-Token": API_KEY}) == 403
    assert _status(server, "POST", key | {"X-Weights-Token": WEIGHTS_TOKEN}) == 400  # no file
    weights = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
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


def test_a_swap_past_its_deadline_answers_503_and_the_server_is_unhealthy_until_it_ends(
    server, tiny_target, slow_loads, questions
):
    """A load that hangs (a wedged collective, a slow disk) would hold the caller and keep
    /health at 200 over a paused engine: past the server's deadline the call answers 503,
    /health and completions answer 503 until the load ends, then all is well again."""
    import time

    from safetensors.torch import load_file

    from vllm_plugin.weights.served_weights import ServedWeights

    original = load_file(Path(tiny_target) / "model.safetensors")
    weights = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
    slow_loads.write_text(str(SWAP_DEADLINE_S + 10))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\(503\).*run past the server's 15 s deadline"):
        weights.swap("policy", original, 60)
    assert SWAP_DEADLINE_S <= time.monotonic() - start < SWAP_DEADLINE_S + 10
    assert _status(server, "GET", {}, path="/health") == 503
    assert _status(server, "POST", {"Authorization": f"Bearer {API_KEY}"}, "/v1/completions") == 503
    while _status(server, "GET", {}, path="/health") != 200:
        assert time.monotonic() - start < SWAP_DEADLINE_S + 120, "the swap never ended"
        time.sleep(1)
    assert weights.versions()["policy"] == 60  # it ended, and loaded
    _greedy(server, tiny_target, questions[:2])  # completions answer again


def _post_swap(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/v1/grpo/weights",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {API_KEY}",
            "X-Weights-Token": WEIGHTS_TOKEN,
        },
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _noisy(weights: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def test_the_swap_route_loads_only_files_in_the_engine_s_own_swap_folder(server, tiny_target):
    """The route names its engine's folder only to holders of the weights token, and loads
    nothing from elsewhere: not a file the server can read, a link, a missing file, nor a
    valid weight file another server's trainer wrote for it."""
    import shutil

    from vllm_plugin.weights.served_weights import ServedWeights
    from vllm_plugin.weights.swap_folder import engine_swap_folder, swap_folder

    request = urllib.request.Request(
        f"{server}/v1/grpo/weights/folder",
        headers={"Authorization": f"Bearer {API_KEY}", "X-Weights-Token": "wrong"},
    )
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(request, timeout=60)
    own = Path(
        ServedWeights(server, API_KEY, WEIGHTS_TOKEN)._call("GET", path="/folder")["swap_folder"]
    )
    assert own.parent == swap_folder()
    served_file = Path(tiny_target) / "model.safetensors"
    link = own / "policy-v31-link.safetensors"
    link.symlink_to(served_file)
    another = engine_swap_folder("another-server") / "policy-v31.safetensors"
    shutil.copy(served_file, another)
    try:
        for path in (served_file, Path("/nonexistent/x.safetensors"), link, another):
            code, answer = _post_swap(server, {"role": "policy", "path": str(path), "version": 31})
            assert code == 400, answer
            assert f"refused weight file {path}" in answer["error"], answer
            assert f"swap folder {own}" in answer["error"], answer
    finally:
        link.unlink()
        another.unlink()
    assert ServedWeights(server, API_KEY, WEIGHTS_TOKEN).versions()["policy"] != 31


def test_a_timed_out_swap_leaves_no_file_and_a_whole_engine(server, tiny_target, questions):
    from safetensors.torch import load_file

    from vllm_plugin.weights.served_weights import ServedWeights
    from vllm_plugin.weights.swap_folder import swap_folder

    original = load_file(Path(tiny_target) / "model.safetensors")
    weights = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
    version = weights.versions()["policy"]
    before = _greedy(server, tiny_target, questions[:4])
    with pytest.raises(RuntimeError, match="no answer from .* versions\\(\\) says which"):
        ServedWeights(server, API_KEY, WEIGHTS_TOKEN, timeout_s=0.001).swap(
            "policy", _noisy(original, 1), 50
        )
    assert not list(swap_folder().rglob("policy-v50-*"))  # removed, whether loaded or not
    # Loaded or refused (no file), never a mix: a swap after it succeeds, completions answer.
    assert weights.versions()["policy"] in (version, 50)
    weights.swap("policy", original, 51)
    assert _greedy(server, tiny_target, questions[:4]) == before


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_requests_in_flight_during_a_swap_use_no_kv_of_the_old_weights(
    server, tiny_target, questions
):
    from openai import OpenAI
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from vllm_plugin.weights.served_weights import ServedWeights

    client = OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
    weights = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
    original = load_file(Path(tiny_target) / "model.safetensors")
    noisy = _noisy(original, 2)
    # Over two KV blocks (128 tokens each on CPU): with EAGLE, vLLM reuses all cached blocks
    # of a prompt but the last, so a request after the group's reuses one.
    prompt = AutoTokenizer.from_pretrained(tiny_target).encode(" ".join(questions * 3))[:300]
    assert len(prompt) == 300

    def greedy() -> str:
        return (
            client.completions.create(
                model=tiny_target, prompt=prompt, temperature=0.0, max_tokens=16
            )
            .choices[0]
            .text
        )

    weights.swap("policy", noisy, 60)
    expected = greedy()  # the new weights, nothing in flight
    weights.swap("policy", original, 61)
    group = client.completions.create(
        model=tiny_target,
        prompt=prompt,
        n=4,
        temperature=1.0,
        max_tokens=600,  # still running long after the swap
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        chunks = iter(group)
        next(chunks)  # the group is running and holds the prompt's KV, of the original weights
        preempted = _metric(server, "vllm:num_preemptions_total")
        weights.swap("policy", noisy, 62)
        assert greedy() == expected
        # The group was kept, not aborted: preempted, it recomputes its KV with the new weights.
        assert _metric(server, "vllm:num_preemptions_total") >= preempted + 4
        assert not any(next(chunks).choices[0].finish_reason for _ in range(40))
    finally:
        group.close()
    weights.swap("policy", original, 63)


def test_a_served_engine_with_mixed_weights_refuses_completions_until_that_role_swaps_whole(
    server, tiny_target, tiny_draft, questions, fail_loads
):
    import openai
    from safetensors.torch import load_file

    from vllm_plugin.weights.served_weights import ServedWeights

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
    weights = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
    original = load_file(Path(tiny_target) / "model.safetensors")
    before = _greedy(server, tiny_target, questions[:4])
    in_flight = client.completions.create(
        model=tiny_target,
        prompt="1+1=",
        max_tokens=600,  # still running when the swap fails
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(in_flight)
    next(chunks)
    fail_loads.write_text("2")  # the swap's load, then the restore's
    with pytest.raises(RuntimeError, match=r"\(500\).*restoring version \d+ failed too"):
        weights.swap("policy", _noisy(original, 3), 70)
    # The request in flight does not go on generating with weights that may be a mix.
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert len(finish_reasons) < 599 and "length" not in finish_reasons, finish_reasons[-3:]
    refusal = "refusing to generate: the policy weights may be a mix"
    calls = (
        lambda: client.completions.create(model=tiny_target, prompt="1+1=", max_tokens=4),
        lambda: client.chat.completions.create(
            model=tiny_target, messages=[{"role": "user", "content": "1+1="}], max_tokens=4
        ),
    )
    for call in calls:
        with pytest.raises(openai.APIStatusError, match=refusal) as refused:
            call()
        assert refused.value.status_code == 503
    # A draft that loads whole does not make the policy whole.
    weights.swap("draft", load_file(Path(tiny_draft) / "model.safetensors"), 71)
    with pytest.raises(openai.APIStatusError, match=refusal):
        calls[0]()
    assert weights.versions()["draft"] == 71  # GETs still answer
    weights.swap("policy", original, 72)
    assert _greedy(server, tiny_target, questions[:4]) == before


def test_a_policy_left_a_mix_through_vllm_s_own_routes_serves_no_completion(
    server, tiny_target, questions, fail_loads
):
    """The update driven by vLLM's HTTP client over its RL routes, not through this plugin's
    route, so the route keeps no state of it: the engine core refuses (its weight guard),
    and the route's middleware, asking it, answers 503 with the reason. Before the guard the
    completion was generated on the half-loaded policy."""
    import openai
    import requests
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.clients import HTTPClient
    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    def push(weights: dict, version: int) -> None:
        WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0), client=HTTPClient(server), source=StateDictSource(weights)
        ).send_weights(version)

    original = load_file(Path(tiny_target) / "model.safetensors")
    before = _greedy(server, tiny_target, questions[:4])
    fail_loads.write_text("2")  # the update's load, then the restore's
    with pytest.raises(requests.HTTPError, match="500"):
        push(_noisy(original, 5), 90)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError, match="the policy weights may be a mix") as refused:
        client.completions.create(model=tiny_target, prompt="1+1=", max_tokens=4)
    assert refused.value.status_code == 503
    push(original, 91)  # an update of that role that loads whole mends it
    assert _greedy(server, tiny_target, questions[:4]) == before


def _push_draft(url: str, weights: dict, version: int) -> None:
    """A trainer on vLLM's trainer API: the `grpo_shm` trainer engine from vLLM's factory,
    sending a head over vLLM's RL routes with its HTTP client."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.clients import HTTPClient
    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    sender = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, draft=True),
        client=HTTPClient(url),
        source=StateDictSource(weights),
    )
    sender.send_weights(version)


def _served_acceptance(url: str, model: str, prompts: list[str]) -> float:
    """Draft tokens accepted per verified draft (the mean acceptance length less one), from
    the server's /metrics, over `prompts` sent one at a time (B = 1, where the controller
    drafts). Their greedy answers are not compared: in bfloat16 they move with the drafts
    verified beside them."""
    from transformers import AutoTokenizer

    # As the tiny models were trained: through the chat template (on raw text the tiny
    # target writes no answer a head can predict, so any head's acceptance is near 0 there,
    # how near depending on the machine that built the models).
    tok = AutoTokenizer.from_pretrained(model)
    counters = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total")
    start = [_metric(url, c) for c in counters]
    for q in prompts:
        chat = [{"role": "user", "content": q}]
        _greedy(
            url, model, [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)]
        )
    accepted, drafts = (_metric(url, c) - s for c, s in zip(counters, start, strict=True))
    assert drafts > 0
    return accepted / drafts


def test_vllms_http_client_pushes_a_draft_through_vllms_rl_routes(
    server, tiny_target, tiny_draft, questions
):
    """A trainer on vLLM's trainer API and its HTTP client (the RL routes, dev mode) moves
    a head in: greedy answers of a batch unchanged (lossless), the served engine's own
    acceptance rises once the trained head replaces a scrambled one; a bad one leaves the
    old one serving."""
    import requests
    from safetensors.torch import load_file

    from vllm_plugin.weights.served_weights import ServedWeights

    trained = load_file(Path(tiny_draft) / "model.safetensors")
    versions = ServedWeights(server, API_KEY, WEIGHTS_TOKEN)
    before = _greedy(server, tiny_target, questions[:8])
    _push_draft(server, scrambled(trained), 80)
    assert versions.versions()["draft"] == 80
    assert _greedy(server, tiny_target, questions[:8]) == before  # lossless either way
    with_scrambled = _served_acceptance(server, tiny_target, questions[:8])
    _push_draft(server, trained, 81)
    assert versions.versions()["draft"] == 81
    assert _greedy(server, tiny_target, questions[:8]) == before
    assert _served_acceptance(server, tiny_target, questions[:8]) > 2 * with_scrambled
    missing = dict(trained)
    missing.pop(next(iter(missing)))
    with pytest.raises(requests.HTTPError):
        _push_draft(server, missing, 82)
    assert versions.versions()["draft"] == 81
    assert _greedy(server, tiny_target, questions[:8]) == before


def test_the_swap_route_refuses_to_start_without_its_keys_and_says_dev_mode_opens_it(
    monkeypatch, caplog
):
    import asyncio
    import logging
    from argparse import Namespace

    from starlette.datastructures import State
    from vllm.config import WeightTransferConfig

    from grpo_specdec.vllm_compat import reread_environment
    from vllm_plugin.weights.endpoint import WeightsEndpoint

    def engine(config):
        return Namespace(vllm_config=Namespace(weight_transfer_config=config))

    def start(served, api_key):
        state = State()
        asyncio.run(WeightsEndpoint().init_state(served, state, Namespace(api_key=api_key)))
        return state

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.setenv("GRPO_SPECDEC_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    with pytest.raises(RuntimeError, match="start vllm serve with --api-key"):
        start(object(), None)
    # The inference key may not change weights: the route needs a token of its own.
    monkeypatch.delenv("GRPO_SPECDEC_WEIGHTS_TOKEN")
    with pytest.raises(RuntimeError, match="set GRPO_SPECDEC_WEIGHTS_TOKEN to a token of its own"):
        start(engine(WeightTransferConfig(backend="grpo_shm")), ["k"])
    monkeypatch.setenv("GRPO_SPECDEC_WEIGHTS_TOKEN", "k")
    with pytest.raises(RuntimeError, match="not the API key"):
        start(engine(WeightTransferConfig(backend="grpo_shm")), ["k"])
    monkeypatch.setenv("GRPO_SPECDEC_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    # Without a transfer engine every swap would fail inside the workers (a 500): the route
    # refuses to start, naming the flag.
    with pytest.raises(RuntimeError, match='--weight-transfer-config \'{"backend": "grpo_shm"}\''):
        start(engine(None), ["k"])
    served = engine(WeightTransferConfig(backend="grpo_shm"))
    states = []
    assert not plugin_log_lines(caplog, logging.ERROR, lambda: states.append(start(served, ["k"])))
    assert states[0].grpo_engine is served
    # vLLM's dev routes take no key: beside them the route's keys guard nothing.
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    reread_environment()  # vLLM caches its variables once an engine ran in this process
    (said,) = plugin_log_lines(caplog, logging.ERROR, lambda: start(served, ["k"]))
    assert said.startswith("VLLM_SERVER_DEV_MODE is set")


def test_trl_vllm_serve_runs_the_plugin(tiny_target, tiny_draft, job_profile, questions, tmp_path):
    """TRL's server is `vllm serve` with TRL's settings; it forwards the arguments it does
    not know, so the plugin's scheduler and extension pass through."""
    from openai import OpenAI

    trl = readme_command(
        "trl vllm-serve", tiny_target, tiny_draft, free_port(), *profile_settings(job_profile)
    )
    proc, url = start_server(trl, {}, tmp_path / "trl.log")
    try:
        out = OpenAI(base_url=f"{url}/v1", api_key="unused").completions.create(
            model=tiny_target, prompt=questions[:4], n=4, temperature=1.0, max_tokens=16
        )
        assert len(out.choices) == 16
        with urllib.request.urlopen(f"{url}/metrics") as resp:
            assert "vllm:grpo_specdec_num_spec_tokens_per_step_count" in resp.read().decode()
        # A TRL trainer pushes the draft as it pushes its policy, through vLLM's RL routes
        # (TRL's server turns them on): here a scrambled head, whose drafts the served
        # engine then rejects.
        from safetensors.torch import load_file

        loaded = _served_acceptance(url, tiny_target, questions[:8])
        _push_draft(url, scrambled(load_file(Path(tiny_draft) / "model.safetensors")), 1)
        assert 2 * _served_acceptance(url, tiny_target, questions[:8]) < loaded
    finally:
        stop_server(proc)
    assert (
        "--scheduler-cls vllm_plugin.scheduler.ConcurrencyAwareScheduler"
        in (tmp_path / "trl.log").read_text()
    )  # TRL printed the `vllm serve` command it ran, with the plugin in it
