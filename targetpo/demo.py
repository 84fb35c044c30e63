"""The embedded offline default: a tiny causal LM, a character tokenizer and a sparse-reward task.

The task is the paper's terminal-reward one: reverse a binary string of length H. A completion earns 1 only when it is
exactly the reversed string, so a random policy succeeds with probability 2**-H and most groups carry no signal.
Only '0' and '1' may be emitted (:func:`binary_only_generation_kwargs`), so every completion has exactly H tokens.
The multi-turn pieces: the guessing game and the lock (environments whose tool the model calls; the lock's reward is
as sparse as the reversal's) and a tokenizer whose chat template renders plain tool functions and their calls
(docs/multi_turn.md's offline examples). :func:`save_tiny_chat_model` saves a tiny model with that tokenizer to a
folder, in place of a Hub model, so that every example that loads one also runs offline;
:func:`save_tiny_vision_chat_model` does the same for a vision-language model and its processor.

Everything is built locally from a config: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import random
import string
from pathlib import Path
from typing import Any

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.processing_utils import ProcessorMixin

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
#: Enough characters for English prompts, chat markup and numbers.
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " \n"
#: Lines rendered as "<role>content" followed by a newline; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_char_tokenizer(
    characters: str = PRINTABLE,
    chat_template: str | None = CHAT_TEMPLATE,
    special_tokens_last: bool = False,
    named_special_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character, plus <pad>, <eos> and <unk>, and a simple chat template.

    With ``special_tokens_last`` the characters take the ids 0, 1, ... in order and the special tokens follow them, so
    a model whose vocabulary is the characters alone (an output head over them only) can use it.
    ``named_special_tokens`` adds special tokens after all of those, each also an attribute (``{"image_token":
    "<image>"}`` gives ``tokenizer.image_token`` and ``tokenizer.image_token_id``), as multimodal processors read them.
    """
    order = (*characters, *SPECIAL_TOKENS) if special_tokens_last else (*SPECIAL_TOKENS, *characters)
    vocab: dict[str, int] = {}
    for token in order:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is its own piece
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=dict(named_special_tokens or {}),
    )
    tokenizer.chat_template = chat_template
    return tokenizer


TINY_ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    architecture: str = "qwen2",
) -> PreTrainedModel:
    """A small model with random weights (about 0.1M parameters), sized for CPU training: Qwen2's architecture, or
    Qwen3's (``architecture="qwen3"``)."""
    import torch

    config_class, model_class = TINY_ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def reverse_task_dataset(length: int = 6, num_prompts: int = 4096, seed: int = 0, separator: str = "=") -> Dataset:
    """Random binary strings as prompts ``"0110="`` (each bit drawn uniformly, independently), with the reversed string
    in the ``target`` column. ``separator`` ends each prompt; the paper's prompts are the bits alone (``""``)."""
    if length < 1:
        raise ValueError(f"The string length must be >= 1, got {length}.")
    rng = random.Random(seed)
    bits = ["".join(rng.choice("01") for _ in range(length)) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": [b + separator for b in bits], "target": [b[::-1] for b in bits]})


def exact_reversal_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """1.0 when the completion is exactly the reversed string, else 0.0: a terminal, sparse reward."""
    return [1.0 if completion.strip() == expected else 0.0 for completion, expected in zip(completions, target)]


def binary_only_generation_kwargs(tokenizer: PreTrainedTokenizerFast) -> dict[str, list[int]]:
    """Generation settings that let the model emit only '0' and '1' (every other token, EOS included, suppressed)."""
    allowed = {tokenizer.convert_tokens_to_ids("0"), tokenizer.convert_tokens_to_ids("1")}
    return {"suppress_tokens": [index for index in range(len(tokenizer)) if index not in allowed]}


def reverse_task_tokenizer() -> PreTrainedTokenizerFast:
    """The demo's tokenizer: only the characters the task uses."""
    return build_char_tokenizer("01=", chat_template=None)


# --------------------------------------------------------------------------------------------- the guessing game
#: Role markers are single tokens, so the template's scaffolding costs three tokens per tool turn.
ROLE_TOKENS = ("<tools>", "<user>", "<assistant>", "<tool>")
#: The tools' names, then the messages; the model's turn is the digits it guesses, closed by <eos>.
GUESS_CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<assistant>"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}{{ call.function.arguments.number }}{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<eos>"
    "{% else %}<{{ message.role }}>{{ message.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
#: How the model's turn reads (transformers response parsing): any text is a call of ``guess`` with it as the
#: number; a turn with no text ends the game.
GUESS_RESPONSE_TEMPLATE = {
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "content": "int",
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "guess", "arguments": {"number": "{content}"}}},
        }
    },
}
GUESS_DIGITS = "01234567"


class GuessingGame:
    """Find a hidden digit from 0 to 7 by guessing: each guess is answered '+' (it is higher), '-' (lower) or '='.

    The reward is terminal and 0/1: whether a guess hit the digit. Three guesses are enough when each halves the range
    (for seven of the eight digits), so the policy has to learn to read the answers, not only to guess.
    """

    def reset(self, secret: int, **row) -> None:
        self.secret = int(secret)
        self.found = False

    def guess(self, number: int) -> str:
        """Guess the hidden digit.

        Args:
            number: the guess, a digit from 0 to 7.
        """
        if not 0 <= number <= 7:
            raise ValueError("guess one digit from 0 to 7")
        if number == self.secret:
            self.found = True
            return "="
        return "+" if self.secret > number else "-"

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.0


