"""Fine-tune a causal language model with Target Policy Optimization (TPO).

With no arguments it trains the embedded offline default — a tiny model learning to reverse 6-bit binary strings
from a reward of 1 for an exact answer and 0 otherwise — in about 1.5 minutes on a 2-core CPU:

    python examples/target_po.py

The second embedded task is multi-turn: the model finds a hidden digit by calling a `guess` tool, which answers
higher or lower, and earns 1 only if a guess hits within three calls:

    python examples/target_po.py --task guess

The third is TPO's home ground, a sparse multi-turn task: the model opens a lock by pressing its keys (the prompt's
bits reversed) one `press` tool call at a time; every press is answered "." and only the whole code earns 1, so a
random policy almost never succeeds (--lock_keys, 4 by default):

    python examples/target_po.py --task lock

The embedded tasks bring their own defaults (learning rate, steps, batch, completion and prompt lengths, the
vocabulary they may write), and these fill only the flags left out: a flag passed is used as given, whatever its value.
Where a value defeats the task (a reverse-task --max_completion_length other than --reverse_length makes the exact
answer impossible) it is used with a warning saying why; a flag that would be ignored (--reverse_length with --task
guess, --dataset_config without --dataset_name) is refused. Keys given in --generation_kwargs are added to the task's
vocabulary restriction (``suppress_tokens``), which they override if they name it.

Every TargetPOConfig field is a flag, and a model, dataset and rewards from the Hub or disk can be swapped in:

    accelerate launch examples/target_po.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my-org/prompts --reward_funcs exact_match \\
        --per_device_train_batch_size 8 --num_generations 8 --max_completion_length 128 --output_dir outputs/qwen-tpo

``--reward_funcs`` takes built-in names (below) and reward-model ids or paths, in any mix.

The dataset flags of TRL's ``ScriptArguments`` work as in TRL's GRPO script: --dataset_name, --dataset_config,
--dataset_train_split, --dataset_test_split and --dataset_streaming, which reads the dataset as a stream
(``load_dataset(..., streaming=True)``; the embedded tasks' rows are streamed too, offline) in its own order, never
shuffled. A stream has no length, so --dataset_streaming needs --max_steps (the embedded tasks set it):

    python examples/target_po.py --dataset_streaming

The model flags of TRL's ``ModelConfig`` work as in TRL's GRPO script, with TRL's names, defaults and meaning:

    --model_revision REV            branch, tag or commit of --model_name_or_path (model and tokenizer); "main"
    --dtype {auto,bfloat16,float16,float32}
                                    precision the model is loaded in; "float32", as in TRL (auto: the checkpoint's)
    --attn_implementation NAME      eager, sdpa, flash_attention_2, ...; default: the model's own choice
    --trust_remote_code             run code shipped in the model's repository. One flag, TargetPOConfig's (TRL's
                                    GRPOConfig has it too): it reaches the policy, its tokenizer and reward models
    --use_peft                      train LoRA adapters only; the output folder then holds the adapter (and,
                                    with the embedded model, the base model it adapts, in base_model/)
      --lora_r 16 --lora_alpha 32 --lora_dropout 0.05 --lora_target_modules NAME [NAME ...]
      --lora_target_parameters NAME [NAME ...] --lora_modules_to_save NAME [NAME ...]
      --lora_task_type CAUSAL_LM --use_rslora --use_dora
                                    the LoRA settings, ignored without --use_peft (as in TRL)
    --load_in_4bit | --load_in_8bit bitsandbytes quantisation of the base model (QLoRA), on this process's GPU
      --bnb_4bit_quant_type {nf4,fp4} --use_bnb_nested_quant --bnb_4bit_quant_storage DTYPE
                                    4-bit settings; the 4-bit compute dtype is --dtype

For example, QLoRA on a CUDA GPU with bitsandbytes installed:

    accelerate launch examples/target_po.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 \\
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear --load_in_4bit \\
        --dataset_name my-org/prompts --reward_funcs exact_match --output_dir outputs/qwen-qlora-tpo

A single --lora_target_modules value that is "all-linear" or a regular expression is passed to PEFT as a string (a
pattern matched against whole module names); plain module names stay a list (matched as name suffixes), so
``--lora_target_modules q_proj`` works too. Keys given in --model_init_kwargs (JSON) win over these flags.

With the embedded model (no --model_name_or_path), which is built in memory rather than loaded, --dtype casts it
(auto keeps its float32), --attn_implementation switches its attention and --use_peft wraps it; --model_revision,
--load_in_4bit and --load_in_8bit need a model to load and are refused with a message saying so. Quantisation is
refused before any work, with what is missing, when bitsandbytes is not installed or no CUDA GPU is visible.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.cli import FlagParser
from targetpo.data import check_streaming_supported
from targetpo.demo import (
    GUESS_DIGITS,
    GuessingGame,
    Lock,
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    exact_reversal_reward,
    guessing_dataset,
    guessing_tokenizer,
    lock_dataset,
    lock_tokenizer,
    reverse_task_dataset,
    reverse_task_tokenizer,
)
from targetpo.modeling.loading import from_pretrained_or_explain


def exact_match_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 when the completion (its text, stripped) equals the row's `solution` column, else 0.0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if text.strip() == str(answer).strip() else 0.0 for text, answer in zip(texts, solution)]


BUILTIN_REWARDS = {"exact_reversal": exact_reversal_reward, "exact_match": exact_match_reward}

#: What --help opens with (argparse prints it under a short usage line).
HELP_DESCRIPTION = """\
Fine-tune a causal language model with Target Policy Optimization (TPO).

