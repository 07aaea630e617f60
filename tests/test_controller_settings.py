"""The controller's settings reach the engine core in vLLM's own config, and bad ones are
refused by field."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.conftest import engine_kwargs, tiny_engine_config
from vllm_plugin.settings import CONFIG_KEY, ControllerSettings


def test_an_engine_s_controller_settings_travel_in_its_config_not_the_environment(
    monkeypatch, tiny_target, tiny_draft
):
    controller = {"acceptance_prior": 0.3, "acceptance_optimism": 2.0, "trace_steps": 7}
    speculative = {"draft": tiny_draft, "k": 3, "controller": controller}
    cfg = tiny_engine_config(tiny_target, tiny_draft, speculative=speculative)
    config = EngineArgs(**engine_kwargs(monkeypatch, cfg)).create_engine_config()
    settings = ControllerSettings.of_engine(config)
    assert settings == ControllerSettings(**controller)
    assert settings != ControllerSettings()
    assert not any(name.startswith("GRPO_SPECDEC") for name in os.environ)


def test_an_engine_without_settings_runs_on_the_defaults():
    assert ControllerSettings.of_engine(SimpleNamespace(additional_config={})) == (
        ControllerSettings()
    )


def test_a_bad_setting_is_refused_by_field():
    config = SimpleNamespace(additional_config={CONFIG_KEY: {"acceptance_prior": 2.0}})
    with pytest.raises(
        ValueError, match=r"(?s)additional_config\['grpo_specdec'\].*acceptance_prior"
    ):
        ControllerSettings.of_engine(config)
    config = SimpleNamespace(additional_config={CONFIG_KEY: {"acceptance_prio": 0.5}})
    with pytest.raises(ValueError, match="acceptance_prio"):
        ControllerSettings.of_engine(config)


def test_settings_left_in_the_environment_are_refused_with_where_they_go(monkeypatch):
    monkeypatch.setenv("GRPO_SPECDEC_CONTROLLER", '{"profile": "p.json"}')
    with pytest.raises(
        ValueError, match=r"""additional_config=\{"grpo_specdec": \{"profile": "p.json"\}\}"""
    ):
        ControllerSettings.of_engine(SimpleNamespace(additional_config={}))


def test_a_corrupt_or_foreign_profile_is_named_with_what_is_wrong(tmp_path):
    from vllm_plugin.settings import read_profile

    cut = tmp_path / "cut.json"
    cut.write_text('{"latency": {"target": ')
    with pytest.raises(ValueError, match=rf"^latency profile {cut}: not valid JSON \(line 1"):
        read_profile(cut)
    other = tmp_path / "other.json"
    other.write_text('{"something": 1}')
    with pytest.raises(ValueError, match=rf"^latency profile {other}: not a profile"):
        read_profile(other)


def test_the_job_names_a_corrupt_profile_before_its_engines_start(tmp_path):
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.engine_setup import latency_profile
    from tests.conftest import TINY_JOB_CONFIG

    cut = tmp_path / "cut.json"
    cut.write_text("{")
    cfg = load_yaml(
        TrainConfig,
        TINY_JOB_CONFIG,
        ["rollout.speculation=concurrency_aware", f"rollout.controller.profile={cut}"],
    )
    with pytest.raises(ValueError, match=rf"^latency profile {cut}: not valid JSON"):
        latency_profile(cfg, "policy", "draft", print)


def _engine_config(monkeypatch, target: str, draft: str, profile: str):
    speculative = {"draft": draft, "k": 3, "controller": {"profile": profile}}
    cfg = tiny_engine_config(target, draft, speculative=speculative)
    return EngineArgs(**engine_kwargs(monkeypatch, cfg)).create_engine_config()


def test_a_profile_named_for_another_engine_is_refused_with_each_difference(
    monkeypatch, tmp_path, tiny_target, tiny_draft
):
    from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost
    from vllm_plugin.settings import find_latency, profile_key

    latency = LatencyModel(HingeLatency(10.0, 0.1, 0.0), LinearCost(1.0, 0.0)).to_dict()
    key = profile_key(tiny_target, "float32", tiny_draft)
    path = tmp_path / "p.json"

    def named(**changed):
        path.write_text(json.dumps({"key": key | changed, "latency": latency}))
        config = _engine_config(monkeypatch, tiny_target, tiny_draft, str(path))
        return find_latency(ControllerSettings.of_engine(config), config)

    assert named()[0] is not None
    # another folder of the same model (a run's checkpoint) is priced alike
    assert named(model="/runs/x/checkpoints/iter_000005/policy")[0] is not None
    with pytest.raises(ValueError) as refused:
        named(dtype="bfloat16", hardware="another CPU")
    said = str(refused.value)
    assert said.startswith(f"latency profile {path} was timed for another engine")
    assert "dtype: profiled bfloat16, this engine float32" in said
    assert "hardware: profiled another CPU, this engine" in said
    with pytest.raises(
        ValueError, match="draft_sampling: profiled probabilistic, this engine greedy"
    ):
        named(draft_sampling="probabilistic")
    # a profile written by hand names no engine: nothing to compare
    path.write_text(json.dumps({"latency": latency}))
    config = _engine_config(monkeypatch, tiny_target, tiny_draft, str(path))
    assert find_latency(ControllerSettings.of_engine(config), config)[0] is not None
