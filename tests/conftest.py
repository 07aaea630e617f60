"""Shared fixtures: tiny model assets (built once, cached by source hash) and shared engines.

Engine start-up costs seconds, so each engine configuration is started once per session
and shared by every test that needs it (once per xdist worker under `make test`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSET_SOURCES = [
    "grpo_specdec/assets/tiny.py",
    "grpo_specdec/tasks/arithmetic.py",
    "grpo_specdec/draft/head.py",
    "grpo_specdec/draft/head_model.py",
    "grpo_specdec/draft/loss.py",
    "grpo_specdec/draft/trainer.py",
    "grpo_specdec/draft/capture.py",
]


def pytest_configure(config) -> None:
    """Under xdist, worker N keeps to one core of this process's: vLLM's CPU threads (and
    every process a test starts, which inherits the mask) spin at their barriers, so two
    workers sharing both cores would keep stealing each other's step."""
    expected = os.environ.get("EXPECT_VLLM")  # `make test-vllm033`: this vLLM or nothing
    if expected:
        import vllm

        if vllm.__version__ != expected:
            pytest.exit(f"EXPECT_VLLM={expected}, but vllm is {vllm.__version__}", returncode=3)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


def pytest_collection_modifyitems(config, items) -> None:
    """Files with a slow test run first, each file's tests in their own order. xdist hands
    a worker the next whole file when it runs low (`--dist loadfile --no-loadscope-reorder`
    keeps this order), so the long files go out first and the short ones fill in the end,
    instead of one worker running the last long file alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def run_cli(
    *args: str, check: bool = True, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`grpo-specdec ARGS` in a fresh process; `env` is added to this process's environment."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_specdec", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"grpo-specdec {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _assets_cache() -> Path:
    digest = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in ASSET_SOURCES)).hexdigest()[
        :12
    ]
    base = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "grpo-specdec"
        / "test-assets"
    )
    return base / f"tiny-{digest}"


def tiny_assets(architecture: str = "llama") -> Path:
    """The tiny target of `architecture` and its heads (`grpo_specdec/assets/tiny.py`), built
    once per version of the code that makes them."""
    out = _assets_cache()
    if architecture != "llama":
        out = out.with_name(f"{out.name}-{architecture}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two xdist workers may both find the cache empty: one builds, the other waits.
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "draft-reduced" / "model.safetensors").is_file():
            proc = run_cli("models", "tiny", "--out", str(out), "--architecture", architecture)
            assert proc.stdout.strip().splitlines()[-1] == str(out)
    return out


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    return tiny_assets()


@pytest.fixture(scope="session")
def tiny_target(tiny_models) -> str:
    return str(tiny_models / "target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_models) -> str:
    return str(tiny_models / "draft")


def flattened_head(head: str, out, scale: float) -> str:
    """A copy of draft head `head` in folder `out` with its logits scaled by `scale`: a q
    flatter than the target's p (but overlapping it), accepted less."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(f"{head}/config.json", out)
    weights = load_file(f"{head}/model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, str(Path(out) / "model.safetensors"))
    return str(out)


def tiny_engine_config(target: str, draft: str | None = None, **overrides):
    from grpo_specdec.engine import EngineConfig

    base = dict(
        model=target,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=256,
        kv_cache_gib=0.25,
        enforce_eager=True,
        speculative={"draft": draft, "k": 3} if draft else None,
    )
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="session")
def tiny_reduced_draft(tiny_models) -> str:
    """The tiny head over the 256 most frequent tokens (EAGLE-3 format)."""
    return str(tiny_models / "draft-reduced")


