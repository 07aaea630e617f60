"""Swap weights into a `vllm serve` engine on this machine, from another process (a
trainer next to the server), through the plugin's token-checked `/v1/grpo/weights`
route (`vllm_plugin.weights_endpoint`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from grpo_specdec.swap_files import SwapFiles


class ServedWeights:
    def __init__(self, url: str, api_key: str, timeout_s: float = 600.0):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self._files = SwapFiles()

    def _call(self, method: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(
            f"{self.url}/v1/grpo/weights",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
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
        serving its old weights. (After a timeout or a lost connection the file stays:
        the server may still be loading it.)"""
        path = self._files.write(role, weights, version, metadata)
        try:
            report = self._call("POST", {"role": role, "path": str(path), "version": version})
        except RuntimeError:  # refused: the server does not hold on to the file
            path.unlink(missing_ok=True)
            raise
        self._files.loaded(role, path)
        return report

    def versions(self) -> dict[str, int]:
        return self._call("GET")

    def close(self) -> None:
        """Remove the kept weight files (the server then cannot fall back on them)."""
        self._files.remove_all()