def guessing_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer with the role markers as tokens, the game's chat template and response template."""
    tokenizer = build_char_tokenizer(PRINTABLE, chat_template=GUESS_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    tokenizer.response_template = GUESS_RESPONSE_TEMPLATE
    return tokenizer


def guessing_dataset(num_prompts: int = 4096, seed: int = 0) -> Dataset:
    """One game per row: the same short prompt, and the hidden digit in the ``secret`` column."""
    rng = random.Random(seed)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "?"}] for _ in range(num_prompts)],
            "secret": [rng.randrange(len(GUESS_DIGITS)) for _ in range(num_prompts)],
        }
    )


def digits_only_generation_kwargs(
    tokenizer: PreTrainedTokenizerFast, digits: str = GUESS_DIGITS
) -> dict[str, list[int]]:
    """Generation settings that let the model write only ``digits`` (the game's, by default) and <eos>."""
    allowed = {tokenizer.convert_tokens_to_ids(digit) for digit in digits} | {tokenizer.eos_token_id}
    return {"suppress_tokens": [index for index in range(len(tokenizer)) if index not in allowed]}


# ------------------------------------------------------------------------------------------------ the lock
class Lock:
    """A lock opened by pressing its H keys (each 0 or 1) one call at a time: the code is the prompt's bits reversed.

    Every press is answered "." whatever it was, so nothing tells the model how it is doing until the end. The reward
    is terminal and 0/1: whether the keys pressed, in order, are exactly the code. A sample that presses fewer keys,
    or a wrong one, fails; the turn limit (H calls) stops it pressing more. With only '0', '1' and <eos> to write, a
    random policy opens a 4-key lock about 1% of the time or less; a policy that has learned the reversal, always.
    """

    def reset(self, code: str, **row) -> None:
        self.code = code
        self.pressed = ""

    def press(self, number: int) -> str:
        """Press one key of the lock.

        Args:
            number: the key, 0 or 1.
        """
        if number not in (0, 1):
            raise ValueError("press 0 or 1")
        self.pressed += str(number)
        return "."

    def get_reward(self) -> float:
        return 1.0 if self.pressed == self.code else 0.0


#: How a turn reads for the lock: its digits are a call of ``press``; a turn with no text ends the sample.
LOCK_RESPONSE_TEMPLATE = {
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "content": "int",
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "press", "arguments": {"number": "{content}"}}},
        }
    },
}


def lock_tokenizer() -> PreTrainedTokenizerFast:
    """The guessing game's tokenizer and chat template, reading a turn's digits as a call of ``press``."""
    tokenizer = guessing_tokenizer()
    tokenizer.response_template = LOCK_RESPONSE_TEMPLATE
    return tokenizer


def lock_dataset(keys: int, num_prompts: int = 4096, seed: int = 0) -> Dataset:
    """One lock per row: the prompt shows ``keys`` random bits, the ``code`` column holds them reversed."""
    rng = random.Random(seed)
    shown = ["".join(rng.choice("01") for _ in range(keys)) for _ in range(num_prompts)]
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": bits}] for bits in shown], "code": [bits[::-1] for bits in shown]}
    )


