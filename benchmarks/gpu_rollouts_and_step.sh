#!/usr/bin/env bash
# Rollouts without vLLM on one GPU, in one go (about 10 minutes on an H100), bf16, a Qwen2-shaped model of
# Qwen2.5-0.5B's width and vocabulary with random weights (nothing downloaded):
#   1. rollout tokens/s: continuous batching vs padded model.generate vs TRL's continuous-batching call,
#      32 prompts x K = 8, completions of 16 to 1,024 tokens (rollout_backends.py);
#   2. the whole optimiser step (generation + scoring + training), targetpo vs TRL, both on continuous batching, on a
#      sparse reward (most groups without signal) and on a dense one, each step split into generation, reward and
#      the rest (step_time.py).
# Results go to $OUT (the device machine's output folder) or, without it, docs/benchmarks/. Each command has its own
# time limit, so one that stalls leaves the others their time. TRL, datasets and a transformers with the engine's
# current interface travel as wheels in .whl (see docs/benchmarks.md, "On a GPU: not measured yet").
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-../docs/benchmarks}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/..${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

timeout 200 python3 rollout_backends.py --device cuda --dtype bfloat16 --model qwen2 --prompts 32 --prompt_tokens 64 \
    --max_new_tokens 1024 --repeats 1 --output "$out/rollout_backends_gpu.json"

for reward in sparse dense; do
  timeout 200 python3 step_time.py --device cuda --dtype bfloat16 --model qwen2 --trainers targetpo trl \
      --rollouts continuous_batching --reward "$reward" --eos_probability 0.0025 --num_generations 8 \
      --batch_size 32 --steps_per_generation 8 --gradient_accumulation_steps 8 --completion_length 1024 \
      --num_iterations 1 --steps 3 --warmup 1 --rounds 1 --output "$out/step_time_cb_$reward.json"
done