@pytest.fixture(scope="session")
def plain_engine(tiny_target):
    from grpo_specdec.engine import Engine

    # Full next-token distributions for the lossless check (assert_same_distribution).
    engine = Engine(tiny_engine_config(tiny_target), max_logprobs=-1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def eagle_engine(tiny_target, tiny_draft):
    from grpo_specdec.engine import Engine

    engine = Engine(tiny_engine_config(tiny_target, tiny_draft))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def free_k0_engine(tiny_target, tiny_draft, tmp_path_factory):
    """EAGLE drafts with the free k = 0 patch, under a fixed cycle of k per step when a
    test generates through tests/step_cycle.py."""
    from tests.step_cycle import step_cycle_engine
    from vllm_plugin.patches.features import free_k0_v0_32 as free_k0

    engine = step_cycle_engine(tiny_target, tiny_draft, tmp_path_factory.mktemp("k0"), "greedy")
    yield engine
    free_k0.ENABLED = True
    engine.shutdown()


def group_controller(profile: str) -> dict:
    return {"profile": profile, "group": {"enabled": True}}


@pytest.fixture(scope="session")
def group_profile(tmp_path_factory) -> str:
    """Verification free up to 4096 tokens a step: every group draft pays, whatever the batch."""
    import json

    from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost

    latency = LatencyModel(HingeLatency(40.0, 4.0, 4096.0), LinearCost(0.2, 0.01))
    path = tmp_path_factory.mktemp("group") / "profile.json"
    path.write_text(json.dumps({"latency": latency.to_dict()}))
    return str(path)


@pytest.fixture(scope="session")
def group_engine(tiny_target, group_profile):
    """Drafts from the group's text alone (no draft model)."""
    from grpo_specdec.engine import Engine

    speculative = {"draft": None, "k": 4, "controller": group_controller(group_profile)}
    engine = Engine(tiny_engine_config(tiny_target, speculative=speculative))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def questions() -> list[str]:
    from grpo_specdec.tasks.arithmetic import make_problems

    return [p.question for level in (1, 2, 3) for p in make_problems(6, seed=123, level=level)]


# ---- lossless: T = 1 outputs against the target's exact next-token distributions ------------

# Each sampled token falls in one of four bins of its own context's target distribution:
# the most likely token; another with probability >= 0.05; 0.005-0.05; below 0.005. A
# sampler that is not the target's moves mass between them (towards the likely token:
# greedy, a draft accepted too often; away: a flat draft accepted too often, a wrong row
# of logits lands on tokens the target finds unlikely). The bins see a move away from the
# top token well, one towards it poorly (where the target is nearly sure there is no room
# to move towards it), so a second statistic weighs each top-token hit by the bias of
# DESIGN_TV towards the top that its context has room for. The bins, the threshold and the
# callers' samples were chosen by the calculation in tests/test_lossless_power.py.
PROBABILITY_CUTS = (0.05, 0.005)
DESIGN_TV = 0.05  # the bias towards the top token the second statistic is built to see
LOSSLESS_ALPHA = 1e-4  # nominal false alarms per call (split between the two statistics)
# The callers' sample: 3 prompts x 300 samples at T = 1, positions 1-10.
LOSSLESS_SAMPLES, LOSSLESS_POSITIONS = 300, range(1, 11)


def lossless_sampling(samples: int = LOSSLESS_SAMPLES):
    """The callers' T = 1 sampling: each sample long enough for LOSSLESS_POSITIONS."""
    from grpo_specdec.engine import SamplingSettings

    return SamplingSettings(
        n=samples, temperature=1.0, max_tokens=LOSSLESS_POSITIONS[-1] + 1, ignore_eos=True
    )


def target_distributions(engine, contexts: list[list[int]]):
    """p(. | context) of `engine`'s model at T = 1 over its full vocabulary, one row per
    context (`engine` must allow it: started with max_logprobs=-1)."""
    import numpy as np
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1, temperature=1.0, logprobs=-1, detokenize=False, flat_logprobs=True
    )
    raw = engine.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    logp = np.full((len(contexts), engine.llm.llm_engine.model_config.get_vocab_size()), -np.inf)
    for row, r in zip(logp, raw, strict=True):
        flat = r.outputs[0].logprobs
        row[flat.token_ids] = flat.logprobs
    return np.exp(logp)


