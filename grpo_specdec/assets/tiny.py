"""Deterministic tiny models for tests: a target that writes varied text, and EAGLE heads.

The target (~0.6M parameters, its own byte-level BPE tokenizer) is trained for a few
seconds on worked arithmetic solutions, so greedy outputs differ per prompt and equality
tests mean something. It is a Llama by default; `architecture` builds the same recipe as a
Qwen2 (bias on q/k/v) or a Qwen3 (q/k norms, an untied lm_head), the policies users bring.
The draft heads (full vocabulary, and a reduced one in EAGLE-3 format) are distilled from
that target's hidden states, so speculation is accepted often.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from grpo_specdec.draft.capture import Sequence, capture_hidden, pad_batch
from grpo_specdec.draft.head import draft_vocabulary, new_head
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from grpo_specdec.tasks.arithmetic import make_problems

EOS = "<|endoftext|>"
ARCHITECTURES = {
    "llama": (LlamaConfig, "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", {"tie_word_embeddings": False, "head_dim": 32}),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt text, response text) pairs in the tiny chat format."""
    problems = [p for level in (1, 2, 3) for p in make_problems(n // 3, seed=seed, level=level)]
    return [(f"<|user|>\n{p.question}\n<|assistant|>\n", f"{p.solution}{EOS}") for p in problems]


def _tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(
    out: str | Path,
    seed: int = 0,
    target_steps: int = 400,
    draft_epochs: int = 6,
    architecture: str = "llama",
) -> Path:
    out = Path(out)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pairs = _corpus(1200, seed)
    tok = _tokenizer([p + r for p, r in pairs], vocab_size=1024)
    config_cls, hf_architecture, specific = ARCHITECTURES[architecture]
    cfg = config_cls(
        **specific,
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        dtype="float32",
    )
    target = AutoModelForCausalLM.from_config(cfg)
    seqs = [
        Sequence(
            tok.encode(p, add_special_tokens=False) + tok.encode(r, add_special_tokens=False), 0
        )
        for p, r in pairs
    ]
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for _ in range(target_steps):
        ids, mask = pad_batch([s.token_ids for s in rng.sample(seqs, 32)])
        labels = ids.masked_fill(mask == 0, -100)
        loss = target(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.eval()
    target.config.architectures = [hf_architecture]
    target.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")

    draft_seqs = capture_hidden(
        target,
        [
            Sequence(s.token_ids, len(tok.encode(p, add_special_tokens=False)))
            for s, (p, _) in zip(seqs[:600], pairs[:600], strict=True)
        ],
        batch_size=64,
    )
    # The same recipe over the full vocabulary (EAGLE) and over its 256 most frequent
    # response tokens (EAGLE-3 format, as the SmolLM2 default head).
    reduced = draft_vocabulary(draft_seqs, 256, [tok.eos_token_id])
    for name, vocab_ids in (("draft", None), ("draft-reduced", reduced)):
        head = new_head(out / "target", target, seed=seed, vocab_ids=vocab_ids)
        DraftTrainer(head, DraftTrainConfig(lr=3e-3, batch_size=32, epochs=draft_epochs)).train(
            draft_seqs, rng
        )
        head.save(out / name)
    return out