With neither --model_name_or_path nor --dataset_name it trains an embedded tiny model on an embedded task, offline,
and the defaults shown below are the reverse task's; with --dataset_name the library's apply. Task defaults fill
only the flags you leave out: a flag you pass is used as given, or refused with the reason.

examples:
  # the default: learn to reverse 6-bit strings from an exact-match reward (about 1.5 minutes on a 2-core CPU)
  python examples/target_po.py

  # the multi-turn task: find a hidden digit with a `guess` tool that answers higher or lower
  python examples/target_po.py --task guess

  # a Hub model on your own dataset (exact_match scores its `solution` column), rollouts from vLLM on the GPU
  accelerate launch examples/target_po.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
      --dataset_name my-org/prompts --reward_funcs exact_match --use_vllm --vllm_mode colocate \\
      --max_completion_length 128 --output_dir outputs/qwen-tpo
"""

#: Settings for the embedded tasks, for the flags the command line leaves out.
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
#: The lock's settings on top of the embedded ones; its lengths follow --lock_keys (lock_defaults).
LOCK_DEFAULTS = dict(output_dir="outputs/target_po-lock", max_steps=600, logging_steps=25)


def lock_defaults(script_args) -> dict:
    """The lock's settings: H presses at most, and room for every press, its tool turn and the last turn."""
    keys = script_args.lock_keys
    return {**LOCK_DEFAULTS, "max_completion_length": 4 * keys + 4, "max_tool_calling_iterations": keys}


@dataclass(frozen=True)
class Game:
    """An embedded multi-turn task: the environment that plays and scores it, its tokenizer (whose response template
    reads a turn's digits as a call), its prompts, the digits the model may write, and its settings."""

    environment: type
    tokenizer: Callable[[], Any]
    dataset: Callable[[Any], Any]  # ScriptArguments -> Dataset
    digits: str
    defaults: Callable[[Any], dict]  # ScriptArguments -> the settings it brings


