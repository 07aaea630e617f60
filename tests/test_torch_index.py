"""`make setup`'s choice of where torch's CPU build comes from (tools/torch_index.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.conftest import ROOT
from tools.torch_index import index_reachable, pip_args, torch_requirement


def test_x86_64_asks_for_the_cpu_build_and_other_machines_for_the_plain_version():
    assert torch_requirement("x86_64") == "torch==2.13.0+cpu"
    assert torch_requirement("aarch64") == "torch==2.13.0"


def test_an_index_that_lists_torch_is_used(tmp_path):
    (tmp_path / "torch").mkdir()
    url = tmp_path.as_uri()
    assert index_reachable(url)
    assert pip_args(url)[1:] == ["--extra-index-url", url]


def test_an_unreachable_index_is_left_out_at_once(tmp_path):
    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url in (f"http://127.0.0.1:{port}/whl/cpu", (tmp_path / "none").as_uri()):
        assert not index_reachable(url, timeout_s=2.0)
        assert pip_args(url) == [torch_requirement()]


def test_the_file_prints_pip_arguments_and_says_why_an_index_is_left_out(tmp_path):
    # As `make setup` runs it, before anything is installed: -S leaves site-packages out.
    script = str(ROOT / "tools/torch_index.py")
    proc = subprocess.run(
        [sys.executable, "-S", script, (tmp_path / "none").as_uri()],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.split() == [torch_requirement()]
    assert "cannot be reached" in proc.stderr
