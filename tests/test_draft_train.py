"""`grpo-specdec draft train` and the draft trainer's guards."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.draft.bootstrap import (
    MIN_EVAL_DRAFT_TOKENS,
    MIN_EVAL_PROMPTS,
    DraftBootstrapConfig,
    draft_token_warnings,
    prompt_warnings,
    read_pairs,
    split_prompts,
)
from grpo_specdec.draft.capture import Sequence, capture_hidden
from grpo_specdec.draft.head import load_head, new_head
from grpo_specdec.draft.loss import acceptance, eagle_loss, make_batch
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from tests.conftest import run_cli

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow


def test_draft_train_raises_acceptance_measured_by_the_engine(tiny_target, tmp_path):
    report_path = tmp_path / "report.json"
    out = tmp_path / "head"
    proc = run_cli(
        "draft",
        "train",
        "--target",
        tiny_target,
        "--task",
        "arithmetic",
        "--out",
        str(out),
        "--steps",
        "200",
        "--num-prompts",
        "192",
        "--eval-prompts",
        "12",
        "--max-tokens",
        "48",
        "--lr",
        "3e-3",
        "--batch-size",
        "16",
        "--eager",
        "--json",
        str(report_path),
    )
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    report = json.loads(report_path.read_text())
    for mode in ("greedy", "temperature_1"):
        before = report["before"][mode]["mean_acceptance_length"]
        after = report["after"][mode]["mean_acceptance_length"]
        assert after > before + (0.5 if mode == "greedy" else 0.0), (mode, before, after)
    assert report["train"]["steps"] == 200 and report["train"]["sequences"] == 192
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_draft_train_on_a_short_prompts_file_reports_what_its_figures_rest_on(
    tiny_target, questions, tmp_path
):
    """A tenth of 12 prompts is one: the figures would rest on one short answer. Measured
    on all 12 (in-sample, and said so), the trained head's gain shows."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:12]) + "\n")
    report_path, out = tmp_path / "report.json", tmp_path / "head"
    proc = run_cli(
        "draft", "train", "--target", tiny_target, "--prompts", str(prompts),
        "--out", str(out), "--steps", "100", "--max-tokens", "48", "--lr", "3e-3",
        "--batch-size", "16", "--eager", "--json", str(report_path),
    )  # fmt: skip
    report = json.loads(report_path.read_text())
    assert report["eval"] == {"prompts": 12, "held_out": False}
    assert "warning: acceptance is measured on 12 training prompts" in proc.stderr
    for when in ("before", "after"):
        for mode, figure in report[when].items():
            assert figure["prompts"] == 12
            assert figure["draft_tokens"] >= MIN_EVAL_DRAFT_TOKENS, (when, mode)
            assert f"{figure['draft_tokens']} draft tokens" in proc.stderr
    assert "at k=3 on 12 training prompts" in proc.stderr
    greedy = [report[when]["greedy"]["mean_acceptance_length"] for when in ("before", "after")]
    assert greedy[1] > greedy[0] + 0.5, greedy


def _split_of_lines(tmp_path, lines: int, suffix: str = "txt"):
    """The split of a prompts file (or, as jsonl, a pairs file) of `lines` distinct prompts."""
    path = tmp_path / f"source.{suffix}"
    if suffix == "jsonl":
        rows = [json.dumps({"prompt": f"p{i}", "response": "r"}) for i in range(lines)]
        source = {"pairs": str(path)}
    else:
        rows, source = [f"p{i}" for i in range(lines)], {"prompts": str(path)}
    path.write_text("\n".join(rows) + "\n")
    return split_prompts(DraftBootstrapConfig(target="unused", out="unused", **source))


def test_evaluation_prompts_are_held_out_with_a_floor(tmp_path):
    small = _split_of_lines(tmp_path, 12)
    assert (len(small.eval_prompts), small.held_out) == (12, False)
    assert len(prompt_warnings(small)) == 1
    enough = _split_of_lines(tmp_path, 40)
    assert (len(enough.eval_prompts), enough.held_out) == (MIN_EVAL_PROMPTS, True)
    assert not set(enough.eval_prompts) & set(enough.train) and not prompt_warnings(enough)
    many = _split_of_lines(tmp_path, 1000)
    assert (len(many.eval_prompts), len(many.train)) == (32, 968)  # --eval-prompts caps it
    pairs = _split_of_lines(tmp_path, 40, "jsonl")
    trained_on = {prompt for prompt, _ in pairs.train}
    assert len(pairs.eval_prompts) == MIN_EVAL_PROMPTS
    assert not trained_on & set(pairs.eval_prompts)


def test_figures_on_too_few_draft_tokens_are_flagged():
    figure = {"prompts": 12, "draft_tokens": MIN_EVAL_DRAFT_TOKENS}
    few = {**figure, "draft_tokens": 15}
    assert draft_token_warnings("after", {"greedy": figure, "temperature_1": figure}) == []
    (warning,) = draft_token_warnings("after", {"greedy": few, "temperature_1": figure})
    assert warning.startswith("after: the greedy figure rests on 15 draft tokens")


@pytest.fixture(scope="module")
def tiny_seqs(tiny_target):
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    rng = random.Random(0)
    seqs = [Sequence([rng.randrange(100, 600) for _ in range(30)], prompt_len=10) for _ in range(8)]
    return target, capture_hidden(target, seqs)


def test_loss_masks_prompt_positions():
    seqs = [Sequence(list(range(10)), prompt_len=4, hidden=torch.zeros(10, 8))]
    batch = make_batch(seqs)
    # position i predicts h_{i+1}; the draft first runs at i = prompt_len - 1
    assert batch.mask[0].tolist() == [False] * 3 + [True] * 6
    assert batch.next_ids[0].tolist() == list(range(1, 10))