GAMES = {
    "guess": Game(GuessingGame, guessing_tokenizer, lambda args: guessing_dataset(args.num_prompts, seed=0),
                  GUESS_DIGITS, lambda args: GUESS_DEFAULTS),
    "lock": Game(Lock, lock_tokenizer, lambda args: lock_dataset(args.lock_keys, args.num_prompts, seed=0), "01",
                 lock_defaults),
}
TASKS = ("reverse", *GAMES)


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
    dataset_streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the dataset as a stream (`datasets.IterableDataset`, `load_dataset(..., streaming=True)`; "
            "the embedded tasks' datasets are converted with `to_iterable_dataset()`): rows are read in order as "
            "training needs them, never shuffled, and --max_steps must be set."
        },
    )
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
            "help": "Embedded task: 'reverse' (reverse a binary string), 'guess' (find a hidden digit with a tool, "
            "over several turns) or 'lock' (press a lock's keys, the prompt's bits reversed, one tool call each; "
            "rewarded only at the end).",
            "choices": TASKS,
        },
    )
    reverse_length: int = field(
        default=6,
        metadata={
            "help": "Reverse task: length H of the binary strings, and so the default --max_completion_length (H) and "
            "--max_prompt_length (H + 1)."
        },
    )
    lock_keys: int = field(
        default=4,
        metadata={"help": "Lock task: the number of keys H, and so the turn limit (H presses) and the lengths."},
    )
    num_prompts: int = field(default=4096, metadata={"help": "Embedded tasks: number of prompts generated."})


DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class ModelArguments:
    """The model flags of TRL's ``ModelConfig``: same names, defaults and meaning.

    Two of ModelConfig's fields live elsewhere, so each flag exists once: ``model_name_or_path`` in
    :class:`ScriptArguments`, and ``trust_remote_code`` in TargetPOConfig (as in TRL, whose GRPOConfig has it).
    """

    model_revision: str = field(
        default="main",
        metadata={
            "help": "Branch, tag or commit id of --model_name_or_path to load, for the model and its tokenizer. "
            "Needs --model_name_or_path."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Precision the model is loaded in: bfloat16, float16, float32 (the default, as in TRL), or auto "
            "(the checkpoint's own). The embedded model is cast to it (auto keeps its float32). With --load_in_4bit it "
            "is also the compute dtype, so it must name one.",
            "choices": list(DTYPES),
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention implementation, e.g. eager, sdpa or flash_attention_2 (which needs the flash-attn "
            "package). Default: the model's own choice."
        },
    )
    use_peft: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters (the --lora_* flags) instead of every weight; the output is the adapter "
            "(with the embedded model, beside the base model it adapts, saved in base_model/)."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha: the adapter's scale is alpha / r."})
    lora_dropout: float = field(
        default=0.05,
        metadata={
            "help": "Dropout on the adapters' inputs. disable_dropout (on by default here) sets it to 0 like every "
            "dropout in the policy; pass --disable_dropout false to keep it."
        },
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules that get adapters: names (matched as suffixes), or one value that is 'all-linear' or a "
            "regular expression. Default: PEFT's choice for the architecture."
        },
    )
    lora_target_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Parameters (not modules) that get adapters, e.g. a mixture-of-experts layer's weights."},
    )
    lora_modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Modules trained in full and saved with the adapter (e.g. lm_head)."},
    )
    lora_task_type: str = field(
        default="CAUSAL_LM",
        metadata={"help": "PEFT task type. The policy is a causal language model, so only CAUSAL_LM is accepted."},
    )
    use_rslora: bool = field(
        default=False,
        metadata={
            "help": "Rank-stabilised LoRA: scale the adapters by lora_alpha / sqrt(r) instead of lora_alpha / r."
        },
    )
    use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA: train each adapted weight's magnitude separately from its direction (LoRA). Linear and "
            "Conv2D layers only; slower than LoRA."
        },
    )
    load_in_8bit: bool = field(
        default=False,
        metadata={"help": "Load the base model in 8 bits with bitsandbytes (needs --use_peft and a CUDA GPU)."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "Load the base model in 4 bits with bitsandbytes, QLoRA (needs --use_peft and a CUDA GPU)."},
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantisation type.", "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(
        default=False,
        metadata={"help": "Nested (double) 4-bit quantisation: the quantisation constants are quantised too."},
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None,
        metadata={"help": "dtype the packed 4-bit weights are stored in (e.g. uint8, bfloat16). Default: uint8."},
    )


#: Flags that select the embedded task's data, and those that select parts of --dataset_name's.
EMBEDDED_TASK_FLAGS = ("task", "reverse_length", "lock_keys", "num_prompts")
#: Flags that belong to one embedded task: what each sets, and the task.
TASK_FLAGS = {"reverse_length": ("the length of the reverse task's strings", "reverse"),
              "lock_keys": ("the number of the lock's keys", "lock")}
DATASET_FLAGS = ("dataset_config", "dataset_train_split", "dataset_test_split")


def script_argument_problems(script_args: ScriptArguments, passed: set[str]) -> list[str]:
    """The data flags passed that this command line would not use; empty when every one is used."""
    problems = []
    if script_args.dataset_name is not None:
        unused = [f"--{name}" for name in EMBEDDED_TASK_FLAGS if name in passed]
        if unused:
            problems.append(
                f"{', '.join(unused)}: the embedded tasks' settings, and --dataset_name {script_args.dataset_name} "
                "replaces those tasks with its own data. Drop them, or drop --dataset_name to train an embedded task."
            )
    else:
        unused = [f"--{name}" for name in DATASET_FLAGS if name in passed]
        if unused:
            problems.append(
                f"{', '.join(unused)}: these select parts of --dataset_name's dataset, and none was given (the "
                "embedded task is built in memory, with one split). Pass --dataset_name or drop them."
            )
        for flag, (what, task) in TASK_FLAGS.items():
            if flag in passed and script_args.task != task:
                problems.append(
                    f"--{flag} sets {what}, and --task {script_args.task} plays another task, which has none. Drop "
                    f"--{flag}, or use --task {task}."
                )
    return problems


#: Flags that only mean something beside a switch, as in TRL, which ignores them without it.
DEPENDENT_FLAGS = {
    "use_peft": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                 "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora"),
    "load_in_4bit": ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"),
    "use_vllm": tuple(spec.name for spec in dataclasses.fields(TargetPOConfig) if spec.name.startswith("vllm_")),
}


