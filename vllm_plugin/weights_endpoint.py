"""The served weights route's entry point (`grpo_specdec_weights` in pyproject.toml's
`vllm.endpoint_plugins`), kept at the path it has always named so that the metadata of an
existing install still finds it. The route is `vllm_plugin.weights.endpoint`."""

from vllm_plugin.weights.endpoint import WeightsEndpoint

__all__ = ["WeightsEndpoint"]
