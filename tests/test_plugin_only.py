"""The plugin alone: what `pip install grpo-specdec` (no extra) brings beside a vLLM, and an
engine that runs the concurrency-aware scheduler and swaps a head through the plugin's own
trainer side with none of the job's packages importable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What only the job needs; a plugin-only install must pull none of them. (pyyaml and gguf are
# in the job extra too, but vLLM itself requires them.)
JOB_ONLY = {"ray", "tensorboard", "matplotlib", "datasets", "math-verify"}


def base_requirements(name: str) -> list[Requirement]:
    """`name`'s installed requirements outside any extra, for this interpreter."""
    reqs = [Requirement(r) for r in distribution(name).requires or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def closure(name: str) -> set[str]:
    """Every distribution a plain install of `name` pulls, read from the installed metadata."""
    seen, todo = set(), [name]
    while todo:
        dist = canonicalize_name(todo.pop())
        if dist in seen:
            continue
        seen.add(dist)
        try:
            todo += [r.name for r in base_requirements(dist)]
        except PackageNotFoundError:
            pass  # an optional platform package not installed here pulls nothing here
    return seen


def test_the_base_install_pulls_none_of_the_jobs_packages():
    pulled = closure("grpo-specdec")
    assert not pulled & JOB_ONLY, sorted(pulled & JOB_ONLY)
    assert {"torch", "pydantic", "safetensors"} <= pulled


def test_the_job_extra_holds_what_the_job_imports():
    reqs = [Requirement(r) for r in distribution("grpo-specdec").requires or []]
    job = {
        canonicalize_name(r.name)
        for r in reqs
        if r.marker is not None and r.marker.evaluate({"extra": "job"})
    }
    assert JOB_ONLY <= job, sorted(JOB_ONLY - job)


# Run in a fresh interpreter in which the job package and the job's dependencies cannot be
# imported: the plugin's scheduler and controller run an engine, and a head goes in through
# vLLM's trainer factory with the plugin's `grpo_shm` trainer side.
PLUGIN_ONLY = """
import os, sys

# Absent, as where they are not installed: `import` fails and `find_spec` answers None.
BLOCKED = ("grpo_specdec", "ray", "matplotlib", "datasets", "math_verify", "tensorboard")
for name in BLOCKED:
    sys.modules[name] = None
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vllm_plugin.k_table import every_k_table
from vllm_plugin.weights.clients import LLMClient
from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

target, draft = sys.argv[1], sys.argv[2]
llm = LLM(
    model=target, dtype="float32", max_model_len=256, max_num_seqs=8, enforce_eager=True,
    kv_cache_memory_bytes=1 << 27, seed=0,
    scheduler_cls="vllm_plugin.scheduler.ConcurrencyAwareScheduler",
    worker_extension_cls="vllm_plugin.weight_swap.WeightSwapExtension",
    weight_transfer_config={"backend": "grpo_shm"},
    speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": 3,
                        "num_speculative_tokens_per_batch_size": every_k_table(3, 8)},
)
greedy = SamplingParams(temperature=0, max_tokens=24)
prompts = [{"prompt_token_ids": [1, 5 + i, 9, 13 + i]} for i in range(4)]
tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
before = tokens()
head = {k: v + 0.01 * torch.randn_like(v) for k, v in
        load_file(os.path.join(draft, "model.safetensors")).items()}
sender = WeightTransferTrainerFactory.trainer_init(
    ShmTrainerInitInfo(rank=0, draft=True), client=LLMClient(llm), source=StateDictSource(head))
sender.send_weights(version=5)
versions = llm.collective_rpc("grpo_weight_versions")
assert tokens() == before, "a new head changed greedy text"
blocked = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in BLOCKED)
print("VERSIONS", versions, "BLOCKED-LOADED", blocked)
"""


@pytest.mark.slow
def test_the_plugin_alone_runs_its_scheduler_and_swaps_a_head(tiny_target, tiny_draft):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PLUGIN_ONLY), tiny_target, tiny_draft],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("VERSIONS"))
    assert "'draft': 5" in line and line.endswith("BLOCKED-LOADED []"), line
