"""Published draft-head layouts (`grpo_specdec/draft/formats.py`), built here from the tiny
heads in each exact public key layout (no download): EAGLE-1 as its authors publish it, a
nested "eagle" config, EAGLE-3 with `midlayer.*`/`d2t`/`t2d`, and `speculators`. Each is
imported, served by vLLM exactly as the native head, and keeps learning; a head that does not
fit is refused with the part named."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_specdec.draft.formats import HeadFormatError, import_head
from tests.conftest import run_cli


def _native(folder) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


def _config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def target_embedding(target) -> torch.Tensor:
    """The tiny target's embedding as its checkpoint holds it (tied: also its lm_head)."""
    return load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"]


def eagle1_published(tiny_target, tiny_draft, out: Path, nested: bool = False, bias=0.0) -> Path:
    """The EAGLE authors' layout: a LlamaForCausalLM config, pytorch_model.bin with fc.bias
    and a copy of the target's embedding."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**_config(tiny_draft), "architectures": ["LlamaForCausalLM"]}
    if nested:
        cfg = {"model_type": "eagle", "model": cfg}
    (out / "config.json").write_text(json.dumps(cfg))
    weights = dict(_native(tiny_draft))
    weights["fc.bias"] = torch.full((weights["fc.weight"].shape[0],), bias)
    weights["embed_tokens.weight"] = target_embedding(Path(tiny_target)).clone()
    if nested:
        save_file({f"model.{k}": v for k, v in weights.items()}, str(out / "model.safetensors"))
    else:
        torch.save(weights, out / "pytorch_model.bin")
    return out


def eagle3_published(tiny_target, tiny_reduced_draft, out: Path, speculators=False) -> Path:
    """EAGLE-3's layout (midlayer.*, d2t and a t2d mask), or the speculators library's."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(tiny_reduced_draft)
    if speculators:
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": cfg["draft_vocab_size"],
            "transformer_layer_config": {k: v for k, v in cfg.items() if k != "architectures"},
        }
    (out / "config.json").write_text(json.dumps(cfg))
    weights = {}
    for name, tensor in _native(tiny_reduced_draft).items():
        if not speculators and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        weights[name] = tensor
    vocab = _config(tiny_target)["vocab_size"]
    d2t = weights["d2t"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t + torch.arange(len(d2t))] = True
    weights["t2d"] = t2d
    weights["embed_tokens.weight"] = target_embedding(Path(tiny_target)).clone()
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("layout", ["eagle1", "eagle1-nested", "eagle3", "speculators"])
def test_each_published_layout_imports_to_the_native_head(
    layout, tiny_target, tiny_draft, tiny_reduced_draft, tmp_path
):
    if layout.startswith("eagle1"):
        src = eagle1_published(tiny_target, tiny_draft, tmp_path / "src", nested="nested" in layout)
        native = tiny_draft
    else:
        src = eagle3_published(
            tiny_target, tiny_reduced_draft, tmp_path / "src", speculators=layout == "speculators"
        )
        native = tiny_reduced_draft
    out = import_head(src, tiny_target, tmp_path / "out")
    got, want = _native(out), _native(native)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert _config(out)["architectures"] == _config(native)["architectures"]


