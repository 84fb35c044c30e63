"""A real `vllm serve` process on loopback for the server-mode tests, started with `targetpo-vllm-serve`'s command.

The benchmarks start their servers with the same helpers.
"""

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from targetpo.generation.serve import serve_command

#: Seconds a server on this CPU may take to come up (it loads, warms the model up and profiles memory: ~1 minute).
START_TIMEOUT = 300
#: This checkout, which the servers import targetpo (its gloo engine) from, whatever else is installed.
REPOSITORY = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
#: The process group of each running server, by base URL: a test may stop or kill a server it started.
PROCESS_GROUPS = {}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_python_path(first, env=None):
    """``env`` (default: this process's) with ``first`` at the front of PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(first), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def served_vllm(model_dir, log_path, extra_args=(), api_key=None, port=None):
    """Serve ``model_dir`` (weights and tokenizer) with vLLM for the duration of the block; yield its base URL. With
    ``api_key`` every path but the health checks requires it, as ``targetpo-vllm-serve --api-key`` sets up. ``port``:
    a free one unless given (a server restarted where the one before it was)."""
    port = free_port() if port is None else port
    command, env = serve_command(
        str(model_dir), "gloo",
        ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
         "--enforce-eager", *extra_args],
        api_key,
    )
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_API_KEY"}  # only api_key's
    env = with_python_path(REPOSITORY, {**environment, **env, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    # Test-side plugins named in extra_args (paced_vllm_steps) come from here, after everything else.
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS)])
    with running_server(command, env, log_path, port) as base_url:
        yield base_url


@contextlib.contextmanager
def running_server(command, env, log_path, port, cwd=None):
    """Run ``command`` (a server on loopback ``port``) until the block ends; yield its base URL once it is healthy.

    The server gets its own process group, so its engine's helper processes go down with it.
    """
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        base_url = f"http://127.0.0.1:{port}"
        PROCESS_GROUPS[base_url] = server.pid  # its own session: the group's id is the server's pid
        try:
            _wait_until_healthy(base_url, server, log_path)
            yield base_url
        finally:
            PROCESS_GROUPS.pop(base_url, None)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGCONT)  # a stopped server would not act on the SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _wait_until_healthy(base_url, server, log_path):
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"The server exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"The server did not come up within {START_TIMEOUT} s:\n{log_path.read_text()[-4000:]}")
