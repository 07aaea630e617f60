"""Draft head parity with vLLM, and validated hot-swaps into a running engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.draft.head import load_head, new_head
from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import tiny_engine_config
from vllm_plugin.weights.manifest import MixedWeightsError

GREEDY = SamplingSettings(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def hf_target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained_head(tiny_draft, tiny_target, hf_target):
    return load_head(tiny_draft, tiny_target, hf_target)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tiny_target, hf_target) -> str:
    return str(
        new_head(tiny_target, hf_target, seed=7).save(tmp_path_factory.mktemp("random_draft"))
    )


@pytest.fixture(scope="module")
def swap_engine(tiny_target, random_draft):
    engine = Engine(tiny_engine_config(tiny_target, random_draft))
    yield engine
    engine.shutdown()


def _capture_first_draft_forward(worker):
    """Runs inside the vLLM worker: record the draft model's first (prefill) forward."""
    model = worker.get_draft_model()
    record = {}

    def hook(module, args, kwargs, output):
        if not record:
            record["input_ids"] = kwargs["input_ids"].clone()
            record["positions"] = kwargs["positions"].clone()
            record["hidden"] = kwargs["hidden_states"].clone()
            record["out"] = output[0].clone()
            record["aux"] = output[1].clone()
            record["logits"] = module.compute_logits(output[0]).clone()

    handle = model.register_forward_hook(hook, with_kwargs=True)
    worker._parity_capture = (record, handle)


def _take_capture(worker):
    record, handle = worker._parity_capture
    handle.remove()
    return {k: v.cpu() for k, v in record.items()}