def test_an_imported_head_serves_as_the_native_one_and_keeps_learning(
    tiny_target, tiny_draft, tmp_path, questions, job_profile
):
    """vLLM serves the imported EAGLE-1 head (via the CLI) with the native head's acceptance,
    token for token; the learner loads it and a training step moves it."""
    from transformers import AutoModelForCausalLM

    from grpo_specdec.draft.capture import Sequence, capture_hidden
    from grpo_specdec.draft.head import load_head
    from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
    from grpo_specdec.engine import Engine, SamplingSettings
    from tests.conftest import tiny_engine_config

    src = eagle1_published(tiny_target, tiny_draft, tmp_path / "src")
    out = tmp_path / "out"
    proc = run_cli(
        "draft", "import", "--head", str(src), "--target", tiny_target, "--out", str(out)
    )
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    sampling = SamplingSettings(max_tokens=32)
    spec = {}
    for name, head in (("native", tiny_draft), ("imported", str(out))):
        engine = Engine(tiny_engine_config(tiny_target, head))
        try:
            result = engine.generate(questions[:6], sampling)
        finally:
            engine.shutdown()
        spec[name] = (result.spec, [g[0].token_ids for g in result.outputs])
    assert spec["imported"] == spec["native"] and spec["native"][0]["accepted_tokens"] > 0

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    head = load_head(out, tiny_target, target)
    before = {k: v.clone() for k, v in head.export_state_dict().items()}
    seqs = capture_hidden(target, [Sequence(list(range(3, 40)), 8)], batch_size=1)
    trainer = DraftTrainer(head, DraftTrainConfig(lr=1e-3, batch_size=1, epochs=1))
    trainer.train(seqs, random.Random(0))
    assert trainer.steps == 1
    after = head.export_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_heads_that_do_not_fit_are_refused_by_name(
    tiny_target, tiny_draft, tiny_reduced_draft, tmp_path
):
    biased = eagle1_published(tiny_target, tiny_draft, tmp_path / "biased", bias=0.01)
    with pytest.raises(HeadFormatError, match="non-zero fc.bias"):
        import_head(biased, tiny_target, tmp_path / "o1")

    other_embed = eagle1_published(tiny_target, tiny_draft, tmp_path / "embed")
    weights = torch.load(other_embed / "pytorch_model.bin", weights_only=True)
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] + 1
    torch.save(weights, other_embed / "pytorch_model.bin")
    with pytest.raises(HeadFormatError, match="embed_tokens.weight differs from the target's"):
        import_head(other_embed, tiny_target, tmp_path / "o2")

    wide = eagle1_published(tiny_target, tiny_draft, tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096}))
    with pytest.raises(HeadFormatError, match="built for hidden_size=4096, but the target has"):
        import_head(wide, tiny_target, tmp_path / "o3")

    aux = eagle3_published(tiny_target, tiny_reduced_draft, tmp_path / "aux", speculators=True)
    weights = load_file(str(aux / "model.safetensors"))
    hidden = _config(tiny_target)["hidden_size"]
    weights["fc.weight"] = torch.zeros(hidden, 3 * hidden)
    save_file(weights, str(aux / "model.safetensors"))
    cfg_aux = {**_config(aux), "norm_before_residual": True}
    (aux / "config.json").write_text(json.dumps(cfg_aux))
    with pytest.raises(HeadFormatError, match=r"sets norm_before_residual"):
        import_head(aux, tiny_target, tmp_path / "o4")

    short = eagle1_published(tiny_target, tiny_draft, tmp_path / "short")
    weights = torch.load(short / "pytorch_model.bin", weights_only=True)
    weights["layers.0.mlp.up_proj.weight"] = weights["layers.0.mlp.up_proj.weight"][:-1]
    torch.save(weights, short / "pytorch_model.bin")
    with pytest.raises(HeadFormatError, match=r"layers.0.mlp.up_proj.weight is \[\d+, \d+\]"):
        import_head(short, tiny_target, tmp_path / "o5")

    shutil.rmtree(short)
    short.mkdir()
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="no \\*.safetensors or pytorch_model.bin"):
        import_head(short, tiny_target, tmp_path / "o6")


def test_a_head_goes_out_in_the_dtype_it_came_in(tiny_target, tiny_draft, tmp_path):
    """The engine checks every swap against the head it serves: a learner that exported a
    bfloat16 head in the target's float32 had every swap rejected while the job went on with
    its first head."""
    from transformers import AutoModelForCausalLM

    from grpo_specdec.draft.head import load_head
    from vllm_plugin.weights.manifest import read_manifest

    served = tmp_path / "bf16-head"
    shutil.copytree(tiny_draft, served)
    weights = load_file(str(served / "model.safetensors"))
    save_file(
        {k: v.bfloat16() if v.is_floating_point() else v for k, v in weights.items()},
        str(served / "model.safetensors"),
    )
    assert json.loads((Path(tiny_target) / "config.json").read_text())["dtype"] == "float32"
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    head = load_head(served, tiny_target, target)
    exported = head.export_state_dict(head.export_dtype())
    manifest = read_manifest(served)
    assert {k: v.dtype for k, v in exported.items()} == {k: m[1] for k, m in manifest.items()}


# ---- heads handed over as published: every entry point imports them on the fly -------------


def _published(layout, tiny_target, tiny_draft, tiny_reduced_draft, out) -> tuple[Path, str]:
    """A head in `layout` as its authors publish it, and the native head it imports to."""
    if layout.startswith("eagle1"):
        return eagle1_published(tiny_target, tiny_draft, out, nested="nested" in layout), tiny_draft
    speculators = layout == "speculators"
    return eagle3_published(tiny_target, tiny_reduced_draft, out, speculators), tiny_reduced_draft


@pytest.mark.parametrize("layout", ["eagle1", "eagle1-nested", "eagle3", "speculators"])
def test_a_published_head_is_recognised_and_imported_once_into_the_cache(
    layout, tiny_target, tiny_draft, tiny_reduced_draft, tmp_path, monkeypatch
):
    from grpo_specdec.draft.formats import ready_head
    from grpo_specdec.draft.layout import published_layout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src, native = _published(layout, tiny_target, tiny_draft, tiny_reduced_draft, tmp_path / "s")
    assert published_layout(native) is None
    assert published_layout(src)
    said = []
    first = ready_head(src, tiny_target, "model.draft", said.append)
    assert first.startswith(str(tmp_path / "cache")) and published_layout(first) is None
    assert all(torch.equal(_native(first)[k], v) for k, v in _native(native).items())
    made = (Path(first) / "model.safetensors").stat().st_mtime_ns
    assert ready_head(src, tiny_target, "model.draft", said.append) == first
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns == made  # not imported again
    assert len(said) == 2 and all(f"model.draft: {src} is a head as published" in m for m in said)
    assert ready_head(native, tiny_target, "model.draft", said.append) == native
    assert len(said) == 2


