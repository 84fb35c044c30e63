"""The trainer's side of server mode: generate through a ``targetpo-vllm-serve`` process and push weights to it.

Weights travel over HTTP as safetensors bytes, in chunks. That works between any two machines, GPU or CPU, with no
shared communicator; it moves the whole model once per optimiser step, which is cheap next to generation for the
models this mode is tested with (see docs/vllm.md for large-model guidance).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx
import torch

#: Upper bound on the bytes of one weight-update request.
WEIGHT_CHUNK_BYTES = 256 * 1024 * 1024


class VLLMServerError(RuntimeError):
    """The server answered with an error."""


class VLLMServerGenerator:
    """A client of ``targetpo-vllm-serve``: health check, generation from token ids, weight updates."""

    def __init__(self, base_url: str, timeout: float, settings: dict[str, Any]):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.settings = settings
        # Generation of a large rollout may take minutes: no read timeout on the working requests.
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(None, connect=10.0))

    def wait_for_server(self) -> None:
        """Return once the server answers its health check; raise TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if self._http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError as error:
                last_error = error
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(
            f"No vLLM server answered at {self.base_url} within vllm_server_timeout={self.timeout:g} s "
            f"(last error: {last_error}). Start one on the generation devices with "
            "`targetpo-vllm-serve --model <the policy's model> --port <port>` before training, or point "
            "vllm_server_base_url (or vllm_server_host and vllm_server_port) at it."
        )

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (token ids), each from its own seed: token ids and their sampling log-probs."""
        body = {"prompts": [list(map(int, prompt)) for prompt in prompts], "seeds": list(seeds), "settings": self.settings}
        reply = self._post("/generate", json=body)
        return reply["completion_ids"], reply["logprobs"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the weights (Hugging Face names) in chunks of at most :data:`WEIGHT_CHUNK_BYTES`, then apply them
        all at once (the engine must never see part of a fused layer's weights)."""
        from safetensors.torch import save

        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in weights:
            # A private contiguous CPU copy: safetensors refuses tensors that share storage (tied embeddings).
            tensor = tensor.detach().to("cpu", copy=True).contiguous()
            if chunk and size + tensor.nbytes > WEIGHT_CHUNK_BYTES:
                self._post("/update_weights", content=save(chunk))
                chunk, size = {}, 0
            chunk[name] = tensor
            size += tensor.nbytes
        if chunk:
            self._post("/update_weights", content=save(chunk))
        self._post("/apply_weights")

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, **kwargs: Any) -> Any:
        response = self._http.post(path, **kwargs)
        if response.status_code == 400:
            raise ValueError(f"The vLLM server refused the request to {path}: {response.json().get('detail')}")
        if response.status_code != 200:
            raise VLLMServerError(f"The vLLM server failed on {path} ({response.status_code}): {response.text[:2000]}")
        return response.json()
