"""The plugin's contracts with the vLLM code that changed between 0.32 and 0.33, checked on
whichever of the two runs (`make test` on 0.32.0, `make test-vllm033` on 0.33.0's own code):
the trainer's side of the transfer through vLLM's factory and `WeightSource` API, the
worker's backend in vLLM's factory, and the CPU rejection sampler as vLLM's sampler calls it."""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from vllm_plugin.patches.fixes import cpu_rejection_sample_v0_32 as fast


class RecordingClient:
    """A `VLLMWeightSyncClient` that records the lifecycle's calls and reads the weight file
    while the update runs, as the engine would."""

    def __init__(self):
        self.calls, self.loaded = [], None

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)

    def update_weights(self, update_info):
        self.calls.append("update_weights")
        self.loaded = (load_file(update_info["path"]), update_info["version"])

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def swap_folder(self):
        from vllm_plugin.weights.swap_folder import engine_swap_folder

        self.calls.append("swap_folder")
        return str(engine_swap_folder("recording-client"))


def test_a_draft_goes_through_vllms_trainer_factory_and_weight_source_api():
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    weights = {"fc.weight": torch.randn(4, 8), "norm.weight": torch.ones(4)}
    source = StateDictSource(weights)
    metadata = source.metadata if isinstance(source.metadata, list) else source.metadata()
    assert [(m.name, tuple(m.shape)) for m in metadata] == [
        ("fc.weight", (4, 8)),
        ("norm.weight", (4,)),
    ]
    client = RecordingClient()
    sender = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, draft=True), client=client, source=source
    )
    sender.send_weights(version=9)
    assert client.calls == [
        "init_weight_transfer_engine",
        "swap_folder",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
    ]
    loaded, version = client.loaded
    assert version == 9 and loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[n], t) for n, t in weights.items())


def test_a_rank_other_than_zero_iterates_but_sends_nothing():
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    client = RecordingClient()
    sender = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=1), client=client, source=StateDictSource({"w": torch.ones(2)})
    )
    assert sender.send_weights(version=3) == 0.0 and client.calls == []


def test_the_workers_backend_is_in_vllms_factory():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import vllm_plugin
    from vllm_plugin.weights.shm_transfer import BACKEND, ShmWeightTransferEngine

    vllm_plugin.register()
    assert BACKEND in WeightTransferEngineFactory._registry
    engine_cls = WeightTransferEngineFactory._registry[BACKEND]()
    assert engine_cls is ShmWeightTransferEngine
    assert WeightTransferConfig(backend=BACKEND).backend == BACKEND


def _keywords_vllm_passes() -> set[str]:
    """The keyword arguments vLLM's `RejectionSampler.forward` calls `rejection_sample` with."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    tree = ast.parse(textwrap.dedent(inspect.getsource(RejectionSampler.forward)))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "rejection_sample"
    ]
    assert len(calls) == 1
    return {k.arg for k in calls[0].keywords}


def test_the_cpu_rejection_sampler_takes_every_argument_vllms_sampler_passes():
    keywords = _keywords_vllm_passes()
    assert "use_fp64_gumbel" in keywords  # read from the source, not assumed
    positional = [None] * 8  # draft ids ... sampling metadata
    inspect.signature(fast.rejection_sample).bind(*positional, **dict.fromkeys(keywords))


def test_the_cpu_rejection_sampler_answers_the_same_with_vllms_later_arguments():
    drafts = [[3, 4], [7, 1]]
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    counts = [2, 2]

    def run(**later):
        generators = {i: torch.Generator().manual_seed(5 + i) for i in range(2)}
        return fast.rejection_sample(
            torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
            counts,
            2,
            torch.tensor(counts).cumsum(0).to(torch.int32),
            None,
            logits,
            torch.full((2, 1), 9, dtype=torch.long),
            SimpleNamespace(
                all_greedy=False,
                all_random=True,
                temperature=torch.ones(2),
                generators=generators,
            ),
            **later,
        )

    # 0.33's FLy arguments as its sampler passes them with FLy off (none on 0.32)
    later = {k: None for k in _keywords_vllm_passes() if k.startswith("fly_")}
    later |= {"fly_entropy_top_k": 3} if "fly_entropy_top_k" in later else {}
    assert torch.equal(run(), run(**later))
