"""grpo-specdec: concurrency-aware speculative rollouts and online draft learning for GRPO."""

__version__ = "0.1.0"
