"""Shared fixtures: real tiny models built from configs, real tokenizers, real datasets. Nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset

from targetpo import TargetPOConfig
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)


@pytest.fixture
def prompt_dataset():
    words = ["cat", "dog", "sun", "map", "pen", "cup", "box", "hat"]
    return Dataset.from_dict({"prompt": [f"Say {w}:" for w in words], "answer": words})


@pytest.fixture
def chat_dataset():
    words = ["cat", "dog", "sun", "map"]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Say {w}"}] for w in words],
            "answer": words,
        }
    )


def count_letters_reward(completions, **kwargs):
    """A dense, deterministic reward: the number of letters 'a' in the completion."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text.count("a")) for text in texts]


def letters_then_position_reward(completions, **kwargs):
    """The number of letters 'a', plus the row's position over the batch size: scores differ within every group
    whatever was sampled (integers apart by less than 1 cannot tie), so every group is informative and every step
    trains, even when a random model writes no 'a'."""
    return [score + index / len(completions) for index, score in enumerate(count_letters_reward(completions))]


def length_reward(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(text)) for text in texts]


def make_config(tmp_path, **overrides):
    """A small, fast configuration: 2 prompts x 4 completions per step, short completions, no saving."""
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_prompt_length=64,  # with the completion, within the tiny models' 128 positions
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        # Another stream (TARGETPO_TEST_SEED=3) finds tests that lean on what a random model happens to sample.
        seed=int(os.environ.get("TARGETPO_TEST_SEED", "0")),
    )
    settings.update(overrides)
    return TargetPOConfig(**settings)


def snapshot(model):
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def changed(before, model):
    return {name for name, param in model.named_parameters() if not torch.equal(before[name], param.detach())}