def ignored_flag_warnings(model_args: ModelArguments, training_args: TargetPOConfig, passed: set[str]) -> list[str]:
    """A warning for each group of flags passed without the switch they need (ignored then, as in TRL)."""
    messages = []
    for switch, names in DEPENDENT_FLAGS.items():
        unused = [f"--{name}" for name in names if name in passed]
        if unused and not getattr(model_args, switch, None) and not getattr(training_args, switch, None):
            messages.append(f"{', '.join(unused)} ignored: they configure --{switch}, which is off. Pass --{switch}.")
    return messages


def model_argument_problems(
    script_args: ScriptArguments, model_args: ModelArguments, passed: set[str] = frozenset()
) -> list[str]:
    """What stops the model flags from working, on this command line and on this machine; empty when nothing does.

    Checked before any data or model is loaded, so a bad combination fails in seconds. ``passed``: the flags written
    on the command line (see :func:`passed_flags`).
    """
    problems = []
    embedded = script_args.model_name_or_path is None
    if embedded and ("model_revision" in passed or model_args.model_revision != "main"):
        problems.append(
            f"--model_revision {model_args.model_revision} selects a version of --model_name_or_path, but none was "
            "given: the embedded model is built in memory and has no revisions. Pass --model_name_or_path or drop "
            "--model_revision."
        )
    if model_args.use_peft and model_args.lora_task_type != "CAUSAL_LM":
        problems.append(
            f"--lora_task_type {model_args.lora_task_type}: the policy is a causal language model, so its adapters "
            "must be CAUSAL_LM (the default). SEQ_CLS is for reward models, which are not trained here."
        )
    bits = [
        name
        for name, on in (("--load_in_4bit", model_args.load_in_4bit), ("--load_in_8bit", model_args.load_in_8bit))
        if on
    ]
    if not bits:
        return problems
    if len(bits) == 2:
        return [*problems, "--load_in_4bit and --load_in_8bit exclude each other: choose one precision."]
    (flag,) = bits
    if embedded:
        problems.append(
            f"{flag} quantises a model while loading it, and the embedded model is built in memory, not loaded: pass "
            "--model_name_or_path."
        )
    if not model_args.use_peft:
        problems.append(
            f"{flag} needs --use_peft: quantised weights cannot be trained, only LoRA adapters on top of them (QLoRA)."
        )
    if model_args.load_in_4bit and model_args.dtype == "auto":
        problems.append(
            "--load_in_4bit computes in --dtype, which must then name one: pass --dtype bfloat16 (or float16 or "
            "float32) instead of auto."
        )
    try:
        import bitsandbytes  # noqa: F401
    except (ImportError, RuntimeError, OSError) as error:  # not installed, or without the native library it needs
        problems.append(
            f"{flag} needs the bitsandbytes package, which cannot be imported here ({type(error).__name__}: {error}): "
            "pip install bitsandbytes."
        )
    if not torch.cuda.is_available():
        problems.append(
            f"{flag} needs a CUDA GPU, and none is visible (torch.cuda.is_available() is False): run on a machine "
            "with an NVIDIA GPU and a CUDA build of torch, or drop the flag and train LoRA adapters on the unquantised "
            "model (--use_peft alone)."
        )
    return problems


