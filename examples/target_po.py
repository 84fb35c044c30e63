"""Fine-tune a causal language model with Target Policy Optimization (TPO).

With no arguments it trains the embedded offline default — a tiny model learning to reverse 6-bit binary strings
from a reward of 1 for an exact answer and 0 otherwise — in about two minutes on a laptop CPU:

    python examples/target_po.py

The second embedded task is multi-turn: the model finds a hidden digit by calling a `guess` tool, which answers
higher or lower, and earns 1 only if a guess hits within three calls:

    python examples/target_po.py --task guess

Every TargetPOConfig field is a flag, and a model, dataset and rewards from the Hub or disk can be swapped in:

    accelerate launch examples/target_po.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my-org/prompts --reward_funcs exact_match \\
        --per_device_train_batch_size 8 --num_generations 8 --max_completion_length 128 --output_dir outputs/qwen-tpo

``--reward_funcs`` takes built-in names (below) and reward-model ids or paths, in any mix.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from transformers import AutoTokenizer, HfArgumentParser

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import (
    GuessingGame,
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    exact_reversal_reward,
    guessing_dataset,
    guessing_tokenizer,
    reverse_task_dataset,
    reverse_task_tokenizer,
)
from targetpo.modeling import from_pretrained_or_explain


def exact_match_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 when the completion (its text, stripped) equals the row's `solution` column, else 0.0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if text.strip() == str(answer).strip() else 0.0 for text, answer in zip(texts, solution)]


BUILTIN_REWARDS = {"exact_reversal": exact_reversal_reward, "exact_match": exact_match_reward}

#: Settings for the embedded task, applied unless given on the command line.
EMBEDDED_DEFAULTS = dict(
    output_dir="outputs/target_po-reverse",
    learning_rate=5e-4,
    lr_scheduler_type="constant",
    max_steps=1500,
    per_device_train_batch_size=128,  # 16 prompts x 8 completions
    num_generations=8,
    logging_steps=50,
    save_strategy="no",
    report_to="none",
)
#: The guessing game's settings on top of those: a whole game (three guesses, the answers, the last turn) fits in
#: 20 tokens.
GUESS_DEFAULTS = dict(
    output_dir="outputs/target_po-guess",
    max_steps=1000,
    logging_steps=20,
    max_completion_length=20,
    max_tool_calling_iterations=3,
)
TASKS = ("reverse", "guess")


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model id or path. Default: the embedded tiny model, built offline."}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Dataset id or path for `datasets.load_dataset` (needs --model_name_or_path). Default: the embedded "
            "reversal task."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(default=None, metadata={"help": "Split to evaluate on (optional)."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Built-in reward names ({', '.join(BUILTIN_REWARDS)}) and/or reward-model ids or paths. "
            "Default: exact_reversal for the embedded task."
        },
    )
    task: str = field(
        default="reverse",
        metadata={
            "help": "Embedded task: 'reverse' (reverse a binary string) or 'guess' (find a hidden digit with a tool, "
            "over several turns).",
            "choices": TASKS,
        },
    )
    reverse_length: int = field(default=6, metadata={"help": "Embedded task: length H of the binary strings."})
    num_prompts: int = field(default=4096, metadata={"help": "Embedded task: number of prompts generated."})


def rollout_sampling(args: TargetPOConfig) -> dict:
    """The `GenerationConfig` settings with which the trainer sampled rollouts (generation_kwargs last, as there)."""
    return {
        "do_sample": True,
        "max_new_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        **(args.generation_kwargs or {}),
    }


def parse_arguments(argv: list[str]) -> tuple[ScriptArguments, TargetPOConfig]:
    parser = HfArgumentParser((ScriptArguments, TargetPOConfig))
    # The embedded task's defaults apply only when it is the task: a Hub model keeps the library's RL defaults.
    wants_help = any(arg in ("-h", "--help") for arg in argv)
    peek = None if wants_help else HfArgumentParser(ScriptArguments).parse_args_into_dataclasses(
        argv, return_remaining_strings=True
    )[0]
    if wants_help or peek.dataset_name is None:
        parser.set_defaults(**EMBEDDED_DEFAULTS)
        if not wants_help and peek.task == "guess":
            parser.set_defaults(**GUESS_DEFAULTS)
    script_args, training_args = parser.parse_args_into_dataclasses(argv)
    return script_args, training_args


def load_data(script_args: ScriptArguments):
    if script_args.dataset_name is None and script_args.task == "guess":
        return guessing_dataset(script_args.num_prompts, seed=0), None
    if script_args.dataset_name is None:
        dataset = reverse_task_dataset(script_args.reverse_length, script_args.num_prompts, seed=0)
        return dataset, None
    from datasets import load_dataset

    try:
        dataset = load_dataset(script_args.dataset_name, script_args.dataset_config)
    except Exception as error:  # datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        raise SystemExit(
            f"error: could not load dataset {script_args.dataset_name!r}: it is not a local path and the Hugging Face "
            f"Hub could not provide it ({type(error).__name__}: {error})."
        ) from error
    test = dataset[script_args.dataset_test_split] if script_args.dataset_test_split else None
    return dataset[script_args.dataset_train_split], test


def main(argv: list[str] | None = None) -> TargetPOTrainer:
    script_args, training_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    embedded_task = script_args.dataset_name is None
    guess_task = embedded_task and script_args.task == "guess"
    names = script_args.reward_funcs or (["exact_reversal"] if embedded_task and not guess_task else None)
    if not names and not guess_task:  # the game scores itself (GuessingGame.get_reward)
        raise SystemExit("error: --reward_funcs is required with --dataset_name (built-in names or reward-model ids).")
    if not embedded_task and script_args.model_name_or_path is None:
        raise SystemExit(
            "error: --dataset_name needs --model_name_or_path: the embedded demo model and its 3-character tokenizer "
            "('0', '1', '=') can only read the embedded reversal task, not another dataset's text. Pass a model id or "
            "path, e.g. --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct."
        )
    reward_funcs = [BUILTIN_REWARDS.get(name, name) for name in names or []]
    train_dataset, eval_dataset = load_data(script_args)

    try:
        if script_args.model_name_or_path is None:
            tokenizer = guessing_tokenizer() if guess_task else reverse_task_tokenizer()
            model = build_tiny_causal_lm(tokenizer, seed=training_args.seed)
        else:
            model = script_args.model_name_or_path
            tokenizer = from_pretrained_or_explain(AutoTokenizer, model, "tokenizer")
        if guess_task and training_args.generation_kwargs is None:
            training_args.generation_kwargs = digits_only_generation_kwargs(tokenizer)
        elif embedded_task:
            # The task allows only '0' and '1', so completions are exactly H tokens long; prompts are H bits and '='.
            training_args.max_completion_length = script_args.reverse_length
            training_args.max_prompt_length = script_args.reverse_length + 1
            if training_args.generation_kwargs is None:
                training_args.generation_kwargs = binary_only_generation_kwargs(tokenizer)
        trainer = TargetPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            environment_factory=GuessingGame if guess_task else None,
        )
    except OSError as error:  # a model, tokenizer or reward model that is neither on disk nor reachable
        raise SystemExit(f"error: {error}") from error

    trainer.train()
    if embedded_task and not guess_task:
        # Saved with the model, so that a plain `generate` samples as the rollouts did (the trainer itself ignores a
        # checkpoint's generation_config): only '0' and '1', exactly H of them.
        trainer.accelerator.unwrap_model(trainer.model).generation_config.update(**rollout_sampling(training_args))
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if trainer.is_world_process_zero():
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        if rewards:
            print(f"mean reward: first log {rewards[0]:.3f}, last log {rewards[-1]:.3f}")
        print(f"saved model, tokenizer and trainer_state.json to {training_args.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
