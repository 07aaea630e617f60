"""Problems from the user's data (`grpo_specdec/tasks/datasets.py`): GSM8K's JSONL, verl's
parquet, a Hugging Face `datasets` folder, named fields, a prompt template; a bad row is
refused at load time with its file, row and field named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from grpo_specdec.tasks.datasets import ChatPrompt, FileSource, PromptTemplate

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is half of one?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r"\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 6 times 7?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_gsm8k_jsonl_errors_name_file_and_line(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(
        '{"question": "q1", "answer": "work\\n#### 1,200"}\n\n{"question": "q2", "answer": "#### -3"}\n'
    )
    src = FileSource(good, reward_kind="number")
    assert [src.get(0).answer, src.get(1).answer, src.get(2).answer] == ["1,200", "-3", "1,200"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"question": "q1", "answer": "#### 1"}\n{"question": "q2", "answer": "#### "}\n'
    )
    with pytest.raises(
        ValueError, match=r"bad.jsonl line 2: field 'answer': the ground truth is empty"
    ):
        FileSource(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q1", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 2: not valid JSON"):
        FileSource(broken)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no examples"):
        FileSource(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FileSource(tmp_path / "nope.jsonl")


def test_a_numeric_reward_refuses_a_latex_ground_truth_at_load_time(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"question": "q", "answer": "7"}\n{"question": "q", "answer": "\\\\frac{1}{2}"}\n'
    )
    assert FileSource(data).examples[1].answer == r"\frac{1}{2}"  # math-verify reads it
    with pytest.raises(ValueError, match=r"d.jsonl line 2: field 'answer': .* not a plain number"):
        FileSource(data, reward_kind="number")


def test_named_and_nested_fields(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [
        {"problem": "2+2?", "meta": {"solution": 4}},
        {"problem": "3+3?", "meta": {"solution": "6"}},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    src = FileSource(data, question_field="problem", answer_field="meta.solution")
    assert [(e.question, e.answer) for e in src.examples] == [("2+2?", "4"), ("3+3?", "6")]
    with pytest.raises(ValueError, match=r"d.jsonl line 1: no field 'meta.answer'"):
        FileSource(data, question_field="problem", answer_field="meta.answer")
    data.write_text(json.dumps({"problem": "q", "meta": {"solution": [1]}}))
    with pytest.raises(
        ValueError, match=r"line 1: field 'meta.solution' must be a string or a number"
    ):
        FileSource(data, question_field="problem", answer_field="meta.solution")


def test_verl_parquet_rows_become_chat_prompts(tmp_path):
    src = FileSource(_parquet(tmp_path / "train.parquet", VERL_ROWS), "parquet")
    first, second = src.examples
    assert first.question == ChatPrompt((("user", "What is half of one?"),))
    assert first.answer == r"\frac{1}{2}"
    assert second.question.messages() == VERL_ROWS[1]["prompt"]
    assert second.answer == "42"


def test_bad_parquet_rows_name_the_row_and_field(tmp_path):
    rows = [dict(VERL_ROWS[0]), {**VERL_ROWS[1], "prompt": [{"role": "robot", "content": "hi"}]}]
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=r"bad.parquet row 1: field 'prompt' turn 0: expected"):
        FileSource(path, "parquet")
    rows[1] = {**VERL_ROWS[1], "prompt": [{"role": "system", "content": "only a system turn"}]}
    with pytest.raises(ValueError, match=r"bad.parquet row 1: field 'prompt' has no user turn"):
        FileSource(_parquet(tmp_path / "bad.parquet", rows), "parquet")


def test_a_datasets_folder_saved_to_disk(tmp_path):
    import datasets

    rows = {"question": ["1+1?", "2+3?"], "answer": ["... #### 2", "... #### 5"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "ds")
    src = FileSource(tmp_path / "ds", "datasets", reward_kind="number")
    assert [(e.question, e.answer) for e in src.examples] == [("1+1?", "2"), ("2+3?", "5")]
    datasets.DatasetDict({s: datasets.Dataset.from_dict(rows) for s in ("a", "b")}).save_to_disk(
        tmp_path / "two"
    )
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\]; expected 'train' or one split"):
        FileSource(tmp_path / "two", "datasets")


def test_the_prompt_template_adds_a_system_turn_and_an_instruction():
    template = PromptTemplate("You are careful.", " Put the answer in \\boxed{}.")
    assert template.apply("2+2?") == ChatPrompt(
        (("system", "You are careful."), ("user", "2+2? Put the answer in \\boxed{}."))
    )
    own = ChatPrompt((("system", "Be brief."), ("user", "a"), ("assistant", "b"), ("user", "c")))
    assert template.apply(own).turns == (
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c Put the answer in \\boxed{}."),
    )
    assert PromptTemplate().apply("2+2?") == "2+2?"


def test_the_engine_encodes_chat_prompts_through_the_chat_template(tiny_target):
    from transformers import AutoTokenizer

    from grpo_specdec.engine import Engine

    tok = AutoTokenizer.from_pretrained(tiny_target)
    engine = SimpleNamespace(tokenizer=tok)
    chat = ChatPrompt((("system", "Be brief."), ("user", "2+2?")))
    expected = tok.apply_chat_template(chat.messages(), add_generation_prompt=True, tokenize=False)
    assert Engine.encode(engine, chat) == tok.encode(expected, add_special_tokens=False)
    as_user = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert Engine.encode(engine, "2+2?") == tok.encode(as_user, add_special_tokens=False)
    assert Engine.encode(engine, chat, chat=False) == tok.encode("Be brief.\n\n2+2?")