def quantization_config(model_args: ModelArguments) -> BitsAndBytesConfig | None:
    """The bitsandbytes settings of --load_in_4bit / --load_in_8bit, or None without them."""
    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=getattr(torch, model_args.dtype),  # the precision the rest of the model runs in
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def model_init_kwargs(model_args: ModelArguments, training_args: TargetPOConfig) -> dict:
    """``from_pretrained`` keyword arguments for a model loaded by id or path, from the model flags; keys given in
    --model_init_kwargs win. The trainer adds ``trust_remote_code`` from TargetPOConfig."""
    kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    quantization = quantization_config(model_args)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        # A quantised model cannot be moved once loaded: it loads whole onto this process's own GPU.
        kwargs["device_map"] = {"": training_args.local_process_index}
    return {**kwargs, **(training_args.model_init_kwargs or {})}


def adapt_built_model(model: PreTrainedModel, model_args: ModelArguments) -> PreTrainedModel:
    """Apply --dtype and --attn_implementation to a model built in memory (the embedded one)."""
    if model_args.dtype != "auto":  # auto: the dtype the weights already have
        model = model.to(getattr(torch, model_args.dtype))
    if model_args.attn_implementation is not None:
        model.set_attn_implementation(model_args.attn_implementation)
    return model


def lora_config(model_args: ModelArguments):
    """The ``peft.LoraConfig`` of --use_peft and the --lora_* flags, or None without --use_peft (the flags are then
    ignored, as in TRL)."""
    if not model_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise SystemExit("error: --use_peft needs the peft package: pip install peft.") from error
    target_modules = model_args.lora_target_modules
    if target_modules is not None and len(target_modules) == 1 and not re.fullmatch(r"[\w.]+", target_modules[0]):
        # PEFT reads a string as 'all-linear' or a regular expression over whole module names, a list as names.
        target_modules = target_modules[0]
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=target_modules,
        target_parameters=model_args.lora_target_parameters,
        modules_to_save=model_args.lora_modules_to_save,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its example commands keep their lines), each flag with its default."""


#: The --help sections of the script's own flags (TargetPOConfig's have theirs in targetpo.config.fields.FLAG_GROUPS).
SCRIPT_FLAG_GROUPS = {
    "model": ("model_name_or_path", *(spec.name for spec in dataclasses.fields(ModelArguments))),
    "data": ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
             "task", "reverse_length", "lock_keys", "num_prompts"),
    "rewards": ("reward_funcs",),
}


def build_parser() -> FlagParser:
    """The command line: ScriptArguments, every TargetPOConfig field and TRL's model flags, in sections, TPO first."""
    return FlagParser(
        (ScriptArguments, TargetPOConfig, ModelArguments),
        groups=SCRIPT_FLAG_GROUPS,
        usage="%(prog)s [FLAG VALUE ...]  (every flag is listed below)",
        description=HELP_DESCRIPTION,
        formatter_class=HelpFormatter,
    )


