"""Seconds per optimiser step: targetpo's TargetPOTrainer vs TRL's GRPOTrainer at equal settings, alternated in one run.

Three trainers train the same tiny model (same config and initial weights) with the same tokenizer, prompts, reward,
batch, K, completion length, sampling, learning rate and seed, with `model.generate` rollouts on the CPU: targetpo
as configured by default, targetpo with `skip_zero_gradient_completions=False` (what skipping saves), and TRL. The
runs alternate (targetpo, targetpo without skipping, TRL, ...) so drifts in machine speed hit all three; each
optimiser step is timed by a callback from the end of the step before to its own end (reading its batches, rollout,
rewards, forward and backward, optimiser, logging), the first steps of every run are dropped as warm-up, and the
median and the mean over the rest are reported with their ratios to TRL. With ``num_iterations > 1`` the median is a
step without a rollout; the mean counts every step of the rollout cycle. TRL is a benchmark-only dependency:
`pip install -e ".[bench]"`.

    python benchmarks/step_time.py --rounds 5 --output docs/benchmarks/step_time.json

``--before COMMIT`` adds ``targetpo_before``: targetpo as it was at that commit (a temporary git worktree), to show a
change costs no speed. Every trainer then runs in a process of its own (the two versions cannot share one), in the
same alternation:

    python benchmarks/step_time.py --before 647a08c --trainers targetpo_before targetpo trl --rounds 4

On a GPU, ``--device cuda --dtype bfloat16 --model qwen2`` trains a Qwen2-shaped model with random weights (by
default 0.32B parameters: hidden 896, 12 layers, a 151,936-token vocabulary) on random prompts with a dense reward
(the fraction of completion tokens with an even id), so every completion has a gradient and the skipping variant is
left out (``--trainers targetpo trl``). Both trainers get ``bf16=True`` and the same bfloat16 weights; each step is
timed after ``torch.cuda.synchronize()``, and the peak GPU memory of each trainer's runs is reported too:

    python benchmarks/step_time.py --device cuda --dtype bfloat16 --model qwen2 --trainers targetpo trl \
        --num_iterations 1 4 --steps 12 --warmup 4 --rounds 2 --output docs/benchmarks/step_time_h100.json

Groups larger than a micro-batch: K = 16 completions of 4,096 tokens in micro-batches of 2, spread over the 8
micro-steps of one optimiser step (``--batch_size 16 --steps_per_generation 1`` holds the whole group at once):

    python benchmarks/step_time.py --device cuda --dtype bfloat16 --model qwen2 --trainers targetpo trl \
        --num_generations 16 --batch_size 2 --steps_per_generation 8 --gradient_accumulation_steps 8 \
        --completion_length 4096 --num_iterations 1 --steps 4 --warmup 1 --rounds 1

The whole step on each trainer's best path without vLLM (``--rollouts continuous_batching``: transformers'
continuous batching in both), on a task where most groups carry no signal (``--reward sparse``) and on a dense one:

    python benchmarks/step_time.py --device cuda --dtype bfloat16 --model qwen2 --trainers targetpo trl \
        --rollouts continuous_batching --reward sparse --eos_probability 0.0025 --num_generations 8 \
        --batch_size 32 --steps_per_generation 8 --gradient_accumulation_steps 8 --completion_length 1024 \
        --num_iterations 1 --steps 6 --warmup 2 --rounds 2
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# This checkout's targetpo when no other is on the path (a --before child puts the older one first).
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from targetpo import TargetPOConfig, TargetPOTrainer  # noqa: E402
from targetpo.demo import (  # noqa: E402
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    exact_reversal_reward,
    reverse_task_dataset,
    reverse_task_tokenizer,
)

TRAINERS = ("targetpo", "targetpo_no_skipping", "trl")
#: Variants run only when named in ``--trainers``: targetpo with each group's prompt read once (share_prompt_forward),
#: and the output head's two kernels named (the default, "auto", is Triton's on an NVIDIA GPU and torch's elsewhere).
OPTIONAL_TRAINERS = ("targetpo_shared_prompts", "targetpo_triton", "targetpo_torch_head")
#: The trainer of ``--before``: targetpo at an older commit, run in its own process.
BEFORE = "targetpo_before"
#: Settings of the Qwen2-shaped model (``--model qwen2``); left out of the saved settings for the demo model.
QWEN2_SETTINGS = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "prompt_length",
    "completion_length",
)


def now(synchronize: bool) -> float:
    """``time.perf_counter()``, after the queued GPU kernels have finished when ``synchronize``."""
    if synchronize:
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimer(TrainerCallback):
    """Wall-clock seconds of every optimiser step, from the end of the step before (or the start of training) to its
    own end: everything the run spends on the step, reading its batches from the dataloader and logging included (on
    a GPU, after the queued kernels have finished)."""

    def __init__(self, synchronize: bool = False):
        self.seconds: list[float] = []
        self._last = 0.0
        self._synchronize = synchronize

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = now(self._synchronize)

    def on_step_end(self, args, state, control, **kwargs):
        ended = now(self._synchronize)
        self.seconds.append(ended - self._last)
        self._last = ended


class PhaseClock(TrainerCallback):
    """Where each optimiser step's time goes: the seconds it spends in generation and in the reward function (timed
    around those calls, after a CUDA synchronize on a GPU); the rest of the step is the log-prob passes, the loss,
    backward and the optimiser. :meth:`timed` wraps the calls to time."""

    PHASES = ("generation", "reward")

    def __init__(self, synchronize: bool = False):
        self.steps: list[dict[str, float]] = []
        self._synchronize = synchronize
        self._current = dict.fromkeys(self.PHASES, 0.0)

    def timed(self, phase: str, function):
        @functools.wraps(function)
        def timed_call(*args, **kwargs):
            start = now(self._synchronize)
            try:
                return function(*args, **kwargs)
            finally:
                self._current[phase] += now(self._synchronize) - start

        return timed_call

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self._current)
        self._current = dict.fromkeys(self.PHASES, 0.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_iterations", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=40, help="Optimiser steps per run.")
    parser.add_argument("--warmup", type=int, default=5, help="Steps dropped at the start of every run.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternations of the two trainers.")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--steps_per_generation", type=int, default=1,
                        help="Micro-steps per rollout; with --gradient_accumulation_steps as large, a group may be "
                        "spread over the micro-steps of one optimiser step (micro-batches smaller than a group).")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--reverse_length", type=int, default=6)
    parser.add_argument("--trainers", nargs="+", choices=(*TRAINERS, *OPTIONAL_TRAINERS, BEFORE),
                        default=list(TRAINERS))
    parser.add_argument("--before", default=None, metavar="COMMIT",
                        help=f"Run every trainer in a process of its own, {BEFORE} with targetpo at COMMIT.")
    parser.add_argument("--one_run", default=None, help=argparse.SUPPRESS)  # a child process's single run
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="The model's weights; bfloat16 also sets bf16=True for every trainer.")
    parser.add_argument("--model", choices=("demo", "qwen2"), default="demo",
                        help="demo: the embedded demo model on the reversal task; qwen2: a Qwen2-shaped model with "
                        "random weights, a word-level tokenizer of --vocab_size tokens, random prompts, dense reward.")
    add_qwen2_shape_arguments(parser)
    parser.add_argument("--eos_probability", type=float, default=None,
                        help="qwen2 model: set its weights so that EOS comes with about this probability at every "
                        "step (1/400: lengths spread from a few tokens to past 1,024); unset, completions run to the "
                        "length limit.")
    parser.add_argument("--prompt_length", type=int, default=64, help="Prompt tokens (qwen2 model).")
    parser.add_argument("--completion_length", type=int, default=256, help="max_completion_length (qwen2 model).")
    parser.add_argument("--rollouts", choices=("generate", "continuous_batching"), default="generate",
                        help="Every trainer's non-vLLM generation path: padded model.generate, or transformers' "
                        "continuous batching (use_transformers_continuous_batching, in both trainers).")
    parser.add_argument("--reward", choices=("dense", "sparse"), default="dense",
                        help="qwen2 model: the fraction of even token ids (every group has signal), or 1 for about "
                        "one completion in 64 (a hash of its tokens) and 0 otherwise (most groups have none).")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


# ------------------------------------------------------------------------------------ the Qwen2-shaped GPU setting
def add_qwen2_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The Qwen2-shaped model's sizes (by default Qwen2.5-0.5B's width and vocabulary at half its depth)."""
    parser.add_argument("--hidden_size", type=int, default=896)
    parser.add_argument("--num_layers", type=int, default=12)
    parser.add_argument("--num_heads", type=int, default=14)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=4864)
    parser.add_argument("--vocab_size", type=int, default=151936)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` tokens ``t0 t1 ...`` (t0 unknown, t1 EOS, t2 padding): no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t1", pad_token="t2")


def random_prompts_dataset(vocab_size: int, prompt_length: int, num_prompts: int, seed: int = 0):
    """Prompts of ``prompt_length`` random non-special tokens."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [" ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(prompt_length)) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": prompts})


def even_token_fraction(completions: list[str], **kwargs) -> list[float]:
    """A dense reward: the fraction of a completion's tokens whose id is even."""
    scores = []
    for completion in completions:
        ids = [int(token[1:]) for token in completion.split() if token[1:].isdigit()]
        scores.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
    return scores


def rare_success(completions: list[str], **kwargs) -> list[float]:
    """A sparse reward: 1 for a completion whose tokens hash to 0 modulo 64 (about one in 64), else 0. With K = 8
    about one group in eight has a completion that differs from the others."""
    return [float(zlib.crc32(completion.encode()) % 64 == 0) for completion in completions]


def build_qwen2(args: argparse.Namespace, tokenizer):
    """The Qwen2-shaped model with random weights (seed 0), in ``args.dtype`` on ``args.device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.prompt_length + args.completion_length, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        attn_implementation=getattr(args, "attn_implementation", None),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if getattr(args, "eos_probability", None) is not None:
        ending_at_random(model, tokenizer.eos_token_id, args.eos_probability, args.prompt_length)
    return model.to(args.device, getattr(torch, args.dtype))


@torch.no_grad()
def ending_at_random(model, eos_id: int, probability: float, prompt_length: int) -> None:
    """Make a random-weight model end its completions with about ``probability`` at every step, so that completion
    lengths spread as a trained model's do (geometrically). Every token's embedding gets the same value in one
    dimension, which the final norm turns into a large, steady component of every hidden state; through the tied
    head that adds the same logit to every token, except EOS, whose entry is set so that its probability under
    sampling without top-k or top-p is about ``probability``. The rest of the model stays random."""
    embeddings = model.get_input_embeddings().weight
    embeddings[:, 0] = 1.0
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, embeddings.size(0), (16, prompt_length), generator=generator, device=embeddings.device)
    hidden = model.model(prompts.to(embeddings.device)).last_hidden_state[:, -1].float()
    logits = hidden @ model.get_output_embeddings().weight.float().T
    steady = hidden[:, 0].mean()
    # log p(EOS) = logit(EOS) - logsumexp(logits): moving EOS's entry by delta moves its logit by delta * steady.
    delta = (math.log(probability) + torch.logsumexp(logits, -1).mean() - logits[:, eos_id].mean()) / steady
    embeddings[eos_id, 0] += delta.item()


class Task:
    """What every trainer of one benchmark run shares: tokenizer, dataset, reward, generation settings, model."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        if args.model == "demo":
            self.tokenizer = reverse_task_tokenizer()
            self.dataset = reverse_task_dataset(args.reverse_length, num_prompts=4096, seed=0)
            self.reward = exact_reversal_reward
            self.completion_length = args.reverse_length
            self.generation_kwargs = binary_only_generation_kwargs(self.tokenizer)
            self._model = None
        else:
            self.tokenizer = word_tokenizer(args.vocab_size)
            self.dataset = random_prompts_dataset(args.vocab_size, args.prompt_length, num_prompts=1024, seed=0)
            self.reward = even_token_fraction if args.reward == "dense" else rare_success
            self.completion_length = args.completion_length
            self.generation_kwargs = None
            self._model = build_qwen2(args, self.tokenizer)

    def model(self):
        """A fresh model with the same initial weights for every run."""
        if self._model is None:
            return build_tiny_causal_lm(self.tokenizer, seed=0).to(getattr(torch, self.args.dtype))
        return copy.deepcopy(self._model)


def shared_settings(args: argparse.Namespace, task: Task, num_iterations: int, output_dir: str) -> dict:
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=task.completion_length,
        num_iterations=num_iterations,
        # Each rollout feeds num_iterations optimiser steps, so old log-probs are needed (and computed) by both.
        steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    if task.generation_kwargs is not None:
        settings["generation_kwargs"] = task.generation_kwargs
    if args.rollouts == "continuous_batching":  # the same field in both trainers' configs
        settings["use_transformers_continuous_batching"] = True
    if args.device == "cpu":
        settings["use_cpu"] = True
    return settings


def timed_run(trainer_class, config_class, args, task, num_iterations, **config_overrides):
    """Train one trainer for ``args.steps`` steps; the seconds of every step after the warm-up, its logs, and its peak
    GPU memory in GiB above what was allocated before it (None on the CPU)."""
    on_gpu = args.device == "cuda"
    baseline = 0
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()  # the shared initial weights, kept for the next runs
    timer, clock = StepTimer(synchronize=on_gpu), PhaseClock(synchronize=on_gpu)
    settings = shared_settings(args, task, num_iterations, f"/tmp/step_time_{trainer_class.__name__}")
    model = task.model()
    ours = issubclass(trainer_class, TargetPOTrainer)
    if not ours:  # TRL generates through the model's own methods (generate_batch with continuous batching)
        for method in ("generate", "generate_batch"):
            setattr(model, method, clock.timed("generation", getattr(model, method)))
    trainer = trainer_class(
        model=model,
        reward_funcs=clock.timed("reward", task.reward),
        args=config_class(**settings, **config_overrides),
        train_dataset=task.dataset,
        processing_class=task.tokenizer,
        callbacks=[timer, clock],
    )
    if ours:  # every rollout goes through the backend, whichever it is
        trainer.rollout_backend.generate = clock.timed("generation", trainer.rollout_backend.generate)
    trainer.train()
    logs = trainer.state.log_history
    peak_gb = (torch.cuda.max_memory_allocated() - baseline) / 2**30 if on_gpu else None
    del trainer
    gc.collect()
    phases = [{**step, "total": total} for step, total in zip(clock.steps, timer.seconds)][args.warmup :]
    return timer.seconds[args.warmup :], logs, peak_gb, phases


def main() -> None:
    from trl import GRPOConfig, GRPOTrainer

    args = parse_args()
    task = Task(args)
    bf16 = args.dtype == "bfloat16"
    runs = {
        "targetpo": (TargetPOTrainer, TargetPOConfig, {}),
        # The same trainer putting every completion through the model, as TRL does: what skipping saves.
        "targetpo_no_skipping": (TargetPOTrainer, TargetPOConfig, {"skip_zero_gradient_completions": False}),
        "targetpo_shared_prompts": (TargetPOTrainer, TargetPOConfig, {"share_prompt_forward": True}),
        "targetpo_triton": (TargetPOTrainer, TargetPOConfig, {"logps_head_kernel": "triton"}),
        "targetpo_torch_head": (TargetPOTrainer, TargetPOConfig, {"logps_head_kernel": "torch"}),
        # TRL's config turns on bf16 and gradient checkpointing by default; targetpo's (TrainingArguments') does not.
        "trl": (GRPOTrainer, GRPOConfig, {"bf16": False, "gradient_checkpointing": False}),
    }
    if args.one_run:  # a child of a --before comparison: one run, its results on the last line
        trainer_class, config_class, overrides = runs["targetpo" if args.one_run == BEFORE else args.one_run]
        overrides = {**overrides, "bf16": True} if bf16 else overrides
        timed, logs, peak_gb, phases = timed_run(
            trainer_class, config_class, args, task, args.num_iterations[0], **overrides
        )
        import targetpo

        print(json.dumps({"seconds": timed, "logs": logs, "peak_gb": peak_gb, "phases": phases,
                          "targetpo": targetpo.__file__}))
        return
    old_checkout_path = None
    if args.before:
        from machine import old_checkout

        work = Path(tempfile.mkdtemp(prefix="targetpo-step-time-"))
        with old_checkout(work / "before", args.before) as old_checkout_path:
            compare(args, task, runs, old_checkout_path)
        return
    compare(args, task, runs, old_checkout_path)


def run_in_child(name: str, num_iterations: int, before: Path) -> tuple[list[float], list[dict], float | None, list]:
    """One run of ``name`` in a fresh process: targetpo from ``before`` for ``targetpo_before``, else this checkout."""
    here = Path(__file__).resolve().parent
    repository = before if name == BEFORE else here.parent
    command = [sys.executable, str(here / "step_time.py"), *strip_options(sys.argv[1:], ("--before", "--output", "--rounds",
               "--num_iterations", "--trainers")), "--rounds", "1", "--num_iterations", str(num_iterations),
               "--one_run", name]
    environment_ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repository), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=environment_, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {name} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["targetpo"]).resolve().is_relative_to(repository.resolve()):
        raise RuntimeError(f"the {name} run imported targetpo from {result['targetpo']}, not from {repository}")
    return result["seconds"], result["logs"], result["peak_gb"], result.get("phases", [])


def strip_options(arguments: list[str], options: tuple[str, ...]) -> list[str]:
    """``arguments`` without ``options`` and the values that follow each."""
    kept, skipping = [], False
    for argument in arguments:
        if argument.startswith("--"):
            skipping = argument in options
        if not skipping:
            kept.append(argument)
    return kept


def compare(args: argparse.Namespace, task: Task, runs: dict, old_checkout_path: Path | None) -> None:
    """Alternate the trainers for ``args.rounds`` rounds at each ``num_iterations``; print and save the medians."""
    bf16 = args.dtype == "bfloat16"
    results = []
    for num_iterations in args.num_iterations:
        seconds = {name: [] for name in args.trainers}
        peaks = {name: [] for name in args.trainers}
        phases = {name: [] for name in args.trainers}
        skipped_fractions = []
        for _ in range(args.rounds):
            for name in args.trainers:
                if args.before:
                    timed, logs, peak_gb, steps = run_in_child(name, num_iterations, old_checkout_path)
                else:
                    trainer_class, config_class, overrides = runs[name]
                    overrides = {**overrides, "bf16": True} if bf16 else overrides
                    timed, logs, peak_gb, steps = timed_run(
                        trainer_class, config_class, args, task, num_iterations, **overrides
                    )
                seconds[name] += timed
                phases[name] += steps
                peaks[name].append(peak_gb)
                if name == "targetpo":
                    skipped_fractions += [
                        entry["completions/skipped_fraction"] for entry in logs if "completions/skipped_fraction" in entry
                    ]
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        # With num_iterations > 1 the median is a step without a rollout; the mean counts every step of the cycle.
        means = {name: statistics.fmean(values) for name, values in seconds.items()}
        result = {"num_iterations": num_iterations}
        for name in args.trainers:
            result[f"{name}_median_s"] = round(medians[name], 4)
            result[f"{name}_mean_s"] = round(means[name], 4)
        if "trl" in medians:
            for name in args.trainers:
                if name != "trl":
                    result[f"{name}_over_trl"] = round(medians[name] / medians["trl"], 3)
                    result[f"{name}_mean_over_trl"] = round(means[name] / means["trl"], 3)
        if BEFORE in medians and "targetpo" in medians:  # what the change between the two commits costs or saves
            result["targetpo_over_targetpo_before"] = round(medians["targetpo"] / medians[BEFORE], 3)
            result["targetpo_mean_over_targetpo_before"] = round(means["targetpo"] / means[BEFORE], 3)
        if skipped_fractions:
            result["targetpo_skipped_fraction"] = round(statistics.mean(skipped_fractions), 3)
        result["steps_timed_each"] = len(seconds[args.trainers[0]])
        for name in args.trainers:  # where the time goes: seconds per step, means over the timed steps
            if phases[name]:
                split = {phase: statistics.fmean(step[phase] for step in phases[name]) for phase in PhaseClock.PHASES}
                split["rest"] = statistics.fmean(step["total"] for step in phases[name]) - sum(split.values())
                result[f"{name}_phases_s"] = {phase: round(value, 4) for phase, value in split.items()}
        if args.device == "cuda":
            for name in args.trainers:
                result[f"{name}_peak_gpu_memory_gb"] = round(max(peaks[name]), 2)
                result[f"{name}_p10_p90_s"] = [round(q, 4) for q in statistics.quantiles(seconds[name], n=10)[::8]]
        results.append(result)
        print(json.dumps(result), flush=True)
        save(args, task, results)  # after every setting, so an interrupted run keeps what it measured
    print(json.dumps(environment(args, task)))


def environment(args: argparse.Namespace, task: Task) -> dict:
    import trl

    described = {"torch": torch.__version__, "trl": trl.__version__, "cpu_threads": torch.get_num_threads()}
    if args.device == "cuda":
        import transformers

        described.update(
            transformers=transformers.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
            parameters=sum(p.numel() for p in task.model().parameters()),
        )
    return described


def save(args: argparse.Namespace, task: Task, results: list[dict]) -> None:
    if not args.output:
        return
    # The settings the CPU benchmark has always saved, and those of the GPU setting where they are used.
    defaults = {"trainers": list(TRAINERS), "device": "cpu", "dtype": "float32", "model": "demo", "rollouts": "generate",
                "reward": "dense"}
    settings = {
        key: value for key, value in vars(args).items()
        if not (key in defaults and value == defaults[key]) and not (key in QWEN2_SETTINGS and args.model == "demo")
    }
    with open(args.output, "w") as handle:
        json.dump({"settings": settings, "environment": environment(args, task), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
