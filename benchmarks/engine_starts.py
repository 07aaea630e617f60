"""Engine starts in fresh processes: do they crash, does the compile cache load, how long
does start-up take. Each start is one `grpo-specdec generate` of the EAGLE engine (the
tiny models, compiled, not eager), one process after another, the compile cache warmed
by a first start that is not counted.

    python benchmarks/engine_starts.py --starts 30                # the plugin's patches on
    python benchmarks/engine_starts.py --starts 30 --no-patches   # vLLM 0.32 as shipped
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import cli, protocol_args, quiet_machine  # noqa: E402

INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOADED = "Directly load AOT compilation"
MISSED = "Compiling model again due to a load failure"


def start(args: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_specdec", *args], capture_output=True, text=True, env=env
    )
    log = proc.stdout + proc.stderr
    init = INIT.search(log)
    return {
        "rc": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "init_s": float(init.group(1)) if init else None,
        "cache_loads": log.count(LOADED),
        "cache_misses": log.count(MISSED),
        "fatal": "Fatal Python error" in log,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--starts", type=int, default=30)
    ap.add_argument("--no-patches", action="store_true", help="GRPO_SPECDEC_NO_PATCHES=1")
    protocol_args(ap, repeats=False)
    opts = ap.parse_args()
    quiet_machine(opts)
    work = Path(tempfile.mkdtemp(prefix="engine-starts-"))
    tiny = Path(cli("models", "tiny", "--out", str(work / "tiny")))
    prompts = work / "prompts.txt"
    prompts.write_text("Ana has 3 apples. Ana gets 4 more apples. How many apples now?\n")
    args = ["generate", "--model", str(tiny / "target"), "--draft", str(tiny / "draft")]
    args += ["--k", "3", "--prompts", str(prompts), "--temperature", "0", "--max-tokens", "48"]
    args += ["--json", str(work / "out.json")]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    if opts.no_patches:
        env["GRPO_SPECDEC_NO_PATCHES"] = "1"
    first = start(args, env)  # fills the compile cache
    print(f"cold start: rc {first['rc']}, {first['wall_s']:.1f} s", flush=True)
    runs = []
    for i in range(opts.starts):
        runs.append(start(args, env))
        r = runs[-1]
        print(
            f"start {i + 1}: rc {r['rc']}, wall {r['wall_s']:.1f} s, engine init {r['init_s']} s, "
            f"cache loads {r['cache_loads']}, misses {r['cache_misses']}",
            flush=True,
        )
    ok = [r for r in runs if r["rc"] == 0]
    print(
        f"\n{'patches off' if opts.no_patches else 'patches on'}: {len(runs)} warm-cache starts, "
        f"{len(runs) - len(ok)} crashed ({sum(r['fatal'] for r in runs)} fatal Python errors), "
        f"{sum(r['cache_loads'] == 2 for r in runs)} loaded both compiled models from the cache; "
        f"median wall {statistics.median(r['wall_s'] for r in runs):.1f} s, median engine init "
        f"{statistics.median(r['init_s'] for r in ok if r['init_s'] is not None):.1f} s"
    )


if __name__ == "__main__":
    main()
