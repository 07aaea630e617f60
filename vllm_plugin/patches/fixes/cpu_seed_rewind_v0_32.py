"""vLLM 0.32.0 and 0.33.0, CPU, Model Runner V1: a request with its own seed kills the engine
when its prefill is split over steps.

Each step samples a token for every scheduled request, the partial prefill chunks'
included, and throws away those a chunk made (`discard_request_mask`). So that a seeded
request's tokens do not depend on how its prefill was cut, `_bookkeeping_sync` then
rewinds the request's generator by one draw: `gen.set_offset(gen.get_offset() - 4)`,
the Philox offset of a CUDA generator. A CPU generator (Mersenne Twister) has no offset
and raises "CPU Generator does not use offset", which ends the engine core: any seeded
request on CPU whose prompt did not fit one step's token budget
(`grpo-specdec generate --seed S` on a few long prompts, or many).

The fix keeps vLLM's meaning with what a CPU generator has, its state: before a step
samples, the state of each seeded request whose token will be thrown away is saved;
bookkeeping puts it back, and vLLM's own rewind is left the CUDA generators.
"""

from __future__ import annotations

from vllm_plugin.patches import running_on_cpu, runs_v1_model_runner

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True
MARK = "_grpo_seed_rewind"


def _discarded_cpu_generators(runner) -> dict:
    """Batch index -> generator, for seeded requests on CPU whose token this step discards."""
    batch = runner.input_batch
    discard = runner.discard_request_mask.np[: batch.num_reqs]
    return {
        i: gen
        for i, gen in batch.generators.items()
        if i < len(discard) and discard[i] and gen.device.type == "cpu"
    }


def _wrap_sample(original):
    def _sample(self, *args, **kwargs):
        self._grpo_seed_states = {
            i: gen.get_state() for i, gen in _discarded_cpu_generators(self).items()
        }
        return original(self, *args, **kwargs)

    setattr(_sample, MARK, original)
    return _sample


def _wrap_bookkeeping(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_grpo_seed_states", None) or {}
        self._grpo_seed_states = {}
        generators = self.input_batch.generators
        rewound = {i: generators.pop(i) for i in saved if i in generators}
        for i, gen in rewound.items():
            gen.set_state(saved[i])
        try:  # vLLM's loop then rewinds only the generators it can (CUDA's)
            return original(self, *args, **kwargs)
        finally:
            generators.update(rewound)

    setattr(_bookkeeping_sync, MARK, original)
    return _bookkeeping_sync


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not hasattr(GPUModelRunner._sample, MARK):
        GPUModelRunner._sample = _wrap_sample(GPUModelRunner._sample)
    if not hasattr(GPUModelRunner._bookkeeping_sync, MARK):
        GPUModelRunner._bookkeeping_sync = _wrap_bookkeeping(GPUModelRunner._bookkeeping_sync)
    return True
