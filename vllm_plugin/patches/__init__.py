"""Fixes for vLLM bugs this project cannot work around otherwise; one module per fix,
each naming the vLLM version it targets and applying only there."""
