"""True EAGLE-3 (`Eagle3Head`): the first draft step reads three of the target's layers
fused by `fc`, later steps the draft's own features, and the loss unrolls the draft on them
(training-time test). Checked against vLLM itself: a tiny Qwen3 target's heads are served
by vLLM's `eagle3` drafter, which reads the auxiliary layers from its own forward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from grpo_specdec.draft.capture import Sequence, capture_hidden, forward_with_hidden
from grpo_specdec.draft.formats import HeadFormatError, import_head
from grpo_specdec.draft.head import aux_layers_of, eagle3_aux_layers, load_head, new_head
from grpo_specdec.draft.head_model import DraftStep, Eagle3Head, unrolled_attention
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import TINY_JOB_CONFIG, job_records, run_cli, tiny_assets, tiny_engine_config


def test_unrolled_attention_is_what_the_drafter_s_cache_gives():
    """Step j from origin t attends to the first step's keys at positions <= t and to the
    keys of its own steps 2..j from t: computed here one origin at a time from an
    explicit cache, against the one masked pass over all origins."""
    torch.manual_seed(0)
    batch, heads, kv_heads, t, dim = 2, 4, 2, 7, 8
    steps = [
        DraftStep(
            torch.randn(batch, heads, t, dim),
            torch.randn(batch, kv_heads, t, dim),
            torch.randn(batch, kv_heads, t, dim),
            None,
        )
        for _ in range(3)
    ]
    scale = dim**-0.5
    for j in range(1, 4):
        got = unrolled_attention(steps[j - 1], steps[: j - 1], heads // kv_heads, scale)
        for b in range(batch):
            for h in range(heads):
                g = h // (heads // kv_heads)
                for origin in range(t):
                    keys = [steps[0].k[b, g, u] for u in range(origin + 1)]
                    values = [steps[0].v[b, g, u] for u in range(origin + 1)]
                    keys += [steps[s].k[b, g, origin] for s in range(1, j)]
                    values += [steps[s].v[b, g, origin] for s in range(1, j)]
                    q = steps[j - 1].q[b, h, origin]
                    weights = torch.softmax(torch.stack(keys) @ q * scale, 0)
                    want = weights @ torch.stack(values)
                    torch.testing.assert_close(got[b, h, origin], want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def qwen3() -> str:
    return str(tiny_assets("qwen3") / "target")


def test_capture_reads_the_layers_vllm_collects(qwen3):
    """vLLM's auxiliary id i is the input of decoder layer i (0: the embedding's output; the
    last id, the last layer's output before the final norm)."""
    model = AutoModelForCausalLM.from_pretrained(qwen3).eval()
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 200, (2, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        last, logits, aux = forward_with_hidden(model, ids, mask, tuple(range(layers + 1)))
        chunks = aux.chunk(layers + 1, dim=-1)
        for i in range(layers):
            torch.testing.assert_close(chunks[i], hf.hidden_states[i])
        torch.testing.assert_close(model.get_decoder().norm(chunks[layers]), last)
    torch.testing.assert_close(logits, hf.logits)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        forward_with_hidden(model, ids, mask, (0, layers + 1))


def test_eagle3_head_settings_are_checked_by_name(qwen3):
    model = AutoModelForCausalLM.from_pretrained(qwen3)
    assert eagle3_aux_layers(32) == (2, 16, 29)  # vLLM's default where it is three layers
    assert eagle3_aux_layers(2) == (0, 1, 2)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[1, 1, 2\]"):
        new_head(qwen3, model, aux_layers=(1, 1, 2))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids is missing"):
        aux_layers_of({"eagle_config": {"use_aux_hidden_state": True}})
    head = new_head(qwen3, model, aux_layers=(2, 0, 1))
    assert head.aux_layers == (0, 1, 2)  # in layer order, as vLLM concatenates them
    assert head.fc.weight.shape == (head.hidden_size, 3 * head.hidden_size)
    # A head over the whole vocabulary has no d2t: vLLM keeps no map for it.
    assert "d2t" not in head.export_state_dict() and "fc.weight" in head.export_state_dict()


@pytest.fixture(scope="module")
def trained(qwen3, questions, tmp_path_factory):
    """`draft train --eagle3` on the tiny Qwen3, teacher-forced (--ttt-steps 1) and unrolled
    (the default, 3 steps): {ttt_steps: (head folder, report)}."""
    root = tmp_path_factory.mktemp("eagle3")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(questions) + "\n")
    heads = {}
    for ttt in (1, None):
        out = root / f"head-{ttt}"
        extra = ["--ttt-steps", str(ttt)] if ttt else []
        run_cli(
            "draft", "train", "--target", qwen3, "--prompts", str(prompts), "--out", str(out),
            "--steps", "60", "--max-tokens", "32", "--eager", "--eagle3",
            "--json", str(root / f"report-{ttt}.json"), *extra,
        )  # fmt: skip
        heads[ttt or 3] = (out, json.loads((root / f"report-{ttt}.json").read_text()))
    return heads


