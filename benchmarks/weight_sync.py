"""Seconds per weight sync in server mode: the former HTTP + safetensors push vs vLLM's weight-transfer API (gloo).

One sync is what the trainer does after an optimiser step: export the policy's weights and push the whole model to
the server. The former path (commit 5de566c, `targetpo-vllm-serve` on FastAPI) serialises the weights to safetensors
bytes, POSTs them in 256 MiB chunks to `/update_weights` and reloads them with `/apply_weights`; the current path
(`vllm serve` with targetpo's gloo engine) broadcasts them packed in 256 MiB buffers over a gloo group that the
server's workers joined. Both paths get the same model, float32, on the same machine, one server at a time; each
pushes `--repeats` times after a warm-up push, the weights perturbed before each push, and the median is reported.
After the timed pushes each path's engine must generate greedily with exactly the log-probs of the last pushed
weights in transformers (and not those it was started with), so a push that does nothing cannot be timed.

The former checkout runs from a temporary `git worktree` of 5de566c, removed at the end. Its server and client run
in processes of their own with that worktree first on PYTHONPATH: its modules have the same names as this checkout's.

    python benchmarks/weight_sync.py --output docs/benchmarks/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import (
    MODEL_SIZES,
    REPOSITORY,
    add_quiet_arguments,
    cpu_busy,
    environment,
    old_checkout,
    report,
    run_when_quiet,
)

OLD_COMMIT = "5de566c"
MODELS = {name: MODEL_SIZES[name] for name in ("medium", "large")}
#: Seconds a server on a small CPU may take to come up (load, warm-up, memory profiling).
START_TIMEOUT = 300
GREEDY = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "detokenize": False, "ignore_eos": True}
#: The engine holds the pushed weights when its greedy log-probs are within this of transformers' (float32).
MATCH_TOLERANCE = 1e-4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="Timed pushes per path and round (after a warm-up).")
    parser.add_argument("--rounds", type=int, default=2, help="Each round starts each path's server once, in turn.")
    add_quiet_arguments(parser)
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    # Internal: one path's client, run in a process of its own by the parent.
    parser.add_argument("--client", choices=("old", "new"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--served", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------------- client side
def perturb(model, generator) -> None:
    """New weights for each push, so every push carries something the engine does not hold yet."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=1e-3)


def greedy_reference(model, prompts):
    """Greedy completions of ``model`` in transformers and the log-probs of their tokens."""
    import torch

    results = []
    for prompt in prompts:
        prompt_tensor = torch.tensor([prompt])
        with torch.no_grad():
            ids = model.generate(
                prompt_tensor, attention_mask=torch.ones_like(prompt_tensor), do_sample=False,
                max_new_tokens=GREEDY["max_tokens"], eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):]
            full = torch.cat([prompt_tensor[0], ids]).unsqueeze(0)
            logps = torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        results.append((ids.tolist(), logps.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()))
    return results


def compare(engine, reference) -> dict:
    """How far the engine's greedy completions are from a model's: equal tokens and the largest log-prob gap."""
    same_tokens = all(e_ids == r_ids for (e_ids, _), (r_ids, _) in zip(engine, reference))
    gap = max(abs(a - b) for (_, e_logps), (_, r_logps) in zip(engine, reference) for a, b in zip(e_logps, r_logps))
    return {"same_tokens": same_tokens, "max_logp_abs_diff": gap}


