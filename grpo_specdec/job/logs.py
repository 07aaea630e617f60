"""vLLM's messages in a log file of the run, not on the console.

vLLM warns at length about settings this project makes on purpose (eager mode, no
Triton on CPU, a custom scheduler, ...) and, on every weight swap, once per layer it
reloads without a parameter of its own ("Failed to load weights": tied or rotary layers;
the outputs match). Each of these reaches the console from every engine, Ray forwarding
the actors' output, and buries the progress and the tables a user came for. So every
vLLM record goes to OUT/vllm.log, only errors also to the console, and the job ends
with a count of the warnings in the file. vLLM's processes take the same handlers from
a logging config file (VLLM_LOGGING_CONFIG_PATH, set for this process too, whose own
engines read it); this process gets them directly as well.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
from pathlib import Path

LOG_NAME = "vllm.log"
_FORMAT = "%(asctime)s pid=%(process)d %(levelname)s [%(name)s:%(lineno)d] %(message)s"
_RECORD_START = re.compile(r"^\S+ \S+ pid=\d+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def file_handler(path: str) -> logging.Handler:
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    return handler


def console_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))
    return handler


def check_private(out: Path) -> None:
    """`out` must be this user's and writable by no one else: every vLLM process of the job
    runs the logging config written there (its handler factories are code), and the
    checkpoints there are loaded back; a folder others can write is a way to run code as this
    user or change the weights."""
    for parent in out.resolve().parents:
        mode = parent.stat().st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise ValueError(
                f"out={out}: its parent {parent} has mode {stat.S_IMODE(mode):04o}: anyone can "
                "replace the run folder inside it (chmod o-w, or the sticky bit as /tmp has)"
            )
    info = out.stat()
    if info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: others can write it (chmod go-w)"
    else:
        return
    raise ValueError(
        f"out={out} {problem}; the job writes there the logging config every vLLM process "
        "runs and the checkpoints it loads back, so it must be a folder only this user writes"
    )


class VllmLog:
    """Routes vLLM's records of this process and of the job's workers to `out`/vllm.log
    until `close`, which gives this process's vLLM logger back its own handlers."""

    def __init__(self, out: Path, level: str = "INFO"):
        """`level`: the least severe level the file keeps."""
        self.path = out / LOG_NAME
        self.level = level
        config_file = out / "vllm_logging.json"
        config_file.write_text(json.dumps(self._config(), indent=1))
        self.worker_env = {
            "VLLM_LOGGING_CONFIG_PATH": str(config_file),
            "VLLM_LOGGING_LEVEL": self.level,
        }
        # An engine this process starts (the latency profile's) reconfigures vLLM's logging
        # from the environment, which must then name the same config.
        self._saved_env = {k: os.environ.get(k) for k in self.worker_env}
        os.environ.update(self.worker_env)
        self._logger = logging.getLogger("vllm")
        self._saved = (self._logger.handlers[:], self._logger.level, self._logger.propagate)
        self._handlers = [file_handler(str(self.path)), console_handler()]
        self._logger.handlers = self._handlers[:]
        self._logger.setLevel(self.level)
        self._logger.propagate = False

    def _config(self) -> dict:
        """The same handlers as a logging.config dictionary, for vLLM to load."""
        return {
            "version": 1,
            "disable_existing_loggers": False,
            "handlers": {
                "file": {"()": f"{__name__}.file_handler", "path": str(self.path)},
                "console": {"()": f"{__name__}.console_handler"},
            },
            "loggers": {
                "vllm": {"handlers": ["file", "console"], "level": self.level, "propagate": False}
            },
        }

    def counts(self) -> dict[str, int]:
        """Records in the log file per level."""
        counts: dict[str, int] = {}
        if self.path.is_file():
            with self.path.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    if m := _RECORD_START.match(line):
                        counts[m[1]] = counts.get(m[1], 0) + 1
        return counts

    def summary(self) -> str:
        counts = self.counts()
        return (
            f"vLLM: {counts.get('WARNING', 0)} warnings, "
            f"{counts.get('ERROR', 0) + counts.get('CRITICAL', 0)} errors in {self.path}"
        )

    def close(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        handlers, level, propagate = self._saved
        self._logger.handlers = handlers
        self._logger.setLevel(level)
        self._logger.propagate = propagate
        for handler in self._handlers:
            handler.close()
