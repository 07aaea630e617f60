"""Which CUDA graphs vLLM 0.32 prepares for the engines this project builds, asked of
vLLM's own decision code (no GPU here): the config our `Engine` gives vLLM, built on CPU,
then set up as on CUDA (vLLM's default graph mode there, FULL_AND_PIECEWISE, and Triton
present), and vLLM's own steps run on it: the dynamic-k override of the graph mode
(`VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`), the capture sizes
(`VllmConfig._set_cudagraph_sizes`) and Model Runner V2's capture list and dispatch
(`vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager`)."""

from __future__ import annotations

import logging

import pytest
import vllm.config.vllm as vllm_config_module
from vllm.config.compilation import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from grpo_specdec.vllm_compat import reread_environment
from tests.conftest import engine_kwargs, tiny_engine_config, unset_until_teardown
from vllm_plugin.k_table import every_k_table
from vllm_plugin.patches.fixes import v2_graph_candidates_v0_32
from vllm_plugin.scheduler import check_engine

K_MAX = 5
MAX_NUM_SEQS = 256
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def cuda_config(monkeypatch, cfg, runner: str | None = None):
    """The VllmConfig of `Engine(cfg)`, with the graph mode and sizes vLLM would give it on
    CUDA; `runner`: VLLM_USE_V2_MODEL_RUNNER ("0", "1"), or None for vLLM's own choice."""
    config = EngineArgs(**engine_kwargs(monkeypatch, cfg)).create_engine_config()
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    unset_until_teardown(monkeypatch, RUNNER_ENV)
    if runner is not None:
        monkeypatch.setenv(RUNNER_ENV, runner)
    reread_environment()
    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.max_cudagraph_capture_size = None
    compilation.cudagraph_capture_sizes = None
    config.model_config.enforce_eager = False
    # in the order VllmConfig.__post_init__ runs them
    config._maybe_override_dynamic_sd_cudagraph_mode()
    config._set_cudagraph_sizes()
    return config


def v2_graphs(config, as_shipped: bool = False) -> CudaGraphManager:
    """Model Runner V2's graph manager for `config`, its captures planned (the manager's own
    `_init_candidates`, with the plugin's patch as a CUDA process applies it, or as vLLM
    ships it) and taken as captured, so `dispatch` answers as at run time."""
    assert v2_graph_candidates_v0_32.apply()  # Triton stubbed present by cuda_config
    manager = CudaGraphManager.__new__(CudaGraphManager)
    manager.vllm_config = config
    manager.compilation_config = config.compilation_config
    manager.max_num_reqs = config.scheduler_config.max_num_seqs
    manager.cudagraph_mode = config.compilation_config.cudagraph_mode
    spec = config.speculative_config
    # V2's decode_query_len: draft steps plus the one token EAGLE samples per step
    manager.decode_query_len = (spec.num_speculative_tokens if spec else 0) + 1
    manager.varlen_decode = False
    manager.ubatch_runner = None
    manager.lora_capture_cases = [0]
    manager._lora_dispatch_map, manager._max_lora_case = manager._build_lora_dispatch_map()
    manager._candidates, manager._capture_descs = {}, {}
    if as_shipped:
        CudaGraphManager._init_candidates._grpo_original(manager)
    else:
        manager._init_candidates()
    manager._graphs_captured = True
    return manager


def decode_mode(manager, batch: int, k: int) -> CUDAGraphMode:
    """The graph a decode step of `batch` requests at `k` draft tokens each runs."""
    return manager.dispatch(batch, batch * (k + 1), k + 1, 0, max_query_len=k + 1).cg_mode


def full_batches(manager, k: int) -> set[int]:
    return {
        b for b in range(1, MAX_NUM_SEQS + 1) if decode_mode(manager, b, k).has_full_cudagraphs()
    }


def aware_config(tiny_target, tiny_draft, **overrides):
    speculative = {"draft": tiny_draft, "k": K_MAX, "concurrency_aware": True}
    return tiny_engine_config(
        tiny_target, tiny_draft, speculative=speculative, enforce_eager=False, **overrides
    )


def test_the_table_lists_each_k_once_in_vllms_dense_lookup():
    from vllm_plugin.compat import dense_k_table

    lookup = dense_k_table(every_k_table(K_MAX, MAX_NUM_SEQS), MAX_NUM_SEQS, K_MAX)[1:]
    assert set(lookup) == set(range(K_MAX + 1))
    assert len(lookup) == MAX_NUM_SEQS
    # an engine of at most k_max sequences keeps the largest k that fit
    assert dense_k_table(every_k_table(K_MAX, 3), 3, K_MAX)[1:] == [5, 4, 3]


