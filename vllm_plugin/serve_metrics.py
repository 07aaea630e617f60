"""`vllm serve` shows the plugin's k histogram on /metrics with no set-up by the user.

The scheduler, hence the histogram, lives in the engine-core process. With one API
server (the default) vLLM 0.32 serves /metrics from the API process's own registry, so
metrics made in the engine core never show; it switches prometheus_client to its
multiprocess mode only when it runs several API servers. This does the same for one:
in the API server's process, before the engine core starts (it inherits the directory),
through vLLM's own set-up, which also removes the directory at exit.
prometheus_client picks how metrics store values when it is first imported, which the
vllm CLI has done before plugins load, so that choice is made again here.
"""

from __future__ import annotations

import multiprocessing
import os
import sys


def is_serve_api_process() -> bool:
    """`vllm serve ...` (or `python -m vllm.entrypoints.cli.main serve ...`), not a child."""
    return sys.argv[1:2] == ["serve"] and multiprocessing.parent_process() is None


def enable_for_serve() -> bool:
    """Turn on multiprocess metrics in a serve API process; True if this call did."""
    if not is_serve_api_process() or "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return False
    from vllm_plugin.compat import enable_multiprocess_metrics

    enable_multiprocess_metrics()
    return True