def test_a_published_head_that_cannot_be_imported_is_refused_naming_the_field_and_import(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    from grpo_specdec.draft.formats import ready_head

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    biased = eagle1_published(tiny_target, tiny_draft, tmp_path / "biased", bias=0.01)
    with pytest.raises(HeadFormatError) as err:
        ready_head(biased, tiny_target, "--draft", print)
    message = str(err.value)
    assert message.startswith(f"--draft: {biased} is a head as published (")
    assert "pytorch_model.bin" in message and "non-zero fc.bias" in message
    assert "grpo-specdec draft import" in message
    assert not list((tmp_path / "cache" / "grpo-specdec" / "imported-heads").iterdir())


def test_an_engine_config_names_draft_import_for_a_published_head(
    tiny_target, tiny_draft, tmp_path
):
    """What a Python user meets who builds the engine's config by hand."""
    from tests.conftest import tiny_engine_config

    src = eagle1_published(tiny_target, tiny_draft, tmp_path / "src")
    with pytest.raises(ValueError, match=r"is a head as published \(a LlamaForCausalLM config, "):
        tiny_engine_config(tiny_target, str(src))
    with pytest.raises(ValueError, match="grpo-specdec draft import --head"):
        tiny_engine_config(tiny_target, str(src))


@pytest.mark.slow
def test_generate_serves_published_heads_as_handed_over_greedy_equal(
    tiny_target, tiny_draft, tiny_reduced_draft, tmp_path
):
    """`generate --draft` with an EAGLE-1 `.bin` head and an EAGLE-3 `midlayer` head, each as
    published: the same tokens and acceptance as its native head (greedy)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 3 + 4?\nWhat is 12 - 5?\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    def generate(draft: str, name: str) -> tuple[dict, list]:
        out = tmp_path / f"{name}.json"
        proc = run_cli(
            *("generate", "--model", tiny_target, "--draft", draft, "--prompts", str(prompts)),
            *("--max-tokens", "24", "--json", str(out), "--dtype", "float32", "--eager"),
            env=env,
        )
        result = json.loads(out.read_text())
        tokens = [s["token_ids"] for group in result["outputs"] for s in group]
        return (result["spec"]["accepted_tokens"], tokens), proc.stderr

    for layout in ("eagle1", "eagle3"):
        src, native = _published(
            layout, tiny_target, tiny_draft, tiny_reduced_draft, tmp_path / layout
        )
        (got, said), (want, _) = generate(str(src), layout), generate(native, layout + "-native")
        assert got == want, layout
        assert f"--draft: {src} is a head as published" in said


def test_the_job_imports_a_published_head_before_ray_and_refuses_one_that_does_not_fit(
    tiny_target, tiny_reduced_draft, tmp_path, monkeypatch
):
    from grpo_specdec.config import load_yaml
    from grpo_specdec.draft.head import load_head
    from grpo_specdec.job import run
    from grpo_specdec.job.config import TrainConfig
    from tests.conftest import TINY_JOB_CONFIG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    class RayWouldStart(Exception):
        pass

    def no_ray(*_):
        raise RayWouldStart

    monkeypatch.setattr(run, "start_ray", no_ray)
    src = eagle3_published(tiny_target, tiny_reduced_draft, tmp_path / "src")
    said = []
    overrides = [f"model.policy={tiny_target}", f"model.draft={src}", f"out={tmp_path / 'run'}"]
    with pytest.raises(RayWouldStart):
        run.Job(load_yaml(TrainConfig, TINY_JOB_CONFIG, overrides), log=said.append)
    imported = [m for m in said if "is a head as published" in m]
    assert len(imported) == 1 and "midlayer.*" in imported[0] and "t2d" in imported[0]
    folder = imported[0].split(" import in ")[1].split(" (")[0]
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    assert (
        load_head(folder, tiny_target, target).export_state_dict().keys()
        == _native(tiny_reduced_draft).keys()
    )

    wide = eagle3_published(tiny_target, tiny_reduced_draft, tmp_path / "wide")
    cfg = _config(wide)
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096}))
    overrides[1] = f"model.draft={wide}"
    with pytest.raises(ValueError, match=r"^model.draft: draft: .* is a head as published"):
        run.Job(load_yaml(TrainConfig, TINY_JOB_CONFIG, overrides), log=said.append)