def test_on_v2_every_k_gets_a_full_decode_graph_wherever_a_plain_engine_has_one(
    monkeypatch, tiny_target, tiny_draft
):
    """vLLM's default on CUDA: no PIECEWISE override, and for every k in 0..k_max a FULL
    decode graph at every batch whose B (k + 1) tokens fit the captured sizes; at k = 0 the
    same batches as an engine with no speculation at all."""
    aware = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft))
    assert aware.use_v2_model_runner
    assert aware.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    ceiling = aware.compilation_config.max_cudagraph_capture_size
    manager = v2_graphs(aware)
    for k in range(K_MAX + 1):
        full = full_batches(manager, k)
        # every batch up to k's largest graph, which vLLM's capture sizes (a 16-token
        # stride near the ceiling) put within 16 tokens of it
        assert full == set(range(1, max(full) + 1)), f"k = {k}"
        assert (max(full) + 1) * (k + 1) > min(ceiling, MAX_NUM_SEQS * (k + 1)) - 16, k
    plain = cuda_config(monkeypatch, tiny_engine_config(tiny_target, enforce_eager=False))
    assert full_batches(manager, 0) == full_batches(v2_graphs(plain), 0)


def test_as_vllm_ships_it_v2_leaves_a_step_piecewise_where_another_ks_graph_is_next(
    monkeypatch, tiny_target, tiny_draft
):
    """Why patches/fixes/v2_graph_candidates_v0_32.py exists: vLLM's own candidate map gives each
    token count only the graphs of the next captured size, which with every k listed often
    belong to another k (the figures its docstring gives)."""
    aware = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft))
    shipped = v2_graphs(aware, as_shipped=True)
    covered = {k: len(full_batches(shipped, k)) for k in range(K_MAX + 1)}
    assert covered[0] == 166 and covered[2] == 75
    assert all(covered.values())  # every k has some FULL graph all the same
    # a plain engine's map is the same either way: the patch acts on a per-step k only
    plain = cuda_config(monkeypatch, tiny_engine_config(tiny_target, enforce_eager=False))
    assert v2_graphs(plain)._candidates == v2_graphs(plain, as_shipped=True)._candidates


def test_on_v1_a_per_step_k_turns_the_engine_piecewise(monkeypatch, tiny_target, tiny_draft):
    """What docs/USAGE.md says is lost on V1 (VLLM_USE_V2_MODEL_RUNNER=0): vLLM overrides
    the graph mode for any engine whose k varies per step, k_max steps included."""
    config = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft), runner="0")
    assert not config.use_v2_model_runner
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_a_table_of_k_max_alone_leaves_other_k_without_full_graphs(
    monkeypatch, tiny_target, tiny_draft, caplog
):
    """The table an engine used to pass, [(1, max_num_seqs, k_max)]: on V2 only k_max
    steps get a FULL graph; the scheduler says which k get none."""
    config = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft))
    config.speculative_config.num_speculative_tokens_per_batch_size = [(1, MAX_NUM_SEQS, K_MAX)]
    config.compilation_config.max_cudagraph_capture_size = None
    config.compilation_config.cudagraph_capture_sizes = None
    config._set_cudagraph_sizes()
    manager = v2_graphs(config)
    assert full_batches(manager, K_MAX)
    assert not any(full_batches(manager, k) for k in range(K_MAX))
    with caplog.at_level(logging.WARNING, logger="vllm_plugin.scheduler"):
        check_engine(config, K_MAX)
    [said] = [r.getMessage() for r in caplog.records if "no full CUDA graph" in r.getMessage()]
    assert "[0, 1, 2, 3, 4]" in said and "every_k_table" in said


def test_an_engine_with_every_k_is_not_warned(monkeypatch, tiny_target, tiny_draft, caplog):
    config = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft))
    with caplog.at_level(logging.WARNING, logger="vllm_plugin.scheduler"):
        check_engine(config, K_MAX)
    assert not [r for r in caplog.records if "CUDA graph" in r.getMessage()]


# ---- data parallelism -------------------------------------------------------------------------
def moe_model_config(folder):
    """vLLM's ModelConfig of a tiny mixture-of-experts model (a config file is all it reads)."""
    import json

    from transformers import Qwen2MoeConfig
    from vllm.config import ModelConfig

    Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        architectures=["Qwen2MoeForCausalLM"],
    ).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["num_experts"] == 4
    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32")


def test_data_parallel_moe_is_refused_dense_is_not(monkeypatch, tiny_target, tiny_draft, tmp_path):
    """vLLM's own `is_moe` on a real MoE config: its data-parallel ranks step together, so a
    per-rank k is refused by name; a dense model's ranks are independent engines."""
    config = cuda_config(monkeypatch, aware_config(tiny_target, tiny_draft))
    dense = config.model_config
    assert not dense.is_moe
    config.parallel_config.data_parallel_size = 2
    check_engine(config, K_MAX)
    config.model_config = moe_model_config(tmp_path)
    assert config.model_config.is_moe
    with pytest.raises(ValueError, match=r"data_parallel_size=2 on a mixture-of-experts"):
        check_engine(config, K_MAX)
    config.parallel_config.data_parallel_size = 1
    check_engine(config, K_MAX)