def test_non_finite_step_is_skipped_and_weights_untouched(tiny_seqs, tiny_target):
    target, seqs = tiny_seqs
    head = new_head(tiny_target, target)
    trainer = DraftTrainer(head, DraftTrainConfig(lr=1e-2))
    before = {k: v.clone() for k, v in head.export_state_dict().items()}
    poisoned = [Sequence(s.token_ids, s.prompt_len, s.hidden.clone()) for s in seqs]
    poisoned[0].hidden[12, 0] = float("nan")
    stats = trainer.step(poisoned)
    assert stats["skipped"] and trainer.skipped_steps == 1 and trainer.steps == 0
    assert all(torch.equal(before[k], v) for k, v in head.export_state_dict().items())
    trainer.step(seqs)
    assert trainer.steps == 1
    assert any(not torch.equal(before[k], v) for k, v in head.export_state_dict().items())


def test_export_round_trip(tiny_seqs, tiny_target, tmp_path):
    target, _ = tiny_seqs
    head = new_head(tiny_target, target, seed=3)
    again = load_head(head.save(tmp_path / "h"), tiny_target, target)
    for k, v in head.export_state_dict().items():
        assert torch.equal(v, again.export_state_dict()[k])


def test_pairs_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl line 2"):
        read_pairs(bad)


def test_acceptance_is_one_minus_total_variation_over_the_draft_vocabulary(tiny_seqs, tiny_target):
    target, seqs = tiny_seqs
    hidden = seqs[0].hidden[:5]
    for vocab_ids in (None, torch.arange(0, target.config.vocab_size, 3)):
        head = new_head(tiny_target, target, seed=1, vocab_ids=vocab_ids)
        draft_logits = torch.randn(5, head.draft_logits(hidden).shape[-1])
        got = acceptance(head, draft_logits, hidden, temperature=0.7)
        p = (head.full_target_logits(hidden) / 0.7).softmax(-1)
        q = (draft_logits / 0.7).softmax(-1)
        if vocab_ids is not None:  # q over the whole vocabulary, zero outside the draft's
            q = torch.zeros_like(p).index_copy_(1, vocab_ids, q)
        assert torch.allclose(got["sampled"], 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-5)
        assert torch.allclose(got["greedy"], p.gather(1, q.argmax(-1, keepdim=True)).squeeze(1))
        assert torch.equal(got["ceiling"], p.max(-1).values)


def test_total_variation_term_trains_for_sampled_acceptance(tiny_seqs, tiny_target):
    """The TV term alone (no hidden or cross-entropy loss) raises the acceptance of sampled
    drafts, at the temperature it is given; a sign or temperature slip would not."""
    target, seqs = tiny_seqs
    batch = make_batch(seqs)
    head = new_head(tiny_target, target, seed=2)

    def sampled_acceptance() -> float:
        with torch.no_grad():
            feats = head(batch.next_ids, batch.hidden_in, batch.positions)[batch.mask]
            acc = acceptance(head, head.draft_logits(feats), batch.hidden_out[batch.mask], 1.5)
        return acc["sampled"].mean().item()

    before = sampled_acceptance()
    cfg = DraftTrainConfig(lr=3e-3, hidden_weight=0, ce_weight=0, tv_weight=1, temperature=1.5)
    trainer = DraftTrainer(head, cfg)
    stats = [trainer.step(seqs) for _ in range(10)]
    after = sampled_acceptance()
    assert after > before + 0.1, (before, after)
    assert stats[-1]["sampled_acceptance"] > stats[0]["sampled_acceptance"]


def test_a_draft_step_builds_its_batch_on_the_heads_device(tiny_seqs, tiny_target):
    """The sequences arrive on CPU. A head on the meta device (shapes, no data) fails on the
    first CPU tensor an op meets, so a head forward that runs there was given only tensors
    on the head's device: on a GPU, the same batch holds none on the CPU."""
    target, seqs = tiny_seqs
    head = new_head(tiny_target, target, seed=4).to("meta")  # its buffers too
    batch = make_batch(seqs, next(head.parameters()).device)
    assert {t.device.type for t in vars(batch).values() if t is not None} == {"meta"}
    assert head(batch.next_ids, batch.hidden_in, batch.positions).device.type == "meta"
    on_cpu = make_batch(seqs)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta|device"):
        head(on_cpu.next_ids, on_cpu.hidden_in, on_cpu.positions)


@pytest.mark.parametrize("tv_weight", [0.0, 1.0])
def test_the_vocabulary_terms_in_chunks_equal_them_whole(tiny_seqs, tiny_target, tv_weight):
    """Chunks of 7 rows, each recomputed in the backward pass, give the loss, statistics and
    gradients of the whole batch at once."""
    target, seqs = tiny_seqs
    batch = make_batch(seqs)
    grads, stats = [], []
    for rows in (None, 7):
        head = new_head(tiny_target, target, seed=5)
        loss, s = eagle_loss(head, batch, tv_weight=tv_weight, rows_per_chunk=rows)
        loss.backward()
        grads.append([p.grad.clone() for p in head.parameters() if p.requires_grad])
        stats.append(s)
    assert batch.num_tokens > 7 * 3  # several chunks
    for name in stats[0]:
        assert stats[1][name] == pytest.approx(stats[0][name], rel=1e-5), name
    for whole, chunked in zip(*grads, strict=True):
        assert torch.allclose(whole, chunked, rtol=1e-4, atol=1e-6)
