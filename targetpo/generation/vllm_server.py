"""Rollouts through a ``vllm serve`` process, with vLLM's own endpoints and weight-transfer API.

Start the server on the devices reserved for generation (``targetpo-vllm-serve`` prints and runs the command), then
train on the others. The main training process talks to the server: it sends every process's prompts, as token ids,
to vLLM's token-in/token-out endpoint (prompts with images as their unexpanded ids and the images, lossless PNG
data URLs, which the server's processor expands) and hands each process its share; after each optimiser step it pushes the
policy's weights with vLLM's weight-transfer engines (NCCL between GPUs; on CPUs the gloo engine of
``gloo_transfer.py``, which vLLM loads as a plugin). Every error, on the server or on any process, reaches every
process.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import httpx
import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch import nn

from ..distributed import failures_reach_every_process
from .base import (
    Completions,
    PendingCompletions,
    PromptImages,
    RolloutBackend,
    check_expanded_prompts,
    pad_completions,
    unpadded_prompts,
)
from .sampling import SamplingSettings
from .server_auth import KEY_VARIABLE, authorization_headers
from .server_liveness import ServerStalled, while_alive
from .server_restarts import TRIES_AFTER_A_LOSS, ServerRestarts, foreign_labels
from .vllm_backend import engine_weight_metadata, export_for_engine, make_sampling_params

#: How the trainer starts the server it talks to, for error messages.
SERVE_HINT = "`targetpo-vllm-serve --model <the policy's model> --port <port>` (see docs/vllm.md)"


#: How far float32 rounding may take a server's log-probs above 0, and the probabilities of one position's distinct
#: tokens above 1 in sum. Logits exceed these bounds by far more, unless all are well below 0.
LOGPROB_ROUNDING = 1e-3


def logprobs_problem(logprobs: Iterable[float]) -> str | None:
    """Why ``logprobs``, the top log-probs of distinct tokens at one position, cannot be log-probs; None if they can.

    A top-k holds at most all of the probability, and all but a sliver of it where the distribution is peaked (a
    trained model's next token), so only rounding may take it above 1."""
    values = list(logprobs)
    if max(values) > LOGPROB_ROUNDING:
        return f"{max(values):.4g} is above 0"
    total = sum(math.exp(value) for value in values)
    if total > 1 + LOGPROB_ROUNDING:
        return f"their probabilities sum to {total:.4g}, above 1"
    return None


class VLLMServerError(RuntimeError):
    """The vLLM server answered with an error."""


class ServerGone(VLLMServerError):
    """The vLLM server could not be reached, dropped a request, or holds other weights than the trainer pushed (it
    restarted): it went away, and may come back (``server_restarts.py``)."""


#: The errors after which the work lost with the server is done again once it is back.
SERVER_LOST = (ServerGone, ServerStalled)


class VLLMServerAuthenticationError(VLLMServerError):
    """The vLLM server refused the trainer's API key (HTTP 401 or 403): a missing or wrong key, not a slow server."""


class GenerationCancelled(RuntimeError):
    """A :meth:`VLLMServerClient.generate` call was cancelled before its completions were made."""


class Cancellation:
    """Cancels one :meth:`VLLMServerClient.generate` call from another thread.

    Cancelling closes the call's connections, and vLLM's server aborts a request whose client went away. (Its
    ``/abort_requests`` endpoint, given the request ids, sometimes leaves a request running in vLLM 0.32, so it is
    not relied on.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.cancelled = False

    def attach(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        """Called on the generating thread once its requests are about to go out."""
        with self._lock:
            self._loop, self._task = loop, task
            if self.cancelled:
                task.cancel()

    def detach(self) -> None:
        with self._lock:
            self._loop = self._task = None

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)


class VLLMServerClient:
    """HTTP client of a ``vllm serve`` process started with ``VLLM_SERVER_DEV_MODE=1``.

    Besides generation it implements vLLM's weight-sync client protocol (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``) that trainer-side transfer engines drive.
    """

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None, stall_timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.stall_timeout = stall_timeout  # None: wait on a request for as long as it takes
        self.weight_version: str | None = None  # the label of the weights being pushed, set on finishing the update
        self._has_key = api_key is not None
        self._headers = authorization_headers(api_key)  # on every request, the health checks included
        # A weight update or a large generation may take minutes: no read timeout, a bounded connect.
        self._http = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(None, connect=timeout), headers=self._headers
        )

    # ------------------------------------------------------------------------------------------ control
    def wait_for_server(self) -> None:
        """Return once the server answers its health check and accepts this client's key; raise TimeoutError after
        ``timeout`` seconds without an answer, and :class:`VLLMServerAuthenticationError` at once on a refused key."""
        deadline = time.monotonic() + self.timeout
        last_error: Exception | str | None = None
        while time.monotonic() < deadline:
            try:
                response = self._http.get("/health", timeout=5.0)
                if response.status_code == 200:
                    break
                self._raise_if_refused(response, "/health")  # waiting longer would not change the answer
                last_error = f"HTTP {response.status_code}"
            except httpx.HTTPError as error:
                last_error = error
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        else:
            raise TimeoutError(
                f"No vLLM server answered at {self.base_url} within vllm_server_timeout={self.timeout:g} s (last "
                f"error: {last_error}). Start one on the generation devices with {SERVE_HINT} before training, or "
                "point vllm_server_base_url (or vllm_server_host and vllm_server_port) at it."
            )
        # The health checks are open, so the key is tested here, before any training: on an inference route (vLLM's
        # own --api-key guards those) and on a weight-update route (targetpo-vllm-serve's middleware guards those).
        self._raise_if_refused(self._http.get("/v1/models"), "/v1/models")
        world_size = self._http.get("/get_world_size")
        self._raise_if_refused(world_size, "/get_world_size")
        if world_size.status_code == 404:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} has no weight-update endpoints: start it with "
                f"VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config, as {SERVE_HINT} does."
            )

    def check_sampled_logprobs(self) -> None:
        """Refuse a server that reports the model's raw log-probs rather than those of the distribution it sampled
        (``--logprobs-mode processed_logprobs``): importance weights and the sampler's p_old would be off wherever
        temperature or the other sampling settings reshape it. Only processed log-probs change with temperature, so
        one token's top log-probs are asked for at two, after a prompt whose next token is not uniform (a flat
        distribution reads the same at any temperature). Processed logits change with it too: their values, which
        cannot be log-probs (:func:`logprobs_problem`), refuse them."""
        for prompt in ([0, 1, 2, 3], [3, 2, 1], [1]):  # ids every vocabulary has
            at_one, at_half = (self._top_logprobs(prompt, temperature) for temperature in (1.0, 0.5))
            for temperature, reading in ((1, at_one), (0.5, at_half)):
                problem = logprobs_problem(reading.values())
                if problem is not None:
                    raise VLLMServerError(
                        f"The vLLM server at {self.base_url} reports values that cannot be log-probs (one token's "
                        f"top {len(reading)} at temperature {temperature}: {problem}), so its --logprobs-mode is "
                        "processed_logits or raw_logits: training would take logits for the sampler's log-probs. "
                        f"Restart it with --logprobs-mode processed_logprobs, as {SERVE_HINT} does."
                    )
            if max(at_one.values()) - min(at_one.values()) < 1e-3:
                continue
            shared = at_one.keys() & at_half.keys()
            if all(abs(at_one[token] - at_half[token]) < 1e-6 for token in shared):
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} reports the same log-probs at temperature 1 and 0.5, so it "
                    "does not report the log-probs of the distribution it samples (its --logprobs-mode is "
                    "raw_logprobs, the default, or raw_logits): the sampler's log-probs training relies on would be "
                    f"wrong. Restart it with --logprobs-mode processed_logprobs, as {SERVE_HINT} does."
                )
            return

    def _top_logprobs(self, prompt: list[int], temperature: float) -> dict[int, float]:
        """The server's top log-probs of the token after ``prompt``, by token id."""
        body = {
            "request_id": f"targetpo-logprobs-mode-check-{time.monotonic_ns()}",
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 1, "temperature": temperature, "logprobs": 5, "seed": 0},
        }
        entry = self._request("POST", "/inference/v1/generate", json=body)["choices"][0]["logprobs"]["content"][0]
        return {top["token_id"]: top["logprob"] for top in [entry, *entry.get("top_logprobs", [])]}

    def answers_health(self) -> bool:
        """Whether the server answers its health check now."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def served_weights(self) -> str:
        """The label of the weights the server holds: the version last pushed, or its own ("default")."""
        return str(self._request("GET", "/weight_info")["weight_version"])

    def world_size(self) -> int:
        """The number of vLLM workers (tensor × pipeline × data parallel) that receive weights."""
        return int(self._request("GET", "/get_world_size")["world_size"])

    def pause(self) -> None:
        """Freeze in-flight requests (they continue on :meth:`resume`) while the weights change."""
        self._request("POST", "/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def forget_cached_activations(self) -> None:
        """Drop the prefix cache's keys and values and the encoder's cached image features: both were computed with
        the weights just replaced, and a later prompt sharing a cached prefix or image would be served them. Requests
        kept through a pause give up their cache too and recompute it with the new weights."""
        reset = self._request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (reset or {}).get("success", False):
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} could not drop its prefix cache after a weight push, so prompts "
                "would be continued from keys and values of the old weights. Start it without a KV connector that "
                "holds cache blocks, or with --no-enable-prefix-caching."
            )
        self._request("POST", "/reset_encoder_cache")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.weight_version
        self._request("POST", "/finish_weight_update", json={"weight_version": version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine")

    def close(self) -> None:
        self._http.close()

    def _raise_if_refused(self, response: httpx.Response, path: str) -> None:
        """Raise :class:`VLLMServerAuthenticationError`, saying which setting to fix, on HTTP 401 or 403."""
        if response.status_code not in (401, 403):
            return
        problem = (
            "refused the API key this trainer sent"
            if self._has_key
            else "requires an API key and this trainer sent none"
        )
        raise VLLMServerAuthenticationError(
            f"The vLLM server at {self.base_url} {problem} (HTTP {response.status_code} on {path}). Set "
            f"vllm_server_api_key (or, with that unset, {KEY_VARIABLE} in every training process's environment) to "
            f"the key the server was started with (`targetpo-vllm-serve --api-key`, or {KEY_VARIABLE} in its "
            "environment)."
        )

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            if self.stall_timeout is None:
                response = self._http.request(method, path, **kwargs)
            else:
                response = asyncio.run(self._watched_request(method, path, kwargs))
        except httpx.TransportError as error:
            raise ServerGone(f"The vLLM server at {self.base_url} could not be reached for {path}: {error}") from error
        except httpx.HTTPError as error:
            raise VLLMServerError(f"The vLLM server at {self.base_url} failed on {path}: {error}") from error
        self._raise_if_refused(response, path)
        _raise_for_status(response, path)
        return response.json() if response.content else None

    async def _watched_request(self, method: str, path: str, kwargs: dict[str, Any]) -> httpx.Response:
        """The request, given up with :class:`ServerStalled` once the server stops answering its health check."""
        timeout = httpx.Timeout(None, connect=self.timeout)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout, headers=self._headers) as http:
            request = http.request(method, path, **kwargs)
            return await while_alive(request, self.base_url, self._headers, self.stall_timeout, f"waiting on {path}")

    # ------------------------------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        fields: dict[str, Any] | Sequence[dict[str, Any]],
        seeds: Sequence[int],
        request_ids: Sequence[str],
        cancellation: Cancellation | None = None,
        image_urls: Sequence[Sequence[str]] | None = None,
    ) -> list[dict[str, Any]]:
        """One completion per prompt, all requests in flight at once (vLLM batches them): per prompt its token ids,
        their sampling log-probs and the versions of the weights that wrote them. ``fields`` are the sampling
        parameters of every request, or of each. ``image_urls`` gives each prompt's images (a prompt with some is
        given unexpanded; its reply holds the expanded ``prompt_token_ids``). ``cancellation.cancel()``, from any
        thread, stops them: this raises :class:`GenerationCancelled` and the server aborts the requests."""
        if isinstance(fields, dict):
            fields = [fields] * len(prompts)
        image_urls = image_urls or [[] for _ in prompts]
        try:
            return asyncio.run(self._generate_all(prompts, fields, seeds, request_ids, cancellation, image_urls))
        except asyncio.CancelledError:
            raise GenerationCancelled(f"Generation of {len(prompts)} completions was cancelled.") from None

    async def _generate_all(
        self, prompts, fields, seeds, request_ids, cancellation, image_urls
    ) -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        timeout = httpx.Timeout(None, connect=self.timeout)
        if cancellation is not None:
            cancellation.attach(asyncio.get_running_loop(), asyncio.current_task())
        try:
            async with httpx.AsyncClient(
                base_url=self.base_url, timeout=timeout, limits=limits, headers=self._headers
            ) as http:
                requests = [
                    self._generate_one(http, prompt, {**request_fields, "seed": int(seed)}, request_id, urls)
                    for prompt, request_fields, seed, request_id, urls in zip(
                        prompts, fields, seeds, request_ids, image_urls
                    )
                ]
                every_request = asyncio.gather(*requests)
                if self.stall_timeout is not None:
                    doing = f"generating {len(requests)} completions"
                    every_request = while_alive(every_request, self.base_url, self._headers, self.stall_timeout, doing)
                return list(await every_request)
        finally:
            if cancellation is not None:
                cancellation.detach()

    async def _generate_one(
        self, http: httpx.AsyncClient, prompt, sampling_params, request_id, image_urls
    ) -> dict[str, Any]:
        body = {
            "request_id": request_id,
            "token_ids": [int(token) for token in prompt],
            "sampling_params": sampling_params,
        }
        if image_urls:
            body["content_parts"] = [{"type": "image_url", "url": url} for url in image_urls]
            body["return_token_ids"] = True
        try:
            response = await http.post("/inference/v1/generate", json=body)
        except httpx.HTTPError as error:
            raise ServerGone(f"The vLLM server at {self.base_url} could not be reached to generate: {error}") from error
        self._raise_if_refused(response, "/inference/v1/generate")
        _raise_for_status(response, "/inference/v1/generate")
        choice = response.json()["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        return {
            "token_ids": choice["token_ids"] or [],
            "logprobs": [entry["logprob"] for entry in content],
            "weight_versions": [span["version"] for span in choice.get("weight_versions") or []],
            "finish_reason": choice.get("finish_reason"),
            "prompt_token_ids": response.json().get("prompt_token_ids") if image_urls else None,
        }


def server_prompts(prompts: list[list[int]], images: PromptImages | None) -> tuple[list[list[int]], list[list[str]]]:
    """The token ids the server is sent for each prompt, and each prompt's images as data URLs: rows with images go
    as their unexpanded ids, which the server expands."""
    if images is None:
        return prompts, [[] for _ in prompts]
    rows = zip(prompts, images.unexpanded_ids, images.images)
    ids = [unexpanded if urls else prompt for prompt, unexpanded, urls in rows]
    return ids, [[image_data_url(image) for image in row_images] for row_images in images.images]


#: PIL image modes PNG stores as they are; others (CMYK, YCbCr, 32-bit) go as RGB, which processors convert them to.
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")


def image_data_url(image: Any) -> str:
    """An image as a PNG data URL: lossless for PIL images and uint8 arrays, so the server's image processor sees the
    pixels the trainer's did (float arrays are rescaled to 8 bits)."""
    from transformers.image_transforms import to_pil_image

    image = to_pil_image(image)
    if image.mode not in PNG_MODES:
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _raise_for_status(response: httpx.Response, path: str) -> None:
    if response.status_code == 200:
        return
    detail = response.text[:2000]
    if response.status_code in (400, 422):
        raise ValueError(f"The vLLM server refused the request to {path}: {detail}")
    raise VLLMServerError(f"The vLLM server failed on {path} (HTTP {response.status_code}): {detail}")