def task_defaults(script_args: ScriptArguments) -> dict:
    """The settings the embedded task brings for the flags left out; none with --dataset_name (the library's)."""
    if script_args.dataset_name is not None:
        return {}
    if script_args.task in GAMES:
        return {**EMBEDDED_DEFAULTS, **GAMES[script_args.task].defaults(script_args)}
    # Answers are exactly H characters ('0' and '1' only, no EOS); prompts are the H bits and '='.
    return {
        **EMBEDDED_DEFAULTS,
        "max_completion_length": script_args.reverse_length,
        "max_prompt_length": script_args.reverse_length + 1,
    }


def parse_arguments(argv: list[str]) -> tuple[ScriptArguments, TargetPOConfig, ModelArguments]:
    """The three argument groups, the task's defaults filling the flags the command line leaves out."""
    parser = build_parser()
    if any(arg in ("-h", "--help") for arg in argv):
        peek = ScriptArguments()  # --help shows the default task's settings
    else:
        peek = FlagParser(ScriptArguments).parse_args_into_dataclasses(argv, return_remaining_strings=True)[0]
    # argparse uses a default only for a flag that is not on the command line, so a flag passed wins whatever its value.
    parser.set_defaults(**task_defaults(peek))
    with warnings.catch_warnings():  # every --vllm_* flag without --use_vllm is named once, by build_trainer
        warnings.filterwarnings("ignore", message=r".* no effect with use_vllm=False")
        script_args, training_args, model_args = parser.parse_args_into_dataclasses(argv)
    return script_args, training_args, model_args


def passed_flags(argv: list[str]) -> set[str]:
    """The fields the command line sets, whatever their values (a value equal to a default counts as passed)."""
    parser = build_parser()
    groups = (ScriptArguments, TargetPOConfig, ModelArguments)
    names = {item.name for group in groups for item in dataclasses.fields(group)}
    # With a marker as every default, whatever the namespace holds besides the marker was written.
    unset = object()
    parser.set_defaults(**dict.fromkeys(names, unset))
    namespace, _ = parser.parse_known_args(argv)
    return {name for name, value in vars(namespace).items() if value is not unset}


def streaming_problems(training_args: TargetPOConfig) -> list[str]:
    """What stops --dataset_streaming from working with these settings; empty when nothing does.

    Checked before any data or model is loaded. The trainer refuses the same settings for any stream; here the
    message names the flag that made the dataset one.
    """
    problems = []
    if training_args.max_steps <= 0:
        problems.append(
            "--dataset_streaming needs --max_steps: a stream has no length, so the number of training steps cannot be "
            "derived from --num_train_epochs. Pass --max_steps N, or drop --dataset_streaming."
        )
    try:
        check_streaming_supported(training_args, train_is_stream=True)
    except ValueError as error:
        problems.append(f"--dataset_streaming: {error} Or drop --dataset_streaming.")
    return problems


def task_generation_kwargs(script_args: ScriptArguments, tokenizer) -> dict:
    """The embedded task's vocabulary restriction (``suppress_tokens``); none with --dataset_name."""
    if script_args.dataset_name is not None:
        return {}
    if script_args.task in GAMES:
        return digits_only_generation_kwargs(tokenizer, GAMES[script_args.task].digits)
    return binary_only_generation_kwargs(tokenizer)