def test_pytorch_head_matches_vllm_draft_forward(eagle_engine, trained_head, questions):
    eagle_engine.llm.collective_rpc(_capture_first_draft_forward)
    eagle_engine.generate(questions[:1], SamplingSettings(max_tokens=4))
    rec = eagle_engine.llm.collective_rpc(_take_capture)[0]
    n = rec["input_ids"].shape[0]
    assert n > 10  # the prompt prefill: the draft sees the whole prefix at once
    with torch.no_grad():
        out = trained_head(
            rec["input_ids"][None].long(), rec["hidden"][None], rec["positions"][None].long()
        )[0]
        logits = trained_head.draft_logits(out)
    torch.testing.assert_close(out, rec["out"], atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(logits, rec["logits"][:, : logits.shape[1]], atol=2e-3, rtol=1e-3)
    assert (logits.argmax(-1) == rec["logits"].argmax(-1)).all()


def test_swap_raises_acceptance_without_restart_and_keeps_outputs(
    swap_engine, plain_engine, trained_head, questions
):
    before = swap_engine.generate(questions, GREEDY)
    assert swap_engine.weight_versions() == {"policy": 0, "draft": 0}
    report = swap_engine.swap_weights(
        "draft", trained_head.export_state_dict(torch.float32), version=1
    )
    assert report["version"] == 1 and report["total_s"] > 0
    assert swap_engine.weight_versions()["draft"] == 1
    after = swap_engine.generate(questions, GREEDY)
    plain = plain_engine.generate(questions, GREEDY)
    tokens = lambda r: [g[0].token_ids for g in r.outputs]  # noqa: E731
    assert tokens(before) == tokens(after) == tokens(plain)
    assert after.spec["mean_acceptance_length"] > before.spec["mean_acceptance_length"] + 0.5


def _bad_weights(head, kind):
    sd = head.export_state_dict(torch.float32)
    if kind == "shape":
        sd["fc.weight"] = sd["fc.weight"][:, :-1].contiguous()
    elif kind == "nan":
        sd["layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    elif kind == "missing":
        del sd["layers.0.self_attn.o_proj.weight"]
    elif kind == "dtype":
        sd["fc.weight"] = sd["fc.weight"].to(torch.bfloat16)
    elif kind == "hidden":
        sd = {k: torch.zeros([2 * d for d in v.shape]) for k, v in sd.items()}
    return sd


@pytest.mark.parametrize(
    "kind,message",
    [
        ("shape", r"fc.weight: shape \(128, 255\), expected \(128, 256\)"),
        ("nan", r"layers.0.mlp.down_proj.weight: holds NaN or Inf"),
        ("missing", r"missing tensors \['layers.0.self_attn.o_proj.weight'\]"),
        ("dtype", r"fc.weight: dtype torch.bfloat16, expected torch.float32"),
        ("hidden", r"fc.weight: shape \(256, 512\), expected \(128, 256\)"),
    ],
)
def test_bad_swap_is_rejected_and_old_weights_keep_serving(
    swap_engine, trained_head, questions, kind, message
):
    swap_engine.swap_weights("draft", trained_head.export_state_dict(torch.float32), version=5)
    reference = swap_engine.generate(questions, GREEDY).spec
    with pytest.raises(Exception, match=message):
        swap_engine.swap_weights("draft", _bad_weights(trained_head, kind), version=6)
    assert swap_engine.weight_versions()["draft"] == 5
    assert swap_engine.generate(questions, GREEDY).spec == reference


def _reads_files_whole_with(worker) -> str:
    from vllm_plugin.weights import rank_weights

    return rank_weights.load_file.__name__


@pytest.mark.parametrize("kind", ["shape", "missing", "dtype", "hidden"])
def test_a_wrong_file_is_refused_from_its_header_before_it_is_read_whole(
    swap_engine, trained_head, monkeypatch, kind
):
    """A file of another model (or a wrong shape, dtype or name) is refused from the header
    its safetensors file begins with: read whole first, a large one could take the engine's
    memory before the check said no. (This engine's worker runs in this process.)"""
    from vllm_plugin.weights import rank_weights

    def read_whole(*_args, **_kwargs):
        raise AssertionError("the file was read whole before its header was checked")

    version = swap_engine.weight_versions()["draft"]
    monkeypatch.setattr(rank_weights, "load_file", read_whole)
    assert swap_engine.llm.collective_rpc(_reads_files_whole_with) == ["read_whole"]
    with pytest.raises(Exception, match=r"rejected draft \(version .*\) weights: "):
        swap_engine.swap_weights("draft", _bad_weights(trained_head, kind), version=version + 1)
    assert swap_engine.weight_versions()["draft"] == version


def test_head_for_another_vocabulary_is_rejected(
    swap_engine, trained_head, hf_target, tiny_target, questions
):
    version = swap_engine.weight_versions()["draft"]
    reference = swap_engine.generate(questions, GREEDY).spec
    big_vocab = torch.nn.Embedding(4096, 128).weight
    other = new_head(tiny_target, hf_target)
    other.embed_weight, other.lm_head_weight = big_vocab, big_vocab
    with pytest.raises(
        Exception,
        match=f"built for vocab_size=4096, the engine serves vocab_size={trained_head.vocab_size}",
    ):
        swap_engine.swap_weights(
            "draft", other.export_state_dict(), version + 1, metadata=other.swap_metadata()
        )
    assert swap_engine.weight_versions()["draft"] == version
    assert swap_engine.generate(questions, GREEDY).spec == reference


def _fail_halfway(worker):
    """Runs in the worker: the next draft load raises after loading some tensors."""
    model = worker.get_draft_model()
    original = model.load_weights

    def broken(weights):
        weights = list(weights)
        original(weights[: len(weights) // 2])
        model.load_weights = original
        raise RuntimeError("simulated failure inside the worker")

    model.load_weights = broken


def test_failure_halfway_restores_previous_weights(swap_engine, trained_head, questions):
    swap_engine.swap_weights("draft", trained_head.export_state_dict(torch.float32), version=10)
    reference = swap_engine.generate(questions, GREEDY).spec
    perturbed = {k: v + 0.5 for k, v in trained_head.export_state_dict(torch.float32).items()}
    swap_engine.llm.collective_rpc(_fail_halfway)
    with pytest.raises(Exception, match="simulated failure inside the worker.*restored version 10"):
        swap_engine.swap_weights("draft", perturbed, version=11)
    assert swap_engine.weight_versions()["draft"] == 10
    assert swap_engine.generate(questions, GREEDY).spec == reference


def test_policy_swap_changes_outputs_and_swaps_back(swap_engine, hf_target, questions, monkeypatch):
    original = {k: v.clone() for k, v in hf_target.state_dict().items() if k != "lm_head.weight"}
    reference = [g[0].token_ids for g in swap_engine.generate(questions, GREEDY).outputs]
    noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    inits = []
    init = swap_engine.llm.init_weight_transfer_engine
    monkeypatch.setattr(
        swap_engine.llm, "init_weight_transfer_engine", lambda *a: (inits.append(a), init(*a))
    )
    swap_engine.swap_weights("policy", noisy, version=1)
    changed = [g[0].token_ids for g in swap_engine.generate(questions, GREEDY).outputs]
    assert changed != reference
    swap_engine.swap_weights("policy", original, version=2)
    assert [g[0].token_ids for g in swap_engine.generate(questions, GREEDY).outputs] == reference
    assert swap_engine.weight_versions()["policy"] == 2
    assert len(inits) <= 1  # the transfer is initialised once per role, not per swap


def test_a_swap_leaves_no_kv_of_the_old_weights_to_requests_left_in_the_engine(
    swap_engine, hf_target, questions
):
    from vllm import SamplingParams

    engine = swap_engine
    original = {k: v.clone() for k, v in hf_target.state_dict().items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(2)
    noisy = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in original.items()}
    # Over two KV blocks (128 tokens each on CPU): with EAGLE, vLLM reuses all cached blocks
    # of a prompt but the last.
    prompt = engine.tokenizer.encode(" ".join(questions * 3))[:300]
    engine.swap_weights("policy", noisy, version=20)
    expected = engine.generate([prompt], GREEDY).outputs[0][0].token_ids  # nothing else in flight
    engine.swap_weights("policy", original, version=21)
    # A request left in the engine (as by an interrupted generate) holds the prompt's KV.
    engine.llm.llm_engine.add_request(
        "left-over", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=100)
    )
    engine.llm.llm_engine.step()
    engine.swap_weights("policy", noisy, version=22)
    engine.llm.llm_engine.abort_request(["left-over"])
    assert engine.generate([prompt], GREEDY).outputs[0][0].token_ids == expected
    engine.swap_weights("policy", original, version=23)


def test_vllms_trainer_factory_moves_a_head_in_through_vllms_weight_update_api(
    swap_engine, plain_engine, trained_head, random_draft, questions
):
    """What a verl, NeMo-RL or TRL trainer that speaks vLLM's RL API does: the `grpo_shm`
    trainer engine from vLLM's factory, an in-process client, one draft update."""
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.clients import LLMClient
    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    def push(weights, version):
        sender = WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0, draft=True),
            client=LLMClient(swap_engine.llm),
            source=StateDictSource(weights),
        )
        sender.send_weights(version)

    push(load_file(Path(random_draft) / "model.safetensors"), 40)
    before = swap_engine.generate(questions, GREEDY)
    push(trained_head.export_state_dict(torch.float32), 41)
    after = swap_engine.generate(questions, GREEDY)
    assert swap_engine.weight_versions()["draft"] == 41
    tokens = lambda r: [g[0].token_ids for g in r.outputs]  # noqa: E731
    assert tokens(before) == tokens(after) == tokens(plain_engine.generate(questions, GREEDY))
    assert after.spec["mean_acceptance_length"] > before.spec["mean_acceptance_length"] + 0.5
    # Rejected updates through the same API: old weights keep serving, the session ends.
    for kind, message in (("shape", "fc.weight: shape"), ("missing", "missing tensors")):
        with pytest.raises(Exception, match=message):
            push(_bad_weights(trained_head, kind), 42)
        assert swap_engine.weight_versions()["draft"] == 41
        assert swap_engine.generate(questions, GREEDY).spec == after.spec


def test_only_files_in_the_engine_s_own_swap_folder_are_loaded(swap_engine, tiny_target):
    """Not a file the server can read elsewhere, nor a link, nor a whole valid weight file
    written for another engine of the same user (its folder, or the user's folder above)."""
    import shutil

    from vllm_plugin.weights.swap_folder import engine_swap_folder, swap_folder

    version = swap_engine.weight_versions()["policy"]
    own = Path(swap_engine.llm.collective_rpc("grpo_swap_folder")[0])
    assert own.parent == swap_folder() and own != engine_swap_folder("another")
    served_file = Path(tiny_target) / "model.safetensors"
    link = own / "policy-link.safetensors"
    link.symlink_to(served_file)
    others = [engine_swap_folder("another") / "policy.safetensors", swap_folder() / "p.safetensors"]
    for other in others:
        shutil.copy(served_file, other)
    try:
        for path in (served_file, link, own / ".." / served_file.name, *others):
            # Through vLLM's weight-update API itself, as any trainer may call it.
            swap_engine.llm.start_weight_update()
            with pytest.raises(
                Exception,
                match=rf"refused weight file {re.escape(str(path))}: .*swap folder {own}",
            ):
                swap_engine.llm.update_weights(
                    {"update_info": {"path": str(path), "version": version + 1}}
                )
    finally:
        link.unlink()
        for other in others:
            other.unlink()
    assert swap_engine.weight_versions()["policy"] == version


def test_the_last_good_swap_file_is_gone_yet_still_restores(swap_engine, trained_head, questions):
    swap_engine.swap_weights("draft", trained_head.export_state_dict(torch.float32), version=30)
    own = Path(swap_engine.llm.collective_rpc("grpo_swap_folder")[0])
    assert not list(own.glob("draft-v30-*"))  # the engine holds it open
    reference = swap_engine.generate(questions, GREEDY).spec
    perturbed = {k: v + 0.5 for k, v in trained_head.export_state_dict(torch.float32).items()}
    swap_engine.llm.collective_rpc(_fail_halfway)
    with pytest.raises(Exception, match="restored version 30"):
        swap_engine.swap_weights("draft", perturbed, version=31)
    assert swap_engine.generate(questions, GREEDY).spec == reference


def test_a_trainer_asks_its_engine_for_the_swap_folder_once(swap_engine, trained_head, monkeypatch):
    """The folder is named by the engine's id, which an `LLM` keeps for its life."""
    from vllm_plugin.weights.trainer import LLMWeights

    asked, rpc = [], swap_engine.llm.collective_rpc

    def recorded(method, *args, **kwargs):
        asked.append(method)
        return rpc(method, *args, **kwargs)

    monkeypatch.setattr(swap_engine.llm, "collective_rpc", recorded)
    weights = LLMWeights(swap_engine.llm)
    for version in (40, 41):
        weights.publish("draft", trained_head.export_state_dict(torch.float32), version)
    assert asked.count("grpo_swap_folder") == 1


def test_swap_with_engine_in_its_own_process(tiny_target, random_draft, trained_head, questions):
    engine = Engine(tiny_engine_config(tiny_target, random_draft, engine_process="separate"))
    try:
        before = engine.generate(questions, GREEDY)
        engine.swap_weights("draft", trained_head.export_state_dict(torch.float32), version=3)
        after = engine.generate(questions, GREEDY)
        assert engine.weight_versions()["draft"] == 3
        with pytest.raises(Exception, match="holds NaN"):
            engine.swap_weights("draft", _bad_weights(trained_head, "nan"), version=4)
        assert engine.weight_versions()["draft"] == 3
        folder = Path(engine.llm.collective_rpc("grpo_swap_folder")[0])
    finally:
        engine.shutdown()
    assert not folder.exists()  # an engine's folder goes with it, not to pile up in RAM
    assert [g[0].token_ids for g in before.outputs] == [g[0].token_ids for g in after.outputs]
    assert after.spec["mean_acceptance_length"] > before.spec["mean_acceptance_length"] + 0.5


# ---- an engine of its own, for states the shared engines must never get into -------------


@pytest.fixture(scope="module")
def private_engine(tiny_target, random_draft):
    engine = Engine(tiny_engine_config(tiny_target, random_draft))
    yield engine
    engine.shutdown()


def test_engine_reports_the_declared_versions_of_the_weights_it_starts_from(private_engine):
    assert private_engine.weight_versions() == {"policy": 0, "draft": 0}
    private_engine.declare_weight_versions({"policy": 4, "draft": 9})
    assert private_engine.weight_versions() == {"policy": 4, "draft": 9}
    with pytest.raises(Exception, match=r"unknown weight roles \['critic'\]"):
        private_engine.declare_weight_versions({"critic": 1})


def _fail_next_two_draft_loads(worker):
    """Runs in the worker: the next draft load stops halfway, and so does the restore after it."""
    model = worker.get_draft_model()
    original = model.load_weights
    failures = []

    def broken(weights):
        weights = list(weights)
        original(weights[: len(weights) // 2])
        failures.append(len(failures) + 1)
        if len(failures) == 2:
            model.load_weights = original
        raise RuntimeError(f"simulated load failure {failures[-1]}")

    model.load_weights = broken


def test_failed_restore_refuses_generation_until_that_role_swaps_whole(
    private_engine, plain_engine, trained_head, hf_target, questions
):
    engine = private_engine
    version = engine.weight_versions()["draft"]
    draft = trained_head.export_state_dict(torch.float32)
    engine.llm.collective_rpc(_fail_next_two_draft_loads)
    with pytest.raises(
        MixedWeightsError,
        match=rf"loading draft version {version + 1} failed \(RuntimeError: simulated load "
        rf"failure 1\), and restoring version {version} failed too \(RuntimeError: simulated "
        r"load failure 2\)",
    ):
        engine.swap_weights("draft", draft, version=version + 1)
    refusal = "refusing to generate: the draft weights may be a mix"
    with pytest.raises(MixedWeightsError, match=refusal):
        engine.generate(questions, GREEDY)
    # A policy that loads whole does not make the draft whole.
    policy = {k: v for k, v in hf_target.state_dict().items() if k != "lm_head.weight"}
    engine.swap_weights("policy", policy, version=5)
    with pytest.raises(MixedWeightsError, match=refusal):
        engine.generate(questions, GREEDY)
    engine.swap_weights("draft", draft, version=version + 2)
    assert engine.weight_versions() == {"policy": 5, "draft": version + 2}
    after = engine.generate(questions, GREEDY)
    plain = plain_engine.generate(questions, GREEDY)
    assert [g[0].token_ids for g in after.outputs] == [g[0].token_ids for g in plain.outputs]
    assert after.spec["mean_acceptance_length"] > 1.5  # the trained head drafts again

    # A restore that succeeds loads a whole set too.
    engine.llm.collective_rpc(_fail_next_two_draft_loads)
    with pytest.raises(MixedWeightsError):
        engine.swap_weights("draft", draft, version=version + 3)
    engine.llm.collective_rpc(_fail_halfway)
    with pytest.raises(Exception, match=f"restored version {version + 2}"):
        engine.swap_weights("draft", draft, version=version + 4)
    assert engine.generate(questions, GREEDY).spec == after.spec


# ---- the reduced-vocabulary head (vLLM's EAGLE-3 format with a d2t map) -----------------


@pytest.fixture(scope="module")
def reduced_head(tiny_target, hf_target):
    vocab = torch.randperm(hf_target.config.vocab_size, generator=torch.Generator().manual_seed(0))[
        :256
    ]
    eos = hf_target.config.eos_token_id
    return new_head(
        tiny_target,
        hf_target,
        seed=3,
        vocab_ids=torch.cat([vocab[vocab != eos][:255], torch.tensor([eos])]),
    )


@pytest.fixture(scope="module")
def reduced_engine(tmp_path_factory, tiny_target, reduced_head):
    draft = reduced_head.save(tmp_path_factory.mktemp("reduced_draft"))
    engine = Engine(tiny_engine_config(tiny_target, str(draft)))
    yield engine
    engine.shutdown()


def test_reduced_vocab_head_matches_vllm_eagle3_forward(reduced_engine, reduced_head, questions):
    assert reduced_engine.llm.llm_engine.vllm_config.speculative_config.method == "eagle3"
    reduced_engine.llm.collective_rpc(_capture_first_draft_forward)
    reduced_engine.generate(questions[:1], SamplingSettings(max_tokens=4))
    rec = reduced_engine.llm.collective_rpc(_take_capture)[0]
    with torch.no_grad():
        out = reduced_head(
            rec["input_ids"][None].long(), rec["hidden"][None], rec["positions"][None].long()
        )[0]
        draft_logits = reduced_head.draft_logits(out)
    torch.testing.assert_close(out, rec["aux"], atol=2e-4, rtol=1e-3)
    vllm_logits = rec["logits"][
        :, reduced_head.vocab_ids
    ]  # vLLM scatters draft logits into the full vocab
    torch.testing.assert_close(draft_logits, vllm_logits, atol=2e-3, rtol=1e-3)
    outside = torch.ones(rec["logits"].shape[1], dtype=torch.bool)
    outside[reduced_head.vocab_ids] = False
    assert torch.isinf(rec["logits"][:, outside]).all()  # never drafts outside its vocabulary


def test_reduced_vocab_speculation_is_lossless_and_swappable(
    reduced_engine, plain_engine, reduced_head, questions
):
    plain = plain_engine.generate(questions, GREEDY)
    before = reduced_engine.generate(questions, GREEDY)
    assert [g[0].token_ids for g in before.outputs] == [g[0].token_ids for g in plain.outputs]
    weights = reduced_head.export_state_dict(torch.float32)
    assert weights["d2t"].dtype == torch.int64
    reduced_engine.swap_weights("draft", weights, version=2, metadata=reduced_head.swap_metadata())
    assert reduced_engine.weight_versions()["draft"] == 2
    noisy = {
        k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()
    }
    reduced_engine.swap_weights("draft", noisy, version=3)
    after = reduced_engine.generate(questions, GREEDY)
    assert [g[0].token_ids for g in after.outputs] == [g[0].token_ids for g in plain.outputs]


def test_a_session_left_open_by_a_dead_trainer_is_undone_not_served(
    swap_engine, trained_head, questions
):
    """A trainer that dies between `start_draft_weight_update` and `finish_weight_update`
    left its loaded (scrambled) head serving under the old version, and vLLM's worker
    refusing every later start ("already active"). Now the engine undoes the dead
    trainer's load before it generates, and the next trainer's swap goes through; a
    session a live trainer holds is refused by name."""
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    from tests.conftest import scrambled

    meta = trained_head.swap_metadata()
    weights = trained_head.export_state_dict(torch.float32)
    swap_engine.swap_weights("draft", weights, 50, meta)
    good = swap_engine.generate(questions, GREEDY)

    def open_session(pid: int, version: int) -> None:
        own = Path(swap_engine.llm.collective_rpc("grpo_swap_folder")[0])
        path = own / f"draft-v{version}-p{pid}-0123abcd.safetensors"
        save_file(scrambled(weights), str(path), metadata=meta)
        try:
            swap_engine.llm.start_draft_weight_update()
            swap_engine.llm.update_weights({"update_info": {"path": str(path), "version": version}})
        finally:
            path.unlink()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    open_session(dead.pid, 51)
    after = swap_engine.generate(questions, GREEDY)
    assert after.spec == good.spec  # the trained head's drafts, not the scrambled one's
    assert swap_engine.weight_versions()["draft"] == 50
    swap_engine.swap_weights("draft", weights, 52, meta)
    assert swap_engine.weight_versions()["draft"] == 52

    open_session(os.getpid(), 53)  # a live trainer, mid-update
    with pytest.raises(RuntimeError, match=rf"trainer \(pid {os.getpid()}\) is alive"):
        swap_engine.swap_weights("draft", weights, 54, meta)
    swap_engine.llm.finish_weight_update()
    assert swap_engine.weight_versions()["draft"] == 53
    swap_engine.swap_weights("draft", weights, 55, meta)  # a whole head again for what follows