@dataclass
class TargetFit:
    """How far the sampled tokens are from what the target predicts."""

    statistic: float  # squared Mahalanobis distance of the bin counts; chi2(df) if lossless
    df: int
    p_value: float
    observed: list[int]
    expected: list[float]
    top_z: float  # the weighted excess of top-token hits; about N(0, 1) if lossless
    top_p_value: float  # P(N(0, 1) > top_z): small when the top token comes too often
    top_noncentrality: float  # top_z's mean if every token carried a DESIGN_TV bias upwards

    @property
    def lossless(self) -> bool:
        return min(self.p_value, self.top_p_value) > LOSSLESS_ALPHA / 2


def target_fit(sampled, reference, positions: range) -> TargetFit:
    """`sampled`: a GenerationResult at T = 1, top_p = 1, every sample at least
    max(positions) + 1 tokens long; `reference`: an engine on the same target without
    speculation. Each sampled token's bin is drawn, given everything before it, from the
    target's bin masses in its context, so the count vector's mean and covariance are
    exact sums over the tokens and (martingale CLT) its squared Mahalanobis distance is
    chi-square with len(PROBABILITY_CUTS) + 1 degrees of freedom.

    The top-token statistic is the score test against q = p with d = min(DESIGN_TV,
    1 - p_top) moved to the top token from the others in proportion: each token adds
    d (hit - p_top) / (p_top (1 - p_top)), whose variance d^2 / (p_top (1 - p_top)) is
    known from its context, so the standardised sum is N(0, 1) by the same CLT."""
    import math

    import numpy as np
    import torch

    contexts: dict[tuple[int, ...], int] = {}
    tokens = []  # (context row, sampled token)
    for prompt, group in zip(sampled.prompt_token_ids, sampled.outputs, strict=True):
        for sample in group:
            ids = sample.token_ids
            assert len(ids) > positions[-1], f"a sample of {len(ids)} tokens: use ignore_eos"
            for t in positions:
                row = contexts.setdefault((*prompt, *ids[:t]), len(contexts))
                tokens.append((row, ids[t]))
    p = target_distributions(reference, [list(c) for c in contexts])
    bins = 1 + (p[..., None] < np.array(PROBABILITY_CUTS)).sum(-1)
    bins[np.arange(len(p)), p.argmax(1)] = 0
    num_bins = len(PROBABILITY_CUTS) + 2
    bin_mass = np.stack([(p * (bins == b)).sum(1) for b in range(num_bins)], 1)
    rows, ids = np.array(tokens).T
    masses = bin_mass[rows]
    token_bins = bins[rows, ids]
    observed = np.bincount(token_bins, minlength=num_bins)
    expected = masses.sum(0)
    covariance = np.diag(expected) - masses.T @ masses
    # The counts sum to the number of tokens: drop one bin to make the covariance invertible.
    d = (observed - expected)[:-1]
    statistic = float(d @ np.linalg.solve(covariance[:-1, :-1], d))
    df = num_bins - 1
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64),
            torch.tensor(statistic / 2.0, dtype=torch.float64),
        )
    )
    p_top = masses[:, 0]
    room = np.minimum(DESIGN_TV, 1.0 - p_top)
    live = room > 1e-9  # a context sure of its top token cannot be biased towards it
    spread = p_top[live] * (1.0 - p_top[live])
    score = float((room[live] * ((token_bins[live] == 0) - p_top[live]) / spread).sum())
    variance = float((room[live] ** 2 / spread).sum())
    top_z = score / math.sqrt(variance) if variance > 0 else 0.0
    return TargetFit(
        statistic,
        df,
        p_value,
        observed.tolist(),
        expected.round(1).tolist(),
        top_z,
        0.5 * math.erfc(top_z / math.sqrt(2.0)),
        math.sqrt(variance),
    )


