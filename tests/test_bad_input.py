"""Bad input gets one clear error naming what is wrong, before any engine starts."""

from __future__ import annotations

import json
import shutil

from tests.conftest import run_cli


def _generate(*args):
    return run_cli("generate", "--eager", "--json", "/dev/null", *args, check=False, timeout=120)


def test_missing_model_folder(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    proc = _generate("--model", str(tmp_path / "nope"), "--prompts", str(prompts))
    assert proc.returncode == 2
    assert "model: folder" in proc.stderr and "nope does not exist" in proc.stderr


def test_empty_prompts_file(tiny_target, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n  \n")
    proc = _generate("--model", tiny_target, "--prompts", str(prompts))
    assert proc.returncode == 2
    assert f"prompts file {prompts} holds no prompts" in proc.stderr


def _draft_with(tmp_path, tiny_draft, **changes):
    bad = tmp_path / "bad_draft"
    shutil.copytree(tiny_draft, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(changes)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_draft_for_another_hidden_size(tiny_target, tiny_draft, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    bad = _draft_with(tmp_path, tiny_draft, hidden_size=256)
    proc = _generate("--model", tiny_target, "--draft", str(bad), "--prompts", str(prompts))
    assert proc.returncode == 2
    assert "hidden_size=256" in proc.stderr and "hidden_size=128" in proc.stderr


def test_draft_for_another_vocabulary(tiny_target, tiny_draft, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    bad = _draft_with(tmp_path, tiny_draft, vocab_size=49152)
    proc = _generate("--model", tiny_target, "--draft", str(bad), "--prompts", str(prompts))
    assert proc.returncode == 2
    assert "vocab_size=49152" in proc.stderr


def test_context_longer_than_the_model_allows(tiny_target, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    proc = _generate("--model", tiny_target, "--prompts", str(prompts), "--max-model-len", "4096")
    assert proc.returncode == 2
    assert "max_model_len=4096 exceeds" in proc.stderr and "allows 1024 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
