"""Config plumbing: strict pydantic models, loaded from YAML and validated once at the edge."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)

# vLLM's `draft_sample_method`: the draft proposes its argmax, or samples from its q.
DraftSampling = Literal["greedy", "probabilistic"]


def _yaml_off(value):
    # YAML reads a bare `off` as false.
    return "off" if value is False else value


def with_off(choices):
    """A Literal of `choices` (one of them "off") that also takes YAML's bare `off`."""
    return Annotated[choices, BeforeValidator(_yaml_off)]


class StrictModel(BaseModel):
    """Base for every config: unknown keys are errors, not silently ignored, and so are
    inf and NaN (YAML reads `.inf` and `.nan` as floats, which no bound refuses)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the field."""


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate(model_cls: type[M], data: Any, source: str = "<config>") -> M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides; the value is parsed as YAML (so `3`, `true`, `[1,2]`)."""
    out = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: the value {raw!r} of {key} is not valid YAML ({problem})"
            ) from None
    return out


def load_yaml(model_cls: type[M], path: str | Path, overrides: list[str] = ()) -> M:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return validate(model_cls, apply_overrides(data, list(overrides)), str(path))