def assert_same_distribution(sampled, reference, positions: range = LOSSLESS_POSITIONS) -> None:
    """The tokens at `positions` of a T = 1 generation follow the target's distribution
    (see target_fit): fails a lossless engine with probability about LOSSLESS_ALPHA."""
    fit = target_fit(sampled, reference, positions)
    assert fit.lossless, fit


# ---- the GRPO job on tiny models -------------------------------------------------------

TINY_JOB_CONFIG = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="session")
def job_profile(tmp_path_factory) -> str:
    """A latency profile for the tiny job (measuring one would only time overheads)."""
    import json

    from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost

    latency = LatencyModel(
        HingeLatency(flat=10.0, slope=1.0, knee=16.0), LinearCost(base=0.5, per_seq=0.05)
    )
    path = tmp_path_factory.mktemp("job_profile") / "profile.json"
    path.write_text(json.dumps({"latency": latency.to_dict()}))
    return str(path)


def job_overrides(target: str, draft: str, profile: str, out, iterations: int) -> list[str]:
    return [
        f"model.policy={target}",
        f"model.draft={draft}",
        f"rollout.controller.profile={profile}",
        f"out={out}",
        f"iterations={iterations}",
        "data.levels=[1]",
    ]


def job_records(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def bare_scheduler(requests: dict | None = None):
    """The plugin's scheduler bookkeeping (`ConcurrencyAwareMixin`) over a stub of vLLM's
    Scheduler, with the state `_init_controller` gives it and vLLM's `requests`: for
    tests of what it counts, without an engine."""
    from collections import Counter, deque

    from vllm_plugin.acceptance import AcceptanceEstimator
    from vllm_plugin.goodput_controller import GoodputController
    from vllm_plugin.scheduler import ConcurrencyAwareMixin

    class Base:
        def update_draft_token_ids(self, draft_token_ids):
            pass

        def make_spec_decoding_stats(self, stats, *args):
            return stats

    class Scheduler(ConcurrencyAwareMixin, Base):
        pass

    scheduler = Scheduler()
    scheduler.controller = GoodputController(None, AcceptanceEstimator(4), 8)
    scheduler.draft_sources, scheduler.draft_events = {}, deque()
    scheduler.verified_by_source, scheduler.verified_before_eos = Counter(), Counter()
    scheduler.requests = requests or {}
    return scheduler


def scrambled(weights: dict) -> dict:
    """The same tensors with their rows shuffled (seeded): a head of the right names and
    shapes whose drafts the target rarely accepts."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {k: v[torch.randperm(v.shape[0], generator=g)] for k, v in weights.items()}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for servers a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugin_log_lines(caplog, level: int, action) -> list[str]:
    """The plugin's log lines while `action()` runs, as vLLM's configured "vllm" logger
    receives them (it does not propagate to the root, where caplog listens: a record that
    reaches caplog here is one vLLM's own handler prints)."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="vllm.vllm_plugin"):
            action()
    finally:
        vllm_logger.removeHandler(caplog.handler)
    # where "vllm" does propagate (vLLM not configured yet), a record arrives twice
    records = {id(r): r for r in caplog.records if r.name.startswith("vllm.vllm_plugin")}
    return [r.getMessage() for r in records.values()]


def unset_until_teardown(monkeypatch, name: str) -> None:
    """Unset `name` now and restore it after the test, whatever sets it in between
    (`monkeypatch.delenv` records nothing for a variable that is not set)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


class EngineArgsSeen(Exception):
    pass


def engine_kwargs(monkeypatch, cfg) -> dict:
    """The arguments `Engine(cfg)` gives vLLM's LLM (the engine is not started)."""
    import vllm

    from grpo_specdec.engine import Engine

    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise EngineArgsSeen

    monkeypatch.setattr(vllm, "LLM", llm)
    unset_until_teardown(monkeypatch, "VLLM_ENABLE_V1_MULTIPROCESSING")  # Engine sets it
    with pytest.raises(EngineArgsSeen):
        Engine(cfg)
    return seen
