"""Shared fixtures: tiny model assets (built once, cached by source hash) and shared engines.

Engine start-up costs seconds, so each engine configuration is started once per session
and shared by every test that needs it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSET_SOURCES = [
    "grpo_specdec/assets/tiny.py",
    "grpo_specdec/tasks/arithmetic.py",
    "grpo_specdec/draft/head.py",
    "grpo_specdec/draft/loss.py",
    "grpo_specdec/draft/trainer.py",
    "grpo_specdec/draft/capture.py",
]


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


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    out = _assets_cache()
    if not (out / "draft-reduced" / "model.safetensors").is_file():
        proc = run_cli("models", "tiny", "--out", str(out))
        assert proc.stdout.strip().splitlines()[-1] == str(out)
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_models) -> str:
    return str(tiny_models / "target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_models) -> str:
    return str(tiny_models / "draft")


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

    engine = Engine(tiny_engine_config(tiny_target))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def eagle_engine(tiny_target, tiny_draft):
    from grpo_specdec.engine import Engine

    engine = Engine(tiny_engine_config(tiny_target, tiny_draft))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def questions() -> list[str]:
    from grpo_specdec.tasks.arithmetic import make_problems

    return [p.question for level in (1, 2, 3) for p in make_problems(6, seed=123, level=level)]


def assert_same_distribution(lhs, rhs, positions: range, samples: int) -> None:
    """Per prompt and position, the tokens of two T = 1 generations (`samples` each) are
    as close as two samples of one distribution: total variation below 0.4. Two samples
    of 200 from one distribution over the tiny vocabulary differ by ~0.15-0.25; a sampler
    that ignored the temperature (greedy) or the target puts all on one token: ~0.7+."""
    for position in positions:
        for prompt in range(len(lhs.outputs)):
            a = Counter(s.token_ids[position] for s in lhs.outputs[prompt])
            b = Counter(s.token_ids[position] for s in rhs.outputs[prompt])
            tv = 0.5 * sum(abs(a[t] - b[t]) for t in a.keys() | b.keys()) / samples
            assert tv < 0.4, (position, prompt, tv)


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
