"""Swap weights into a `vllm serve` engine on this machine, from another process (a
trainer next to the server), through the plugin's token-checked `/v1/grpo/weights`
route (`vllm_plugin.weights.endpoint`): the API key, and for a swap the server's weights
token (default: GRPO_SPECDEC_WEIGHTS_TOKEN, as the server reads it)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import torch

from vllm_plugin.weights.swap_folder import swap_file

# The route's own token (not the API key): the server reads it from TOKEN_ENV, a swap
# carries it in TOKEN_HEADER.
TOKEN_ENV = "GRPO_SPECDEC_WEIGHTS_TOKEN"
TOKEN_HEADER = "X-Weights-Token"
FOLDER_TIMEOUT_S = 60.0


class ServedWeights:
    def __init__(
        self, url: str, api_key: str, weights_token: str | None = None, timeout_s: float = 600.0
    ):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self.weights_token = weights_token or os.environ.get(TOKEN_ENV, "")

    def _call(
        self, method: str, body: dict | None = None, path: str = "", timeout_s: float | None = None
    ) -> dict:
        request = urllib.request.Request(
            f"{self.url}/v1/grpo/weights{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={
                "Authorization": f"Bearer {self.api_key}",
                "Content-Type": "application/json",
                TOKEN_HEADER: self.weights_token,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(
                f"{self.url} refused the request ({err.code}): {err.read().decode()[:2000]}"
            ) from None

    def swap(
        self,
        role: str,
        weights: dict[str, torch.Tensor],
        version: int,
        metadata: dict | None = None,
    ) -> dict:
        """Load `role` ("policy" or "draft") weights into the served engine, as
        `Engine.swap_weights` does in-process; a rejected swap raises and the server keeps
        serving its old weights. After a timeout or a lost connection the server may
        have loaded them or not: `versions()` says which it serves."""
        # The engine's own folder, asked each time (a restarted server has another); a
        # question answered between steps, so not held to the swap's timeout.
        folder = self._call("GET", path="/folder", timeout_s=FOLDER_TIMEOUT_S)["swap_folder"]
        with swap_file(role, weights, version, metadata, folder) as path:
            try:
                return self._call("POST", {"role": role, "path": str(path), "version": version})
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                raise RuntimeError(
                    f"no answer from {self.url} to the {role} version {version} swap ({err}); "
                    "the server may or may not load it: versions() says which it serves"
                ) from err

    def versions(self) -> dict[str, int]:
        return self._call("GET")
