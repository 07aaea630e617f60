"""Bad input to the job and the engine: one clear error naming the thing, before work starts."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from grpo_specdec.job.checkpoints import check_checkpoint
from tests.conftest import TINY_JOB_CONFIG, job_overrides, run_cli

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow


def _train(*args):
    return run_cli("train", *args, check=False, timeout=300)


def _config_error(*args) -> str:
    """The error `grpo-specdec train ARGS` stops with, raised in this process, in a second
    rather than the CLI's four (which prints it and exits with 2:
    test_malformed_yaml_names_the_line runs that in its own process)."""
    from grpo_specdec.cli import build_parser
    from grpo_specdec.config import ConfigError

    parsed = build_parser().parse_args(["train", *args])
    with pytest.raises((ConfigError, ValueError, FileNotFoundError)) as err:
        parsed.func(parsed)
    return str(err.value)


def test_malformed_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  policy: tiny\nrollout:\n  group_size: [4\n")
    proc = _train("--config", str(bad))
    assert proc.returncode == 2
    assert f"config file {bad} line" in proc.stderr and "not valid YAML" in proc.stderr


@pytest.mark.parametrize(
    "override,field",
    [
        ("rollout.group_size=1", "rollout.group_size"),
        ("policy.clip_eps=3", "policy.clip_eps"),
        ("rollout.speculation=sometimes", "rollout.speculation"),
        ("rollout.tempreature=1.0", "rollout.tempreature"),
        ("data.levels=[7]", "data.levels must lie in 1..4"),
        ("rollout.top_p=.nan", "rollout.top_p: Input should be a finite number"),
        ("policy.lr=.inf", "policy.lr: Input should be a finite number"),
        ("rollout.controller.alpha=.inf", "rollout.controller.alpha: Input should be a finite"),
        ("rollout.max_gen_batches=1000", "rollout.max_gen_batches: Input should be less than"),
    ],
)
def test_out_of_range_or_unknown_values_name_the_field(override, field):
    assert field in _config_error("--config", TINY_JOB_CONFIG, override)


def test_yaml_booleans_are_not_mistaken_for_values():
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job.config import TrainConfig

    # YAML 1.1 reads a bare `off` as false; it still means "no speculation".
    cfg = load_yaml(TrainConfig, TINY_JOB_CONFIG, ["rollout.speculation=off"])
    assert cfg.rollout.speculation == "off"
    with pytest.raises(ValueError, match="rollout.speculation"):
        load_yaml(TrainConfig, TINY_JOB_CONFIG, ["rollout.speculation=on"])


def test_an_override_whose_value_is_not_yaml_names_the_override():
    message = _config_error("--config", TINY_JOB_CONFIG, "rollout.k=[1,")
    assert message.startswith("override 'rollout.k=[1,': the value '[1,' of rollout.k is not")


def test_a_data_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"question": "q", "answer": "#### 4"}\n{"question": "caf\xe9"}\n')
    message = _config_error(
        "--config", TINY_JOB_CONFIG, "data.source=jsonl", f"data.path={latin}", f"out={tmp_path}/o"
    )
    assert message.startswith(f"{latin} line 2: not UTF-8 (byte 0xe9")


def test_empty_and_corrupt_datasets(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _train(
        "--config",
        TINY_JOB_CONFIG,
        "data.source=jsonl",
        f"data.path={empty}",
        f"out={tmp_path / 'o1'}",
    )
    assert proc.returncode == 2 and "holds no examples" in proc.stderr
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"question": "q", "answer": "#### 4"}\n\x00\x01garbage\n')
    proc = _train(
        "--config",
        TINY_JOB_CONFIG,
        "data.source=jsonl",
        f"data.path={corrupt}",
        f"out={tmp_path / 'o2'}",
    )
    assert proc.returncode == 2 and "corrupt.jsonl line 2: not valid JSON" in proc.stderr
    missing = _train(
        "--config", TINY_JOB_CONFIG, "data.source=jsonl", f"data.path={tmp_path / 'nope.jsonl'}"
    )
    assert missing.returncode == 2 and "nope.jsonl does not exist" in missing.stderr


def test_mismatched_tokenizer(tiny_target, tmp_path):
    from grpo_specdec.assets.smollm2 import prepare_smollm2

    bad = tmp_path / "model"
    shutil.copytree(tiny_target, bad)
    shutil.copy(
        prepare_smollm2() / "tokenizer.json", bad / "tokenizer.json"
    )  # 49k-token vocabulary
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    proc = run_cli(
        "generate",
        "--model",
        str(bad),
        "--prompts",
        str(prompts),
        "--json",
        "/dev/null",
        check=False,
    )
    assert proc.returncode == 2
    assert (
        "tokenizer" in proc.stderr
        and "vocab_size is" in proc.stderr
        and "do not match" in proc.stderr
    )


def test_draft_for_another_model(tiny_target, tmp_path):
    from grpo_specdec.assets.smollm2 import prepare_smollm2

    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    # SmolLM2 itself is no EAGLE head, and its sizes are another model's.
    proc = run_cli(
        "generate",
        "--model",
        tiny_target,
        "--draft",
        str(prepare_smollm2()),
        "--prompts",
        str(prompts),
        "--json",
        "/dev/null",
        check=False,
    )
    assert proc.returncode == 2 and "expected one of ['EagleLlamaForCausalLM'" in proc.stderr


def test_job_context_longer_than_the_model_allows(tiny_target, tiny_draft, job_profile, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--config",
        TINY_JOB_CONFIG,
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 1),
        "rollout.max_model_len=100000",
        check=False,
    )
    assert proc.returncode == 2
    assert "rollout.max_model_len: max_model_len=100000 exceeds" in proc.stderr
    assert not out.exists()  # refused before the run folder, Ray or any role


def _make_checkpoint(tiny_target, tiny_draft, job_profile, tmp_path):
    out = tmp_path / "run"
    run_cli(
        "train",
        "--config",
        TINY_JOB_CONFIG,
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 1),
        timeout=600,
    )
    return out, out / "checkpoints" / "iter_000001"


def test_corrupt_or_truncated_checkpoint(tiny_target, tiny_draft, job_profile, tmp_path):
    out, ckpt = _make_checkpoint(tiny_target, tiny_draft, job_profile, tmp_path)
    check_checkpoint(ckpt)
    overrides = job_overrides(tiny_target, tiny_draft, job_profile, out, 2)

    weights = ckpt / "policy" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    proc = _train("--config", TINY_JOB_CONFIG, *overrides, "--resume", str(out))
    assert proc.returncode == 2 and "model.safetensors is truncated or corrupt" in proc.stderr
    weights.write_bytes(data)

    state = ckpt / "policy_state.pt"
    blob = bytearray(state.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 64] = b"\xff" * 64  # flipped bytes
    state.write_bytes(bytes(blob))
    proc = _train("--config", TINY_JOB_CONFIG, *overrides, "--resume", str(out))
    assert proc.returncode == 2 and "policy_state.pt is corrupt" in proc.stderr

    (ckpt / "state.json").write_text(json.dumps({"iteration": 1}))
    proc = _train("--config", TINY_JOB_CONFIG, *overrides, "--resume", str(out))
    assert proc.returncode == 2 and "state.json lacks ['cursor', 'python_rng']" in proc.stderr


def _write_marker(path: str) -> None:
    Path(path).write_text("code ran")


class _PickledCall:
    """Unpickling this calls _write_marker: the harmless stand-in for code a checkpoint
    from elsewhere could carry (os.system, ...)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (str(self.marker),))


