"""vLLM plugin of grpo-specdec.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process
it starts. It changes nothing unless a feature is switched on explicitly.
"""

LOADED = False


def register() -> None:
    global LOADED
    LOADED = True