# ------------------------------------------------------------------------------------------------ plain tool calls
#: The tools' names, then the messages; the model writes a call as Hermes-style JSON in <tool_call> tags, which
#: targetpo reads without a response template of its own (as it does for models whose chat templates mark calls so).
TOOL_CALLING_CHAT_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<assistant>{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}<eos>"
    "{% else %}<{{ message.role }}>{{ message.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tool_calling_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer with the role markers as tokens and a chat template that renders tools and their calls."""
    tokenizer = build_char_tokenizer(PRINTABLE, chat_template=TOOL_CALLING_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    return tokenizer


# ------------------------------------------------------------------------------------------- a stand-in Hub model
#: Enough positions for a prompt and a completion of the docs' lengths (prompts of 512 tokens, the default limit, and
#: completions of 512 or more); rotary positions cost nothing until used.
TINY_CHAT_MODEL_POSITIONS = 4096


def save_tiny_chat_model(directory: str | os.PathLike, max_positions: int = TINY_CHAT_MODEL_POSITIONS) -> str:
    """Save a tiny chat model and its tokenizer to ``directory``, as a Hub model is saved; return its absolute path.

    Use the path wherever an example names a Hub model (``model="Qwen/Qwen2.5-0.5B-Instruct"``, a reward model's id)
    to run it offline::

        model = save_tiny_chat_model("tiny-chat")
        trainer = TargetPOTrainer(model=model, reward_funcs=..., train_dataset=...)

    The model is :func:`build_tiny_causal_lm`'s in Qwen3's architecture (random weights, a fixed seed,
    ``max_positions`` positions); the tokenizer is :func:`tool_calling_tokenizer`'s, one token per character, whose
    chat template renders the tools offered, the messages and the assistant's tool calls (Hermes-style
    ``<tool_call>`` JSON, which targetpo reads). Both load with ``AutoModelForCausalLM`` and ``AutoTokenizer``. It
    shows how an example is wired, not what it learns: an untrained model rarely writes a well-formed tool call or a
    right answer. Nothing is downloaded.
    """
    tokenizer = tool_calling_tokenizer()
    # Qwen3's architecture, not the demo's Qwen2: AutoTokenizer loads a Qwen2 model's tokenizer as Qwen2's own class,
    # which replaces this tokenizer's one-token-per-character splitting with Qwen2's (spaces and newlines are lost).
    model = build_tiny_causal_lm(tokenizer, max_positions=max_positions, architecture="qwen3")
    path = Path(directory).resolve()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------- a stand-in vision-language model
def image_chat_template(image_placeholder: str) -> str:
    """:data:`CHAT_TEMPLATE` for content that may also be a list of parts ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}``, an image part rendering as ``image_placeholder`` (which the processor expands)."""
    return (
        "{% for message in messages %}<{{ message['role'] }}>"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image_placeholder + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


def build_tiny_vision_chat_model(
    seed: int = 0, text_layers: int = 1, max_positions: int = TINY_CHAT_MODEL_POSITIONS
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A tiny LLaVA-NeXT with random weights and its processor: ``(model, processor)``.

    One text layer (Llama's) and one CLIP vision layer, hidden size 32. The vision tower reads 28x28 crops of 14-pixel
    patches (4 features each, CLS dropped); with the grid pinpoints 28x56 and 56x28 every image is the base crop plus
    two, so ``pixel_values`` is (images, 3 crops, 3, 28, 28), with ``image_sizes`` (images, 2). The tokenizer is
    :func:`build_char_tokenizer`'s with an ``<image>`` token; an image part renders as ``<image>``, which the processor
    expands to the base crop's 4 tokens plus the unpadded high-resolution grid and its row newlines (10 for a square
    image, up to 16 otherwise). Generation never samples ``<image>`` (``generation_config.suppress_tokens``): a
    completion holding one would not match the images of the next forward pass. Needs Pillow; nothing is downloaded.
    """
    if importlib.util.find_spec("PIL") is None:
        raise ImportError("The tiny vision-language model's image processor needs Pillow: pip install pillow")
    import torch
    from transformers import LlavaNextForConditionalGeneration

    processor = _tiny_llava_next_processor()
    config = _tiny_llava_next_config(processor.tokenizer, text_layers, max_positions)
    tokenizer = processor.tokenizer
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlavaNextForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.suppress_tokens = [tokenizer.image_token_id]
    return model, processor


#: The tiny LLaVA-NeXT's sizes: hidden size and attention heads, and the grid pinpoints that give every image the base
#: crop plus two (so pixel_values rows match).
_TINY_VISION_HIDDEN, _TINY_VISION_HEADS, _TINY_VISION_PINPOINTS = 32, 2, [[28, 56], [56, 28]]


def _tiny_llava_next_processor() -> ProcessorMixin:
    """The tiny LLaVA-NeXT's processor: 28x28 crops, and the character tokenizer with an ``<image>`` token."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    tokenizer = build_char_tokenizer(
        chat_template=image_chat_template("<image>"), named_special_tokens={"image_token": "<image>"}
    )
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=_TINY_VISION_PINPOINTS
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=tokenizer.chat_template,
        num_additional_image_tokens=1,  # CLIP's CLS token
    )


def _tiny_llava_next_config(tokenizer: Any, text_layers: int, max_positions: int) -> Any:
    """One Llama text layer (or ``text_layers``) and one CLIP vision layer, hidden size 32."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    hidden, heads = _TINY_VISION_HIDDEN, _TINY_VISION_HEADS
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        image_size=28,
        patch_size=14,
    )
    return LlavaNextConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.image_token_id,
        image_grid_pinpoints=_TINY_VISION_PINPOINTS,
        vision_feature_layer=-1,  # the one vision layer's output (the default -2 would skip it)
        vision_feature_select_strategy="default",
        image_seq_length=4,
        tie_word_embeddings=True,
    )


def save_tiny_vision_chat_model(directory: str | os.PathLike, max_positions: int = TINY_CHAT_MODEL_POSITIONS) -> str:
    """Save a tiny vision-language chat model and its processor to ``directory``, as a Hub model is saved; return its
    absolute path.

    Use the path wherever an example names a Hub vision-language model (``"Qwen/Qwen2.5-VL-3B-Instruct"``) to run it
    offline: the trainer loads the model and its processor from it. They are :func:`build_tiny_vision_chat_model`'s
    (LLaVA-NeXT's architecture, random weights, a fixed seed, ``max_positions`` positions) and load with
    ``AutoModelForImageTextToText`` and ``AutoProcessor``, whose chat template renders image parts. It shows how an
    example is wired, not what it learns. Needs Pillow; nothing is downloaded.
    """
    model, processor = build_tiny_vision_chat_model(max_positions=max_positions)
    path = Path(directory).resolve()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