def run_client(args: argparse.Namespace) -> None:
    """Push the policy's weights 1 + repeats times the way this path's trainer does; time each; check the engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import targetpo
    from targetpo.generation.vllm_backend import export_for_engine  # in both checkouts

    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    prompts = [tokenizer(text)["input_ids"] for text in ("0110=", "111000=", "01=")]
    generator = torch.Generator().manual_seed(0)

    if args.client == "old":
        from targetpo.generation.vllm_client import VLLMServerGenerator

        client = VLLMServerGenerator(args.url, 60, GREEDY)
        client.wait_for_server()

        def push(step):
            client.load_weights(export_for_engine(model))  # what the trainer at 5de566c did after each step

        def engine_greedy():
            ids, logps = client.generate(prompts, [0] * len(prompts))
            return list(zip(ids, logps))

        close = client.close
    else:
        from accelerate import Accelerator

        from targetpo.generation import SamplingSettings
        from targetpo.generation.vllm_server import VLLMServerBackend

        settings = SamplingSettings(
            max_new_tokens=6, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
        )
        backend = VLLMServerBackend(Accelerator(cpu=True), settings, args.url, 60, transfer_backend="gloo")

        def push(step):
            backend.sync_weights(model, step)  # what the trainer calls after each step: export, then send

        def engine_greedy():
            ids = [f"check-{time.monotonic_ns()}-{index}" for index in range(len(prompts))]
            outputs = backend.client.generate(prompts, GREEDY, [0] * len(prompts), ids)
            return [(output["token_ids"], output["logprobs"]) for output in outputs]

        close = backend.close

    try:
        seconds = []
        for step in range(args.repeats + 1):
            perturb(model, generator)
            started = time.perf_counter()
            push(step)
            seconds.append(time.perf_counter() - started)
        engine = engine_greedy()
    finally:
        close()
    pushed_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in export_for_engine(model))
    served = AutoModelForCausalLM.from_pretrained(args.served, dtype=torch.float32).eval()
    result = {
        "targetpo": str(Path(targetpo.__file__).parent),  # which checkout this path ran
        "warmup_seconds": seconds[0],
        "seconds": seconds[1:],
        "bytes": pushed_bytes,
        "pushed_weights": compare(engine, greedy_reference(model, prompts)),
        "initial_weights": compare(engine, greedy_reference(served, prompts)),
    }
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- parent side
def base_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def run_path(path: str, worktree: Path, policy: Path, served: Path, work: Path, repeats: int, label: str) -> dict:
    """Start this path's server on the served model, run its client against it, stop the server."""
    from vllm_serve import free_port, running_server, served_vllm, with_python_path
    log = work / f"{label}.log"
    if path == "old":
        port = free_port()
        command = [
            sys.executable, "-m", "targetpo.generation.vllm_server", "--model", str(served),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max_model_len", "128",
        ]
        # The former checkout first on the path, for the server and its client alike. The installed (current)
        # targetpo declares a vLLM plugin module that the former checkout does not have: load no plugins there.
        env = with_python_path(worktree, {**base_env(), "VLLM_PLUGINS": ""})
        cwd = worktree
        serving = running_server(command, env, log, port, cwd=worktree)
    else:
        env = with_python_path(REPOSITORY, base_env())
        cwd = REPOSITORY
        serving = served_vllm(served, log)  # as the tests start it
    result_path = work / f"{label}.json"
    started = time.perf_counter()
    with serving as url:
        start_seconds = time.perf_counter() - started
        idle_server_busy = cpu_busy(3.0)  # the server up and idle: anything more is other work
        client = [
            sys.executable, str(Path(__file__).resolve()), "--client", path, "--url", url, "--policy", str(policy),
            "--served", str(served), "--repeats", str(repeats), "--result", str(result_path),
        ]
        subprocess.run(client, env=env, cwd=cwd, check=True)
    result = json.loads(result_path.read_text())
    result["server_start_seconds"] = start_seconds
    result["busy_with_idle_server"] = idle_server_busy
    expected_root = (worktree if path == "old" else REPOSITORY) / "targetpo"
    if Path(result["targetpo"]) != expected_root:
        raise RuntimeError(f"The {path} path ran targetpo from {result['targetpo']}, not {expected_root}.")
    pushed, initial = result["pushed_weights"], result["initial_weights"]
    if not (pushed["same_tokens"] and pushed["max_logp_abs_diff"] < MATCH_TOLERANCE):
        raise RuntimeError(f"The {path} path's engine does not hold the pushed weights: {pushed}")
    if initial["same_tokens"] and initial["max_logp_abs_diff"] < MATCH_TOLERANCE:
        raise RuntimeError(f"The check cannot tell the pushed weights from the initial ones: {initial}")
    return result


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers and worktree are cleaned up on a kill too
    if args.client != "old":
        sys.path.insert(0, str(REPOSITORY))  # this checkout's targetpo, whatever else is installed
    if args.client:
        run_client(args)
        return
    sys.path.insert(1, str(REPOSITORY / "tests"))  # the tests' server launcher

    from targetpo.demo import build_tiny_causal_lm, reverse_task_tokenizer

    tokenizer = reverse_task_tokenizer()
    results = []
    work = Path(tempfile.mkdtemp(prefix="targetpo-weight-sync-"))
    try:
        with old_checkout(work / "old", OLD_COMMIT) as worktree:
            for name in args.models:
                hidden, layers, heads = MODELS[name]
                policy, served = work / f"{name}-policy", work / f"{name}-served"
                # The server starts from other weights than the policy's: only a push can make them match.
                for directory, seed in ((policy, 0), (served, 1)):
                    model = build_tiny_causal_lm(tokenizer, hidden, layers, heads, seed=seed)
                    model.save_pretrained(directory)
                    tokenizer.save_pretrained(directory)
                parameters = sum(parameter.numel() for parameter in model.parameters())
                del model
                runs = {"old": [], "new": []}
                disturbed = []
                for round_index in range(args.rounds):
                    for path in ("old", "new"):
                        label = f"{name}-{path}-{round_index}"

                        def one_run(attempt: int, path=path, label=label) -> dict:
                            run = run_path(
                                path, worktree, policy, served, work, args.repeats, f"{label}-{attempt}"  # noqa: B023
                            )  # policy and served: this iteration's, as the run is made now
                            return {"path": path, **run}

                        run = run_when_quiet(one_run, args, disturbed, busy_while="busy_with_idle_server")
                        run.update(round=round_index)
                        runs[path].append(run)
                        print(json.dumps({"model": name, "path": path, "round": round_index,
                                          "seconds": [round(s, 3) for s in run["seconds"]]}), flush=True)
                old = statistics.median(s for run in runs["old"] for s in run["seconds"])
                new = statistics.median(s for run in runs["new"] for s in run["seconds"])
                megabytes = runs["new"][0]["bytes"] / 2**20
                result = {
                    "model": name,
                    "hidden_layers_heads": [hidden, layers, heads],
                    "parameters": parameters,
                    "megabytes": round(megabytes, 1),
                    "pushes_per_path": args.rounds * args.repeats,
                    "old_http_safetensors_seconds": round(old, 3),
                    "new_gloo_seconds": round(new, 3),
                    "old_over_new": round(old / new, 2),
                    "old_megabytes_per_s": round(megabytes / old),
                    "new_megabytes_per_s": round(megabytes / new),
                    "runs": runs,
                    "disturbed_runs_redone": disturbed,
                }
                results.append(result)
                print(json.dumps({key: value for key, value in result.items() if key != "runs"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(environment(old_commit=OLD_COMMIT), results, args.output)


if __name__ == "__main__":
    main()