def test_training_time_test_gets_the_later_draft_positions_accepted(trained):
    """vLLM's drafter feeds an EAGLE-3 head its own features from the second draft on. A
    head trained only teacher-forced never saw them; unrolled, it learns to draft from
    them: vLLM accepts far more at positions 2 and 3."""
    config = json.loads((trained[3][0] / "config.json").read_text())
    assert config["eagle_config"] == {
        "use_aux_hidden_state": True,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
    }
    before = trained[3][1]["before"]["greedy"]["mean_acceptance_length"]
    forced = trained[1][1]["after"]["greedy"]["per_position_acceptance"]
    unrolled = trained[3][1]["after"]["greedy"]["per_position_acceptance"]
    assert trained[3][1]["after"]["greedy"]["mean_acceptance_length"] > before + 0.5
    for position in (1, 2):
        assert unrolled[position] > 2 * forced[position] + 0.05, (forced, unrolled)


def test_an_eagle3_head_s_greedy_generation_is_the_plain_engine_s(
    qwen3, trained, questions, job_profile
):
    sampling = SamplingSettings(max_tokens=40)
    plain = Engine(tiny_engine_config(qwen3))
    try:
        expected = [g[0].token_ids for g in plain.generate(questions[:8], sampling).outputs]
    finally:
        plain.shutdown()
    speculative = {
        "draft": str(trained[3][0]),
        "k": 3,
        "concurrency_aware": True,
        "controller": {"profile": job_profile},
    }
    engine = Engine(tiny_engine_config(qwen3, speculative=speculative))
    try:
        result = engine.generate(questions[:8], sampling)
    finally:
        engine.shutdown()
    assert [g[0].token_ids for g in result.outputs] == expected
    assert result.spec["accepted_tokens"] > 0


def _speculators_layout(head_dir, out, ids=True):
    """The trained head as the speculators library publishes an EAGLE-3 head."""
    out.mkdir(parents=True)
    cfg = json.loads((head_dir / "config.json").read_text())
    published = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": cfg["draft_vocab_size"],
        "transformer_layer_config": {
            k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config")
        },
    }
    if ids:
        published["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (out / "config.json").write_text(json.dumps(published))
    weights = load_file(str(head_dir / "model.safetensors"))
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_a_published_eagle3_head_loads_and_keeps_learning(qwen3, trained, tmp_path):
    native = trained[3][0]
    src = _speculators_layout(native, tmp_path / "published")
    out = import_head(src, qwen3, tmp_path / "imported")
    assert (
        json.loads((out / "config.json").read_text())["eagle_config"]
        == json.loads((native / "config.json").read_text())["eagle_config"]
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3)
    head = load_head(out, qwen3, model)
    assert isinstance(head, Eagle3Head)
    want = load_file(str(native / "model.safetensors"))
    got = head.export_state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.to(got[name].dtype))
    # keeps learning: a step on captured auxiliary layers moves fc
    seqs = capture_hidden(model, [Sequence(list(range(3, 40)), 8)], aux_layers=head.aux_layers)
    before = head.fc.weight.detach().clone()
    stats = DraftTrainer(head, DraftTrainConfig(lr=1e-3)).step(seqs)
    assert not stats["skipped"] and math.isfinite(stats["ce_loss_3"])
    assert not torch.equal(before, head.fc.weight)

    # Without ids vLLM would read the target's default layers, (2, 1, -1) for two layers.
    bare = _speculators_layout(native, tmp_path / "bare", ids=False)
    with pytest.raises(HeadFormatError, match="eagle_aux_hidden_state_layer_ids"):
        import_head(bare, qwen3, tmp_path / "o1")
    wide = _speculators_layout(native, tmp_path / "wide")
    weights = load_file(str(wide / "model.safetensors"))
    weights["fc.weight"] = torch.zeros(head.hidden_size, 4 * head.hidden_size)
    save_file(weights, str(wide / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=r"fc.weight is \[\d+, \d+\]: it fuses 4 target"):
        import_head(wide, qwen3, tmp_path / "o2")


@pytest.mark.slow
def test_the_grpo_job_learns_a_new_eagle3_head_online_for_a_qwen3_policy(
    qwen3, job_profile, tmp_path
):
    out = tmp_path / "run"
    run_cli(
        "train", "--config", TINY_JOB_CONFIG, f"model.policy={qwen3}", "model.draft=null",
        "draft.new_head=eagle3", f"rollout.controller.profile={job_profile}", f"out={out}",
        "iterations=2", "eval.every=0", "data.levels=[1]",
    )  # fmt: skip
    records = job_records(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["draft_steps"] > 0 for r in records)
    # unrolled three steps on the policy's captured auxiliary layers
    assert all(math.isfinite(r["draft_ce_loss_3"]) for r in records)
    assert records[-1]["engine_draft_version"] == 2
    head = out / "checkpoints" / "iter_000002" / "draft" / "config.json"
    assert json.loads(head.read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        0,
        1,
        2,
    ]