def reverse_task_warnings(
    script_args: ScriptArguments, training_args: TargetPOConfig, tokenizer, reward_names: list[str]
) -> list[str]:
    """Why the lengths set for the reverse task leave its exact-reversal reward out of reach; empty when they do not."""
    if script_args.dataset_name is not None or script_args.task != "reverse" or "exact_reversal" not in reward_names:
        return []
    bits = script_args.reverse_length
    messages = []
    length = training_args.max_completion_length
    suppressed = (training_args.generation_kwargs or {}).get("suppress_tokens") or []
    can_stop = tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in suppressed
    unreachable = (
        "and no completion can equal the reversed string: the exact-reversal reward is 0 for every sample and training "
        f"gets no signal. --max_completion_length {bits} (the task's default, = --reverse_length) makes it reachable."
    )
    if length < bits:
        messages.append(
            f"--max_completion_length {length} is shorter than the {bits} characters of every answer "
            f"(--reverse_length {bits}), {unreachable}"
        )
    elif length > bits and not can_stop:
        messages.append(
            f"--max_completion_length {length}: the task suppresses EOS (only '0' and '1' may be written), so every "
            f"completion is {length} characters long, never the {bits} of an answer (--reverse_length {bits}), "
            f"{unreachable}"
        )
    prompt_length = training_args.max_prompt_length
    if prompt_length is not None and prompt_length < bits + 1:
        messages.append(
            f"--max_prompt_length {prompt_length} keeps only the last {prompt_length} of each prompt's {bits + 1} "
            f"tokens ({bits} bits and '='): the model cannot see the whole string it must reverse. "
            f"--max_prompt_length {bits + 1} (the task's default) keeps it whole."
        )
    return messages


#: Where a LoRA run of the embedded model saves the model its adapter was trained on, inside the output folder.
BASE_MODEL_FOLDER = "base_model"


def save_base_beside_adapter(trainer: TargetPOTrainer, base_model: PreTrainedModel, output_dir: str) -> Path:
    """Save the embedded model a LoRA run adapts in ``output_dir/base_model`` and name it (an absolute path) as the
    adapter's ``base_model_name_or_path``: built in memory, it exists nowhere else, and without it the adapter
    cannot be loaded."""
    directory = Path(output_dir, BASE_MODEL_FOLDER).resolve()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    base_model.generation_config = copy.deepcopy(policy.generation_config)  # samples as the policy does
    if trainer.is_world_process_zero():
        base_model.save_pretrained(directory)
        trainer.processing_class.save_pretrained(directory)
    for config in policy.peft_config.values():  # written into every adapter_config.json, checkpoints' too
        config.base_model_name_or_path = str(directory)
    return directory


def load_data(script_args: ScriptArguments):
    """The train and (optional) evaluation datasets: streams with --dataset_streaming."""
    if script_args.dataset_name is None:
        if script_args.task in GAMES:
            dataset = GAMES[script_args.task].dataset(script_args)
        else:
            dataset = reverse_task_dataset(script_args.reverse_length, script_args.num_prompts, seed=0)
        # Built in memory, so streamed offline: the same rows, read in order.
        return (dataset.to_iterable_dataset() if script_args.dataset_streaming else dataset), None
    from datasets import load_dataset

    try:
        dataset = load_dataset(
            script_args.dataset_name, script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    except Exception as error:  # datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        raise SystemExit(
            f"error: could not load dataset {script_args.dataset_name!r}: it is not a local path and the Hugging Face "
            f"Hub could not provide it ({type(error).__name__}: {error})."
        ) from error
    test = dataset[script_args.dataset_test_split] if script_args.dataset_test_split else None
    return dataset[script_args.dataset_train_split], test


