"""`grpo-specdec profile`: its input checks and where the scheduler finds what it saves."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from grpo_specdec import profile
from grpo_specdec.cli import build_parser
from grpo_specdec.engine import Engine
from grpo_specdec.simulate import load_profile
from tests.conftest import run_cli, tiny_engine_config


def test_profile_without_a_draft_fails_before_any_engine(tiny_target, tmp_path):
    out = tmp_path / "profile.json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--model", tiny_target, "--out", str(out)])
    with pytest.raises(ValidationError, match="draft"):
        profile.ProfileConfig(model=tiny_target)
    proc = run_cli("profile", "--model", tiny_target, "--out", str(out), check=False)
    assert proc.returncode == 2 and "required: --draft" in proc.stderr
    assert "vllm" not in proc.stderr.lower()  # vLLM was not even imported


def test_scheduler_finds_the_profile_saved_for_dtype_auto(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty profile store
    rows = [
        {"batch": b, "k": k, "tokens": b * (k + 1), "ms": 5.0 + b * (k + 1) + k, "samples": 4}
        for b in (1, 2, 4)
        for k in (0, 1, 2)
    ]
    shape = {"runner": "V1", "async_scheduling": False, "cudagraph_mode": "NONE"}
    monkeypatch.setattr(profile, "measure", lambda cfg, log: (rows, shape))  # no timing needed
    cfg = profile.ProfileConfig(model=tiny_target, draft=tiny_draft, dtype="auto")
    profile.run_profile(cfg, tmp_path / "profile.json", log=lambda msg: None)
    # A goodput engine given no profile looks it up in the store as it starts.
    engine = Engine(
        tiny_engine_config(
            tiny_target,
            dtype="auto",
            max_num_seqs=8,
            speculative={"draft": tiny_draft, "k": 2, "concurrency_aware": True},
        )
    )
    try:
        assert engine.scheduler().policy.costs.base.c_peak == pytest.approx(
            json.loads((tmp_path / "profile.json").read_text())["latency"]["c_peak"]
        )
    finally:
        engine.shutdown()


def test_profile_times_a_long_context_and_fits_its_attention_term(
    tiny_target, tiny_draft, tmp_path
):
    cfg = profile.ProfileConfig(
        model=tiny_target,
        draft=tiny_draft,
        k_max=1,
        batch_sizes=[1, 2, 4],
        steps=4,
        max_model_len=256,
        enforce_eager=True,
    )
    rows, engine = profile.measure(cfg, log=lambda msg: None)
    # what vLLM decided for the timed engine on CPU: V1, synchronous, no CUDA graphs
    assert engine == {"runner": "V1", "async_scheduling": False, "cudagraph_mode": "NONE"}
    prefills = [r for r in rows if r.get("prefill")]
    steps = [r for r in rows if not r.get("prefill")]
    greedy = [r for r in steps if r["temperature"] == 0.0]
    short = [r for r in greedy if not r["long_context"]]
    long = [r for r in greedy if r["long_context"]]
    sampled = [r for r in steps if r["temperature"] == 1.0]
    assert {(r["batch"], r["k"]) for r in short} == {(b, k) for b in (1, 2, 4) for k in (0, 1)}
    assert {(r["batch"], r["k"]) for r in long} == {(1, 0), (1, 1), (4, 0), (4, 1)}
    # A greedy profile times some steps again sampling at T = 1, and every batch's prefill.
    assert {(r["batch"], r["k"]) for r in sampled} == {(1, 0), (1, 1), (4, 0), (4, 1)}
    assert all(not r["long_context"] for r in sampled)
    assert sorted(r["batch"] for r in prefills) == [1, 2, 4]
    assert all(r["ms"] > 0 for r in prefills)
    assert prefills[-1]["prompt_tokens"] > prefills[0]["prompt_tokens"]
    # The long prompts fill half the context (128 of 256 tokens): far beyond the short ones.
    assert min(r["context"] for r in long) == 128 + cfg.steps / 2
    assert max(r["context"] for r in short) < 100
    built = profile.build_profile(cfg, rows, engine)
    assert built["engine"] == engine and built["key"]["tensor_parallel_size"] == 1
    latency = built["latency"]
    assert latency["attention"] >= 0
    assert built["unprofiled"]["prefill_ms_per_token"] > 0
    assert built["unprofiled"]["sampling_ms_per_token"] >= 0
    # The simulator reads them from the profile file.
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(built))
    _, unprofiled = load_profile(out)
    assert unprofiled.prefill_ms_per_token == built["unprofiled"]["prefill_ms_per_token"]
    assert latency["context"] == pytest.approx(sum(r["context"] for r in short) / len(short))


def test_a_profile_timed_on_another_kind_of_engine_is_refused_by_field(tmp_path):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from vllm_plugin.settings import check_engine_shape

    def engine(v2: bool, mode: CUDAGraphMode, async_scheduling: bool):
        return SimpleNamespace(
            use_v2_model_runner=v2,
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
        )

    timed = {"engine": {"runner": "V1", "async_scheduling": False, "cudagraph_mode": "NONE"}}
    path = tmp_path / "profile.json"
    check_engine_shape(timed, path, engine(False, CUDAGraphMode.NONE, False))
    check_engine_shape({}, path, engine(True, CUDAGraphMode.FULL_AND_PIECEWISE, True))  # older
    with pytest.raises(
        ValueError,
        match=r"profile.json.*runner: profiled V1, this engine V2; "
        r"async_scheduling: profiled False, this engine True; cudagraph_mode: "
        r"profiled NONE, this engine FULL_AND_PIECEWISE",
    ):
        check_engine_shape(timed, path, engine(True, CUDAGraphMode.FULL_AND_PIECEWISE, True))