@pytest.fixture(scope="module")
def learners(tiny_target, tiny_draft):
    from grpo_specdec.draft.learner import DraftLearner
    from grpo_specdec.draft.trainer import DraftTrainConfig
    from grpo_specdec.job.config import PolicySettings
    from grpo_specdec.job.learners import PolicyLearner

    return {
        "policy": PolicyLearner(tiny_target, PolicySettings()),
        "draft": DraftLearner(tiny_target, tiny_draft, DraftTrainConfig()),
    }


@pytest.mark.parametrize("role", ["policy", "draft"])
def test_learner_state_with_pickled_code_is_refused(learners, tmp_path, role):
    for learner in learners.values():
        learner.save(tmp_path)
    state = {"iteration": 0, "cursor": 0, "python_rng": random.getstate()}
    (tmp_path / "state.json").write_text(json.dumps(state))
    check_checkpoint(tmp_path)
    learners[role].load(tmp_path)  # the learner's own state loads as plain data

    file = tmp_path / f"{role}_state.pt"
    marker = tmp_path / "marker"
    payload = torch.load(file, weights_only=True)
    payload["version"] = _PickledCall(marker)
    torch.save(payload, file)
    refused = re.escape(f"{file} holds more than tensors and plain data; refusing to load it")
    with pytest.raises(ValueError, match=refused):
        check_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=refused):
        learners[role].load(tmp_path)
    assert not marker.exists()
    torch.load(file, weights_only=False)  # the payload is live: an unchecked load runs it
    assert marker.read_text() == "code ran"


