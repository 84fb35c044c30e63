"""``targetpo-vllm-serve``: a vLLM engine behind HTTP, for ``use_vllm=True, vllm_mode="server"``.

Start it on the devices reserved for generation, then train on the others::

    CUDA_VISIBLE_DEVICES=7 targetpo-vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 accelerate launch --num_processes 7 train.py --use_vllm --vllm_mode server

Endpoints: ``GET /health``; ``POST /generate`` (JSON: token-id prompts, one seed each, sampling settings) returning
completion token ids and their sampling log-probs; ``POST /update_weights`` (stage a safetensors-serialised chunk of
the policy's weights, Hugging Face names) and ``POST /apply_weights`` (load every staged chunk at once).
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at run time.
import argparse
import threading
from typing import Any

from .vllm_backend import VLLMEngine, import_vllm


def build_app(engine: VLLMEngine) -> Any:
    """The FastAPI application serving ``engine``; one request uses the engine at a time."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.concurrency import run_in_threadpool
    from pydantic import BaseModel

    app = FastAPI(title="targetpo vLLM server")
    engine_lock = threading.Lock()

    class GenerateRequest(BaseModel):
        prompts: list[list[int]]
        seeds: list[int]
        settings: dict[str, Any]

    def locked(function, *args):
        with engine_lock:
            return function(*args)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/generate")
    async def generate(request: GenerateRequest) -> dict[str, Any]:
        if len(request.seeds) != len(request.prompts):
            raise HTTPException(400, f"{len(request.prompts)} prompts but {len(request.seeds)} seeds: one seed each.")
        try:
            completion_ids, logprobs = await run_in_threadpool(
                locked, engine.generate, request.prompts, request.settings, request.seeds
            )
        except ValueError as error:  # sampling settings vLLM refuses
            raise HTTPException(400, str(error)) from error
        return {"completion_ids": completion_ids, "logprobs": logprobs}

    staged: list[bytes] = []  # chunks of the next weight update, loaded together by /apply_weights

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, int]:
        staged.append(await request.body())
        return {"staged_chunks": len(staged)}

    @app.post("/apply_weights")
    async def apply_weights() -> dict[str, int]:
        chunks = list(staged)
        staged.clear()
        try:
            loaded = await run_in_threadpool(locked, engine.load_safetensors_bytes, chunks)
        except Exception as error:  # a malformed chunk, or names the model does not have
            raise HTTPException(400, f"Could not load the weights: {type(error).__name__}: {error}") from error
        return {"loaded": loaded}

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="targetpo-vllm-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Model id or local path; the trainer pushes its weights.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", help="Weights' dtype in the engine, e.g. bfloat16 or float32.")
    parser.add_argument("--max_model_len", type=int, default=None, help="Context length (prompt + completion).")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    parser.add_argument("--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv_cache_memory_bytes", type=int, default=None, help="KV-cache size in bytes (overrides the utilisation)."
    )
    parser.add_argument("--log_level", default="warning", help="uvicorn's log level.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import_vllm()
    import uvicorn

    engine_kwargs = {}
    if args.kv_cache_memory_bytes is not None:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    engine = VLLMEngine(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
        **engine_kwargs,
    )
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