def build_trainer(argv: list[str]) -> TargetPOTrainer:
    """Everything before training: the arguments resolved and checked, the data, the model and the trainer."""
    script_args, training_args, model_args = parse_arguments(argv)
    passed = passed_flags(argv)
    embedded_task = script_args.dataset_name is None
    game = GAMES.get(script_args.task) if embedded_task else None
    names = script_args.reward_funcs or (["exact_reversal"] if embedded_task and game is None else None)
    if not names and game is None:  # a game scores itself (its environment's get_reward)
        raise SystemExit("error: --reward_funcs is required with --dataset_name (built-in names or reward-model ids).")
    if not embedded_task and script_args.model_name_or_path is None:
        raise SystemExit(
            "error: --dataset_name needs --model_name_or_path: the embedded demo model and its 3-character tokenizer "
            "('0', '1', '=') can only read the embedded reversal task, not another dataset's text. Pass a model id or "
            "path, e.g. --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct."
        )
    problems = script_argument_problems(script_args, passed)
    problems += model_argument_problems(script_args, model_args, passed)
    if script_args.dataset_streaming:
        problems += streaming_problems(training_args)
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))
    for message in ignored_flag_warnings(model_args, training_args, passed):
        warnings.warn(message, stacklevel=2)
    peft_config = lora_config(model_args)
    reward_funcs = [BUILTIN_REWARDS.get(name, name) for name in names or []]
    train_dataset, eval_dataset = load_data(script_args)

    base_model = None
    try:
        if script_args.model_name_or_path is None:
            tokenizer = game.tokenizer() if game is not None else reverse_task_tokenizer()
            model = adapt_built_model(build_tiny_causal_lm(tokenizer, seed=training_args.seed), model_args)
            if peft_config is not None:
                base_model = copy.deepcopy(model)  # the adapters are injected into `model`; this stays the base
        else:
            # Loaded by the trainer, with these keyword arguments and TargetPOConfig's trust_remote_code.
            model = script_args.model_name_or_path
            training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
            tokenizer = from_pretrained_or_explain(
                AutoTokenizer,
                model,
                "tokenizer",
                revision=model_args.model_revision,
                trust_remote_code=training_args.trust_remote_code,
            )
        # The task's vocabulary restriction, under --generation_kwargs: a key given there wins (suppress_tokens too).
        training_args.generation_kwargs = {
            **task_generation_kwargs(script_args, tokenizer),
            **(training_args.generation_kwargs or {}),
        } or None
        for message in reverse_task_warnings(script_args, training_args, tokenizer, names or []):
            warnings.warn(message, stacklevel=2)
        trainer = TargetPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            environment_factory=game.environment if game is not None else None,
            peft_config=peft_config,
        )
    except OSError as error:  # a model, tokenizer or reward model that is neither on disk nor reachable
        raise SystemExit(f"error: {error}") from error

    if embedded_task and game is None:
        # Saved with the model, so that a plain `generate` samples as the rollouts did (the trainer itself ignores a
        # checkpoint's generation_config): only '0' and '1', max_completion_length of them (H unless passed), with the
        # resolved sampling settings.
        policy = trainer.accelerator.unwrap_model(trainer.model)
        policy.generation_config.update(**trainer.sampling.generation_config_fields())
    if base_model is not None:
        save_base_beside_adapter(trainer, base_model, training_args.output_dir)
    return trainer


def main(argv: list[str] | None = None) -> TargetPOTrainer:
    trainer = build_trainer(sys.argv[1:] if argv is None else argv)
    trainer.train()
    output_dir = trainer.args.output_dir
    trainer.save_model(output_dir)
    trainer.save_state()
    if trainer.is_world_process_zero():
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        if rewards:
            print(f"mean reward: first log {rewards[0]:.3f}, last log {rewards[-1]:.3f}")
        adapters = getattr(trainer.accelerator.unwrap_model(trainer.model), "peft_config", None)
        what = f"adapter (on {next(iter(adapters.values())).base_model_name_or_path})" if adapters else "model"
        print(f"saved {what}, tokenizer and trainer_state.json to {output_dir}")
    return trainer


if __name__ == "__main__":
    main()