# ---- the weight swap folder ------------------------------------------------------------


@pytest.fixture
def private_base(tmp_path, monkeypatch):
    """Swap folders made under tmp_path instead of /dev/shm (where real swaps go)."""
    from vllm_plugin.weights import swap_folder

    monkeypatch.setattr(swap_folder, "SHARED_MEMORY", tmp_path)
    return tmp_path


def test_swap_folder_is_made_private_and_a_squatted_one_is_passed_by(
    private_base, tmp_path, monkeypatch, caplog
):
    """The shared-memory folder's name can be guessed: one that another user made first,
    or opened to others, is neither used nor repaired; swaps go through a private folder
    in the user's cache, and the log names the squatted folder and its owner."""
    import logging
    import os
    import stat

    from vllm_plugin.weights import swap_folder as module
    from vllm_plugin.weights.manifest import WeightSwapError
    from vllm_plugin.weights.swap_folder import swap_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "_said", set())
    folder = swap_folder()
    assert folder == private_base / f"grpo-specdec-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    fallback = tmp_path / "cache" / "grpo-specdec" / f"swap-{os.getuid()}"

    folder.chmod(0o777)  # opened to others (or made so by whoever made it first)
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        assert swap_folder() == fallback
    assert f"swap folder {folder} has mode 0777, not 0700" in caplog.text
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777  # not repaired
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    folder.rmdir()

    elsewhere = private_base / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder.symlink_to(elsewhere)
    assert swap_folder() == fallback

    # Seen as another user (uid 4242), whose names here were all taken by this one: the
    # owner is named, and with no private folder left the swap is refused.
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    (private_base / "grpo-specdec-4242").mkdir(mode=0o700)
    with pytest.raises(
        WeightSwapError,
        match=r"grpo-specdec-4242 is owned by \S+ \(uid \d+\), not by this user \(uid 4242\)"
        r".*swap-4242 is owned by",
    ):
        swap_folder()


def test_swap_files_outside_the_engine_s_swap_folder_are_refused(private_base, tmp_path):
    """An engine opens weight files only directly inside its own folder: not a file
    elsewhere, nor a link, nor one in the user's swap folder or another engine's (what a
    caller of one server could otherwise name to have it load another server's weights)."""
    import os

    from vllm_plugin.weights.manifest import WeightSwapError
    from vllm_plugin.weights.swap_folder import engine_swap_folder, open_swap_file, swap_folder

    ours, theirs = engine_swap_folder("ours"), engine_swap_folder("theirs")
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"not for the swap route")
    inside = ours / "policy-v1.safetensors"
    inside.write_bytes(b"weights")
    link = ours / "policy-v2.safetensors"
    link.symlink_to(outside)
    another = theirs / "policy-v4.safetensors"
    another.write_bytes(b"another server's weights")
    shared = swap_folder() / "policy-v5.safetensors"
    shared.write_bytes(b"weights in no engine's folder")
    for path in (outside, link, ours / ".." / "theirs" / another.name, another, shared):
        with pytest.raises(
            WeightSwapError, match=f"refused weight file {path}: .* swap folder {ours}"
        ):
            open_swap_file(str(path), ours)
    with pytest.raises(WeightSwapError) as refused:  # a link's target is not told
        open_swap_file(str(link), ours)
    assert str(outside) not in str(refused.value)
    with pytest.raises(WeightSwapError, match="does not exist"):
        open_swap_file(str(ours / "policy-v3.safetensors"), ours)
    fd = open_swap_file(str(inside), ours)
    inside.unlink()  # its writer gave up; what was opened stays readable
    assert os.read(fd, 100) == b"weights"
    os.close(fd)


def test_an_out_folder_others_can_write_is_refused(tiny_target, tiny_draft, tmp_path):
    """Every vLLM process of the job runs the logging config written to `out` (its handler
    factories are code) and the job loads its checkpoints back from there."""
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o777)
    error = _config_error(
        "--config", TINY_JOB_CONFIG, f"model.policy={tiny_target}", f"model.draft={tiny_draft}",
        f"out={out}",
    )  # fmt: skip
    assert f"out={out} has mode 0777: others can write it (chmod go-w)" in error
    assert not (out / "vllm_logging.json").exists()