class _PolicyWeights:
    """vLLM's ``WeightSource`` protocol over the policy's weights while a push is under way.

    The metadata the receiver sizes its buffers from is read off the model; the tensors (adapters merged) are made
    one at a time as the transfer sends them, so no second copy of the model is ever held.
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer import ParamMeta

        return [ParamMeta(name, dtype, shape) for name, dtype, shape in engine_weight_metadata(self.model)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_for_engine(self.model)

    def held_names(self) -> None:
        return None


class VLLMServerBackend(RolloutBackend):
    """Generation on a ``vllm serve`` process; the main training process holds the connection.

    ``transfer_backend`` names the weight-transfer engine the server was started with (``--weight-transfer-config``):
    ``"nccl"`` between GPUs, ``"gloo"`` on CPUs. With :meth:`start` the server generates while training goes on;
    a weight push meanwhile pauses the in-flight requests, which go on with the new weights.
    """

    holds_weights = True
    collective = True
    overlaps_training = True
    takes_images = True

    def __init__(
        self,
        accelerator: Any,
        settings: SamplingSettings,
        base_url: str,
        timeout: float,
        transfer_backend: str = "auto",
        packed_buffer_bytes: int | None = None,
        api_key: str | None = None,
        stall_timeout: float | None = None,
        generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]] | None = None,
        restart_grace_period: float = 0.0,
    ):
        self.accelerator = accelerator
        self.settings = settings
        self.fields = settings.vllm_fields()
        make_sampling_params(self.fields, seed=None)  # the server ignores fields it does not know: refuse them here
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.api_key = api_key
        self.transfer_backend = _transfer_backend(transfer_backend)
        self.packed_buffer_bytes = packed_buffer_bytes
        # The policy opened for a push, for pushing it again to a server that came back; None: none comes back.
        self.generation_model = generation_model
        self.restarts = ServerRestarts(self.base_url, restart_grace_period if generation_model is not None else 0.0)
        self._pushed_version: int | None = None  # the main process's last finished push
        self._left_paused = False  # a failed push left the server paused until the push is made again
        self.client: VLLMServerClient | None = None
        self._transfer: Any = None
        self._source = _PolicyWeights()
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: list[Future] = []
        self._requests_made = 0
        self._own_requests: ServerRequests | None = None  # this process's requests sent beside the others
        # True once any process may send requests of its own, which the main process cannot see in flight.
        self._processes_send_requests = False
        with failures_reach_every_process("connecting to the vLLM server", accelerator.device):
            if accelerator.is_main_process:
                self.client = VLLMServerClient(base_url, timeout, api_key, stall_timeout)
                try:
                    self.client.wait_for_server()
                    self.client.check_sampled_logprobs()
                except BaseException:
                    self.client.close()
                    raise
                # Two: an evaluation rollout need not queue behind a training rollout generated ahead.
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="targetpo-rollouts")
        _check_same_key_everywhere(api_key)

    def describe(self) -> str:
        return f"vLLM server at {self.base_url}"

    # ------------------------------------------------------------------------------------------ generation
    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> PendingCompletions:
        expanded = unpadded_prompts(prompt_ids, prompt_mask)
        # An image PNG cannot hold fails here, on every process, before the gathers below.
        with failures_reach_every_process("encoding the images for the vLLM server", prompt_ids.device):
            prompts, image_urls = server_prompts(expanded, images)
        # One seed per row from each process's generator: distinct samples, reproducible from the run's seed.
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        # Processes may send different numbers of rows (multi-turn rollouts), each with its own length limit.
        all_prompts, all_seeds = gather_object(prompts), gather_object(seeds)
        # Every process takes part in these gathers, with or without images (it does not know which others have): each
        # checks the server's expansion of every row, so that a mismatch stops all of them alike.
        all_image_urls = gather_object(image_urls)
        all_expanded = gather_object(expanded)
        counts = gather_object([len(prompts)])
        fields = self.fields if max_new_tokens is None else {**self.fields, "max_tokens": max_new_tokens}
        all_fields = gather_object([fields] * len(prompts))
        request = (all_prompts, all_fields, all_seeds, all_image_urls) if self.accelerator.is_main_process else None
        first_row = sum(counts[: self.accelerator.process_index])
        local = slice(first_row, first_row + len(prompts))
        with_images = [bool(urls) for urls in all_image_urls]
        expected = (all_expanded, with_images) if any(with_images) else None
        return _PendingServerCompletions(self, request, local, prompt_ids.device, expected)

    def send(self, request: tuple[list, list, list, list]) -> Future:
        """Send ``request`` (every process's prompts, sampling fields, seeds and images) from the main process: the
        future of the server's replies, with the cancellation that stops them (``future.cancellation``)."""
        prompts, fields, seeds, image_urls = request
        first = self._requests_made
        self._requests_made += len(prompts)
        request_ids = [f"targetpo-{number}" for number in range(first, first + len(prompts))]
        cancellation = Cancellation()
        try:
            if self._executor is None:
                raise RuntimeError(
                    "This vLLM server backend was closed (`trainer.close()`): give the trainer a new rollout "
                    "backend, or let it build its own, before generating again."
                )
            future = self._executor.submit(
                self.client.generate, prompts, fields, seeds, request_ids, cancellation, image_urls
            )
        except Exception as error:  # e.g. closed: the error must reach every process, through result()
            future = Future()
            future.set_exception(error)
        future.cancellation = cancellation
        self._in_flight = [f for f in self._in_flight if not f.done()] + [future]
        return future

    def for_this_process(self) -> ServerRequests:
        """This process's own connection to the server, for episodes played ahead in a thread (no collectives). Called
        on every process: from then on every weight push pauses the server, since requests of other processes may be
        in flight."""
        if self._own_requests is None:
            rank = self.accelerator.process_index
            self._own_requests = ServerRequests(
                self.base_url, self.timeout, self.settings, f"targetpo-p{rank}", self.api_key, self.stall_timeout
            )
            self._processes_send_requests = True
        return self._own_requests

    # ------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model: nn.Module, version: int) -> None:
        with failures_reach_every_process("pushing the weights to the vLLM server", self.accelerator.device):
            if self.accelerator.is_main_process:
                self._push_through_restarts(model, version)

    def recovers_from(self, error: BaseException) -> bool:
        return self.restarts.survived and isinstance(error, SERVER_LOST)

    def reconnect(self, lost: BaseException, lost_requests: int) -> None:
        """Collective, once ``lost`` told the server went away: wait for it to come back, then push the weights it
        held to it again unless it still holds them (sharded weights are gathered for that on every process). The
        caller sends its ``lost_requests`` again."""
        main, waited = self.accelerator.is_main_process, 0.0
        with failures_reach_every_process("waiting for the vLLM server to come back", self.accelerator.device):
            if main:
                waited = self._wait_for_return(lost)
        held = self._transfer is not None  # on the main process: the same server, with the weights pushed last
        with self.generation_model() as model:
            with failures_reach_every_process("pushing the weights to the vLLM server", self.accelerator.device):
                if main and not held and self._pushed_version is not None:
                    self._push_through_restarts(model, self._pushed_version)
        if main:
            self.restarts.log_return(waited, self._pushed_version, held, lost_requests)

    def _push_through_restarts(self, model: nn.Module, version: int) -> None:
        """Push; to a server that goes away meanwhile, again once it is back within the grace period."""
        waited: float | None = None
        for tries_left in range(TRIES_AFTER_A_LOSS, -1, -1):
            try:
                self._push(model, version)
                break
            except SERVER_LOST as lost:
                if tries_left == 0 or not self.restarts.survived:
                    raise
                waited = (waited or 0.0) + self._wait_for_return(lost)
        if waited is not None:
            self.restarts.log_return(waited, version, False, 0)

    def _wait_for_return(self, lost: BaseException) -> float:
        """Main process: seconds until the server that went away with ``lost`` answers again (checked as at start).
        The weight transfer is dropped unless the server still holds the weights pushed last through it (a stalled
        server that went on): a restarted server's workers are new."""
        waited = self.restarts.wait_for_return(self.client.answers_health, lost)
        self.client.wait_for_server()
        self.client.check_sampled_logprobs()
        if self._transfer is not None and self.client.served_weights() != str(self._pushed_version):
            _quietly(self._transfer.shutdown)
            self._transfer = None
        return waited

    def _push(self, model: nn.Module, version: int) -> None:
        if self._transfer is not None and self._pushed_version is not None:
            served = self.client.served_weights()
            if served != str(self._pushed_version):  # a restart no request saw: the transfer's peers are gone
                raise ServerGone(
                    f"The vLLM server at {self.base_url} holds weights labelled {served!r}, not those of step "
                    f"{self._pushed_version} that the trainer pushed last: it restarted."
                )
        if self._transfer is None:
            self._transfer = self._open_transfer()
        # Paused also with nothing in flight here while processes send requests of their own: a request arriving
        # mid-push would otherwise be sampled from half-replaced weights. New requests wait for the resume.
        generating = (
            self._left_paused or self._processes_send_requests or any(not future.done() for future in self._in_flight)
        )
        if generating:
            self.client.pause()
        try:
            self._source.model = model
            self.client.weight_version = str(version)  # tokens sampled from now on are labelled with it
            try:
                self._transfer.send_weights()
            finally:
                self._source.model = None
            self.client.forget_cached_activations()
            self._pushed_version = version
        except Exception as error:
            self._failed_push(error, generating)
            raise
        if generating:
            self.client.resume()
            self._left_paused = False

    def _failed_push(self, error: Exception, paused: bool) -> None:
        """After a push that failed part-way: its transfer cannot be used again, and the server's weights may be half
        replaced under the old label. Where the push will be made again (a grace period) a paused server stays paused
        until then, so no request is sampled from them; and a failure of the transfer itself on a server that no
        longer answers is the server going away (raised as :class:`ServerGone`)."""
        if self._transfer is not None:
            _quietly(self._transfer.shutdown)
            self._transfer = None
        if not self.restarts.survived:
            if paused:
                _quietly(self.client.resume)
            return
        self._left_paused = self._left_paused or paused
        if not isinstance(error, SERVER_LOST) and not self.client.answers_health():
            raise ServerGone(
                f"The vLLM server at {self.base_url} went away during a weight push ({type(error).__name__}: {error})."
            ) from error

    def _open_transfer(self) -> Any:
        """Join the server's workers in a transfer group (this process is its rank 0)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        address = _address_towards(self.base_url)
        port = _free_port(address)
        world_size = 1 + self.client.world_size()
        if self.transfer_backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            init_info = NCCLTrainerInitInfo(address, port, world_size, rank=0, packed=True)
        else:
            from .gloo_transfer import GlooTrainerInitInfo, register_trainer_engine

            register_trainer_engine()
            extra = {} if self.packed_buffer_bytes is None else {"packed_buffer_size_bytes": self.packed_buffer_bytes}
            init_info = GlooTrainerInitInfo(address, port, world_size, rank=0, **extra)
        try:
            return WeightTransferTrainerFactory.trainer_init(init_info, client=self.client, source=self._source)
        except (VLLMServerError, ValueError) as error:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} could not open a {self.transfer_backend!r} weight transfer: "
                f'{error}. Start it with --weight-transfer-config \'{{"backend": "{self.transfer_backend}"}}\' (as '
                f"{SERVE_HINT} does) and make sure it can reach {address}:{port}."
            ) from error

    def close(self) -> None:
        if self._own_requests is not None:
            self._own_requests.close()
            self._own_requests = None
        if not self.accelerator.is_main_process:
            return
        for future in self._in_flight:
            future.cancellation.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._transfer is not None:
            _quietly(self.client.shutdown_weight_transfer_engine)
            _quietly(self._transfer.shutdown)
            self._transfer = None
        if self.client is not None:
            self.client.close()
            self.client = None


class ServerRequests(RolloutBackend):
    """One process's own requests to the server, from one thread at a time, beside training and the other processes:
    no collectives, so it can play a rollout's episodes ahead (``async_rollouts`` with tools, environments or
    ``rollout_func``). The server's weights are the ones :class:`VLLMServerBackend` pushes; each token is labelled
    with the version that wrote it. :meth:`cancel` stops the call in flight and every later one."""

    takes_images = True

    def __init__(
        self,
        base_url: str,
        timeout: float,
        settings: SamplingSettings,
        request_prefix: str,
        api_key: str | None = None,
        stall_timeout: float | None = None,
    ):
        self.settings = settings
        self.fields = settings.vllm_fields()
        self.client = VLLMServerClient(base_url, timeout, api_key, stall_timeout)
        self.request_prefix = request_prefix  # request ids unique across processes
        self.generator = torch.Generator()
        self._cancellation = Cancellation()
        self._requests_made = 0

    def start_playing(self, seed: int) -> None:
        """Ready for a new rollout's episodes, sampled from ``seed`` (drawn by the training thread, so a run's
        samples follow from its seed)."""
        self.generator.manual_seed(seed)
        self._cancellation = Cancellation()

    def cancel(self) -> None:
        self._cancellation.cancel()

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> Completions:
        if self._cancellation.cancelled:
            raise GenerationCancelled("The episodes played ahead were cancelled.")
        expanded = unpadded_prompts(prompt_ids, prompt_mask)
        prompts, image_urls = server_prompts(expanded, images)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        first, self._requests_made = self._requests_made, self._requests_made + len(prompts)
        request_ids = [f"{self.request_prefix}-{number}" for number in range(first, first + len(prompts))]
        fields = self.fields if max_new_tokens is None else {**self.fields, "max_tokens": max_new_tokens}
        outputs = self.client.generate(prompts, fields, seeds, request_ids, self._cancellation, image_urls)
        _refuse_foreign_weights(outputs, self.client.base_url)
        with_images = [bool(urls) for urls in image_urls]
        if any(with_images):
            check_expanded_prompts(expanded, [output["prompt_token_ids"] for output in outputs], with_images)
        return _server_completions(outputs, self.settings, prompt_ids.device)

    def close(self) -> None:
        self.cancel()
        self.client.close()


class _PendingServerCompletions(PendingCompletions):
    """A rollout the server is generating; :meth:`result` is collective: every process calls it together."""

    def __init__(
        self,
        backend: VLLMServerBackend,
        request: tuple[list, list, list, list] | None,
        local: slice,
        device: torch.device,
        expanded_prompts: tuple[list[list[int]], list[bool]] | None = None,
    ):
        super().__init__()
        self.backend, self.request, self.local, self.device = backend, request, local, device
        self.future = None if request is None else backend.send(request)  # on the main process
        # Every row's prompt as the trainer holds it, and whether it has images: what the server's expansion must give.
        self.expanded_prompts = expanded_prompts

    def result(self) -> Completions:
        started = time.perf_counter()
        reply = self._reply()
        # The same on every process: the reply was broadcast. The requests lost with the server go again once it is
        # back with the weights they were sent for; a server that goes away each time they go stops training.
        for _ in range(TRIES_AFTER_A_LOSS):
            if not self.backend.recovers_from(reply):
                break
            self.backend.reconnect(reply, len(self.request[0]) if self.request is not None else 0)
            if self.request is not None:
                self.future = self.backend.send(self.request)
            reply = self._reply()
        self.wait_seconds = time.perf_counter() - started
        if isinstance(reply, Exception):
            raise reply
        if self.expanded_prompts is not None:  # all rows, on every process: a mismatch anywhere stops every process
            expected, with_images = self.expanded_prompts
            check_expanded_prompts(expected, [output["prompt_token_ids"] for output in reply], with_images)
        return _server_completions(reply[self.local], self.backend.settings, self.device)

    def _reply(self) -> list[Any] | Exception:
        """The server's replies, or the error that came instead, on every process (handed to every process, which
        would otherwise wait for the reply forever)."""
        reply: list[Any] = [None]
        if self.future is not None:
            try:
                outputs = self.future.result()
                _refuse_foreign_weights(outputs, self.backend.base_url)
                reply = [outputs]
            except Exception as error:
                reply = [error]
        return broadcast_object_list(reply)[0]

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancellation.cancel()


def _refuse_foreign_weights(outputs: list[dict[str, Any]], base_url: str) -> None:
    """Raise :class:`ServerGone` for completions sampled by weights the trainer never pushed (a restarted server's)."""
    foreign = foreign_labels(output["weight_versions"] for output in outputs)
    if foreign:
        raise ServerGone(
            f"The vLLM server at {base_url} sampled with weights labelled {', '.join(map(repr, foreign))}, not ones "
            "the trainer pushed: it restarted, and its completions are not trained on."
        )


def _check_same_key_everywhere(api_key: str | None) -> None:
    """Refuse, on every process alike, keys that differ between processes (e.g. ``VLLM_API_KEY`` set on one machine
    only): the main process's check would pass, and another's own requests (asynchronous agent rollouts) fail later."""
    digest = None if api_key is None else hashlib.sha256(api_key.encode("utf-8")).hexdigest()
    digests = gather_object([digest])
    differing = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if differing:
        raise VLLMServerAuthenticationError(
            f"Training processes {differing} hold another vLLM server API key than process 0 (or none where it has "
            f"one, or one where it has none). Give every process the same: set vllm_server_api_key, or "
            f"{KEY_VARIABLE} in the environment of every process on every machine."
        )


def _server_completions(outputs: list[dict[str, Any]], settings: SamplingSettings, device: torch.device) -> Completions:
    """The server's replies as :class:`Completions`: tokens, sampling log-probs, the oldest weights that wrote each."""
    return pad_completions(
        [output["token_ids"] for output in outputs],
        [output["logprobs"] for output in outputs],
        settings.pad_token_id,
        settings.eos_token_ids,
        device,
        weight_versions=[_oldest_version(output["weight_versions"]) for output in outputs],
    )


def _oldest_version(versions: Sequence[str]) -> int:
    """The oldest optimiser step whose weights wrote part of a completion; -1 where the server reports none."""
    steps = [int(version) for version in versions if version is not None and str(version).lstrip("-").isdigit()]
    return min(steps) if steps else -1


def _transfer_backend(name: str) -> str:
    if name != "auto":
        return name
    return "nccl" if torch.cuda.is_available() else "gloo"


def _address_towards(base_url: str) -> str:
    """This machine's address on the route to the server: where the server's workers can reach the trainer, and the
    one interface the weight transfer's rendezvous listens on."""
    from .gloo_transfer import address_towards

    url = urlparse(base_url)
    return address_towards(url.hostname or "127.0.0.1", url.port or 80)


def _free_port(address: str) -> int:
    """A port free on ``address``, the interface the transfer's rendezvous then binds."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _quietly(function: Any, *args: Any) -> None:
    """Best-effort clean-up: the server may already be gone."""
    try:
        function(*args)
    except Exception:  # noqa: BLE001
        pass
