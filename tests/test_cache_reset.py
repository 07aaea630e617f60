"""A weight update is done only once the engine's prefix cache is reset: vLLM answers a
reset with whether it happened (`LLM`/`AsyncLLM` return it; the server's route answers 200
`{"success": false}`), and verl's `clear_kv_cache` fails while requests run. A client that
took the answer for done let the old weights' KV serve on, with no error."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from vllm_plugin.weights.clients import CACHE_NOT_RESET, HTTPClient, RPCClient
from vllm_plugin.weights.swap_folder import engine_swap_folder
from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource


def _folder() -> str:
    return str(engine_swap_folder("test-cache-reset"))


class _Engine:
    """Takes the weight-update calls an engine's workers get, and records them."""

    def __init__(self):
        self.calls = []

    def rpc(self, method, kwargs=None):
        self.calls.append(method)
        return [_folder()] if method == "grpo_swap_folder" else None


def _push(client):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    weights = {"w": torch.zeros(2)}
    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, draft=True), client=client, source=StateDictSource(weights)
    )
    engine.send_weights(3)


@pytest.mark.parametrize("answer", [False, [True, False]])
def test_an_rpc_client_whose_reset_fails_raises(answer):
    engine = _Engine()
    with pytest.raises(RuntimeError, match=CACHE_NOT_RESET):
        _push(RPCClient(engine.rpc, lambda: answer))
    assert engine.calls[-1] == "finish_weight_update"  # loaded, then the reset failed


def test_an_rpc_client_whose_reset_succeeds_or_says_nothing_is_done():
    for answer in (True, None, [True, True]):
        _push(RPCClient(_Engine().rpc, lambda answer=answer: answer))


@pytest.fixture
def server():
    """A server on loopback answering vLLM's weight-update routes, its cache reset as told."""
    state = {"reset_success": False, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            state["paths"].append(self.path)
            sent = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b""
            if self.path.startswith("/reset_prefix_cache"):
                body = json.dumps({"success": state["reset_success"]}).encode()
            if self.path == "/collective_rpc" and json.loads(sent)["method"] == "grpo_swap_folder":
                body = json.dumps({"results": [_folder()]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def test_an_http_client_reads_the_reset_route_s_answer(server):
    url, state = server
    with pytest.raises(RuntimeError, match=CACHE_NOT_RESET):
        _push(HTTPClient(url, timeout=10))
    assert state["paths"][-1] == "/reset_prefix_cache?reset_running_requests=true"
    state["reset_success"] = True
    _push(HTTPClient(url, timeout=10))
