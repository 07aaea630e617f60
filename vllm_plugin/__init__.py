"""vLLM plugin of grpo-specdec.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process it
starts. It registers the `grpo_shm` weight-transfer backend (`weights.shm_transfer`).
Features (the concurrency-aware scheduler, the weight-swap extension, that backend) are
opt-in by configuration. What it does unasked is patch vLLM 0.32 and 0.33 (see `patches/`, one
module each, bugs of vLLM's in `fixes/`, what this project adds in `features/`): on CPU,
sampled speculative decoding that was not lossless and cost too much, sampled drafting
that cost more than it gained, engine starts that recompiled every time, aborted at
random, or failed after numba was imported; on vLLM's V1 model runner, a draft pass that
ran on steps drafting nothing (it now runs lazily, catching up when drafting resumes);
and, when configured, drafts from a GRPO group's text join the engine's own (its one per-
step hook, `take_draft_token_ids`); with several worker processes, replies that a failed
collective RPC left unread are read before it raises, so later calls get their own; and an
engine whose weights load through the plugin runs no step on weights that may be a mix,
whichever client drove the update (`features/weight_guard_v0_32`). Which model runner
engines run is vLLM's choice and the user's: where it is Model Runner V2 (vLLM's default
on CUDA), which none of the V1 patches reach, the plugin says once what they would have
given (`patches.say_runner`). Set GRPO_SPECDEC_NO_PATCHES=1 to leave vLLM untouched. In a
`vllm serve` API process it also turns on multiprocess metrics, so that /metrics shows the
engine core's (see `serve_metrics`).
"""

import logging
import os
import sys

# under vLLM's "vllm" logger, whose handler vLLM configures: a logger of our own has none,
# and Python drops its INFO records
logger = logging.getLogger(f"vllm.{__name__}")

LOADED = False
RUNNER: str | None = None  # the model runner this process's engines run: "V1" or "V2"
PATCHED: list[str] = []
SKIPPED: list[str] = []
SAID: set[str] = set()  # the console lines said in this process (each once)


def register() -> None:
    global LOADED, RUNNER
    LOADED = True
    # An extension point, not a patch: the `grpo_shm` weight-transfer backend.
    from vllm_plugin.weights import shm_transfer

    shm_transfer.register()
    if os.environ.get("GRPO_SPECDEC_NO_PATCHES") == "1":
        say_once(
            "grpo-specdec: GRPO_SPECDEC_NO_PATCHES=1 leaves vLLM unpatched: on CPU, sampled "
            "drafts at T > 0 are neither lossless nor cheap and a k = 0 step still runs the "
            "draft; group drafts are refused; on CUDA, Model Runner V2 runs some k without a "
            "FULL graph"
        )
        return
    import vllm
    from vllm.platforms import current_platform

    from vllm_plugin import compat, patches

    if not patches.vllm_is(compat.SUPPORTED_VERSIONS):
        say_unsupported(vllm.__version__)
        return
    from vllm_plugin import serve_metrics

    serve_metrics.enable_for_serve()
    from vllm_plugin.patches.features import (
        cpu_sampled_drafts_v0_32,
        free_k0_v0_32,
        group_drafts_v0_32,
        weight_guard_v0_32,
    )
    from vllm_plugin.patches.fixes import (
        cpu_compile_cache_v0_32,
        cpu_expand_kernel_v0_32,
        cpu_kernel_scan_v0_32,
        cpu_onednn_release_v0_32,
        cpu_rejection_sample_v0_32,
        cpu_seed_rewind_v0_32,
        rpc_replies_v0_32,
        v2_graph_candidates_v0_32,
    )

    if RUNNER is None:
        patches.say_runner()
        RUNNER = patches.runner_name()
    for patch in (
        cpu_expand_kernel_v0_32,
        cpu_rejection_sample_v0_32,
        cpu_sampled_drafts_v0_32,
        cpu_onednn_release_v0_32,
        cpu_compile_cache_v0_32,
        cpu_kernel_scan_v0_32,
        cpu_seed_rewind_v0_32,
        free_k0_v0_32,
        group_drafts_v0_32,
        weight_guard_v0_32,
        rpc_replies_v0_32,
        v2_graph_candidates_v0_32,
    ):
        name = patch_name(patch)
        if name in PATCHED or name in SKIPPED:
            continue
        if patch.apply():
            PATCHED.append(name)
        else:
            # register() may run again in the same process: say it once.
            SKIPPED.append(name)
            logger.warning(
                "grpo-specdec patch %s not applied: vLLM %s on %s, Model Runner %s, is not "
                "what it targets (vLLM %s; see the module's docstring)",
                name,
                vllm.__version__,
                current_platform.device_type,
                RUNNER,
                ", ".join(patch.TARGET_VERSIONS),
            )


def say_unsupported(version: str) -> None:
    """One line on the console (and in vLLM's log) per process, when vLLM is a release whose
    internals the plugin was not checked against: every patch is off."""
    from vllm_plugin import compat

    say_once(
        f"grpo-specdec: vLLM {version} is not a release this plugin was checked against "
        f"({', '.join(compat.SUPPORTED_VERSIONS)}), so none of its patches of vLLM is applied: "
        "on CPU, sampled drafts at T > 0 are neither lossless nor cheap and a k = 0 step still "
        "runs the draft, group drafts are refused; on CUDA, Model Runner V2 runs some k without "
        "a FULL graph. What uses vLLM's extension points still runs: the concurrency-aware "
        "scheduler (which warns if vLLM does not run the k it chooses), the weight-swap "
        "extension, the grpo_shm transfer backend. Install vllm 0.32 or 0.33 for all of it."
    )


def say_once(message: str) -> None:
    """`message` on the console (stderr: a job routes vLLM's log to a file) and in vLLM's
    log, once per process."""
    if message in SAID:
        return
    SAID.add(message)
    print(message, file=sys.stderr, flush=True)
    logger.warning(message)


def patch_name(patch) -> str:
    """How PATCHED and SKIPPED name the patch module `patch`."""
    return patch.__name__.rsplit(".", 1)[1]


def applied(patch) -> bool:
    """Whether the patch module `patch` is applied in this process, after loading vLLM's
    general plugins (this one among them) as vLLM does when it builds engine arguments."""
    from vllm_plugin import compat

    compat.load_general_plugins()
    return patch_name(patch) in PATCHED
