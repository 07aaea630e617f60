"""Fixes for vLLM bugs this project cannot work around otherwise; one module per fix,
each naming the vLLM version it targets and applying only there."""


def running_on_cpu(version: str) -> bool:
    """Whether this process runs vLLM `version` on CPU: the only place these fixes apply."""
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ == version and current_platform.is_cpu()
