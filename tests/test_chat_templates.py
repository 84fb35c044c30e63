"""Multi-turn rollouts on a real model family's chat template: Qwen3's, as published with the Qwen3 models'
tokenizers (``chat_templates/qwen3.jinja``, the original text).

Qwen3's template renders an assistant turn differently by where it stands: the last one gets a ``<think>`` block
(empty if the turn has no reasoning), earlier ones lose their reasoning. Re-rendering a conversation would therefore
change turns the model already wrote. These tests check that a sample is the model's own tokens, as sampled,
followed by tool turns whose text is written out here by hand from the template.

The model's turns come from ``ScriptedPolicy`` (a rollout backend writing given turns), since a random tiny model
does not make tool calls; the tokenizer (a character tokenizer with Qwen3's special tokens), the template, the
response parsing for the ``qwen3`` model type, the tools, the environments and the trainer are real.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_config
from multi_turn_workers import ScriptedPolicy
from test_multi_turn import add
from transformers import Qwen3Config, Qwen3ForCausalLM

from targetpo import TargetPOTrainer
from targetpo.demo import PRINTABLE, GuessingGame, build_char_tokenizer, guessing_dataset
from targetpo.episodes.chat_template import ConversationTemplate
from targetpo.episodes.multi_turn import ToolLoop
from targetpo.episodes.tools import Toolbox

QWEN3_TEMPLATE = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
QWEN3_SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>",
]  # fmt: skip
EOS = "<|im_end|>"


def qwen3_tokenizer():
    tokenizer = build_char_tokenizer(PRINTABLE, chat_template=QWEN3_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN3_SPECIAL_TOKENS})
    tokenizer.eos_token = EOS
    return tokenizer


def qwen3_call(name, **arguments):
    """A call as Qwen3 writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def think(text):
    return f"<think>\n{text}\n</think>\n\n"


def tool_turn(result, thinking=True):
    """What Qwen3's template writes after the model's end-of-turn token for one tool result, through the next
    assistant header: written out from the template by hand."""
    header = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{EOS}\n{header}"


def turn_index(context):
    """Which of its turns the model is writing: the prompt ends with the first assistant header."""
    return context.count("<|im_start|>assistant") - 1


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "enable_thinking=False"])
def test_qwen3s_template_trains_tool_calls_on_exactly_the_tokens_the_model_wrote(thinking):
    tokenizer = qwen3_tokenizer()
    turns = {
        "sum": [think("Two and three.") + qwen3_call("add", a=2, b=3), think("It is 5.") + "five"],
        "garbled": ['<tool_call>\n{"name": "add", "argu', "sorry"],
        "unknown": [qwen3_call("nope"), "sorry"],
    }
    kwargs = {} if thinking else {"enable_thinking": False}
    template = ConversationTemplate(tokenizer, Toolbox([add]).schemas, [tokenizer.eos_token_id], kwargs, "qwen3")
    loop = ToolLoop(template, 600, None, [tokenizer.eos_token_id], tokenizer.pad_token_id)

    def policy(context):
        key = next(key for key in turns if f"<|im_start|>user\n{key}{EOS}" in context)
        return turns[key][turn_index(context)]

    prompts = [[{"role": "user", "content": key}] for key in turns]
    encoded = tokenizer([template.render(prompt, True) for prompt in prompts], add_special_tokens=False,
                        padding=True, padding_side="left", return_tensors="pt")
    rollout = loop.run(ScriptedPolicy(tokenizer, policy, max_new_tokens=200), encoded["input_ids"],
                       encoded["attention_mask"], [Toolbox([add])] * 3)
    loop.close()

    results = [conversation[1]["content"] for conversation in rollout.conversations]
    assert results[0] == "5"
    assert results[1].startswith("Error: the tool call could not be read")
    assert results[2].startswith("Error: there is no tool named 'nope'")
    assert rollout.conversations[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert rollout.conversations[0][2]["content"] == "five"
    completions = rollout.completions
    for index, (key, result) in enumerate(zip(turns, results)):
        first, second = turns[key]
        length = int(completions.attention_mask[index].sum())
        ids = completions.ids[index, :length].tolist()
        # The model's turns as it wrote them, reasoning included, and the template's tool turn between them.
        expected = first + EOS + tool_turn(result, thinking) + second + EOS
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        mask = completions.loss_mask[index, :length].bool().tolist()
        trained = tokenizer.decode([token for token, on in zip(ids, mask) if on], skip_special_tokens=False)
        assert trained == first + EOS + second + EOS
    assert rollout.tool_calls == [1, 1, 1] and rollout.tool_failures == [0, 1, 1]


def tiny_qwen3(tokenizer):
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def qwen3_halving_search(context):
    """Binary search over 0-7 from the game's answers so far, each guess a Qwen3 call of ``guess``; no call once a
    guess hit."""
    guesses = [int(number) for number in re.findall(r'"number": (\d)', context)]
    answers = re.findall(r"<tool_response>\n(.)\n</tool_response>", context)
    low, high = 0, 7
    for guess, answer in zip(guesses, answers):
        if answer == "=":
            return "found it"
        low, high = (guess + 1, high) if answer == "+" else (low, guess - 1)
    return think("halve") + qwen3_call("guess", number=(low + high + 1) // 2)


def test_an_environment_trains_on_qwen3s_template_with_each_samples_own_tokens(tmp_path):
    tokenizer = qwen3_tokenizer()
    seen = []

    def record(completions, completion_ids, environments, **kwargs):
        seen.append((completions, completion_ids, environments))
        return [0.0] * len(completions)

    trainer = TargetPOTrainer(
        tiny_qwen3(tokenizer),
        [record],
        args=make_config(tmp_path, max_completion_length=600, max_prompt_length=None, max_tool_calling_iterations=3,
                         per_device_train_batch_size=8, num_generations=4, max_steps=1),
        train_dataset=guessing_dataset(num_prompts=8, seed=0),
        processing_class=tokenizer,
        environment_factory=GuessingGame,
    )
    trainer.rollout_backend = ScriptedPolicy(tokenizer, qwen3_halving_search, max_new_tokens=200)
    trainer.train()
    conversations, completion_ids, environments = seen[0]
    for conversation, ids, environment in zip(conversations, completion_ids, environments):
        guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in conversation if m.get("tool_calls")]
        answers = [m["content"] for m in conversation if m["role"] == "tool"]
        # Each verdict is the game's on this sample's own secret; halving finds all but 0 within three guesses.
        assert answers == ["=" if g == environment.secret else "+" if environment.secret > g else "-" for g in guesses]
        assert environment.found == (environment.secret != 0)
        expected = "".join(
            think("halve") + qwen3_call("guess", number=guess) + EOS + tool_turn(answer)
            for guess, answer in zip(guesses, answers)
        )
        if environment.found:
            expected += "found it" + EOS
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    logs = trainer.state.log_history[0]
    assert logs["rewards/GuessingGame/mean"] == pytest.approx(sum(e.found for e in environments) / len(environments))
    assert torch.isfinite(torch.tensor(logs["loss"]))


#: Two templates that cannot be made safe: one closes an assistant turn with another token once messages follow it,
#: one writes the tool message from the assistant's text. Hermes-style otherwise (test_multi_turn.HERMES_TEMPLATE).
ROLE_LOOP = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<assistant>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}{{ '<eos>' if loop.last else END }}"
    "{% elif m.role == 'tool' %}<tool>{{ TOOL }}{{ m.content }}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
UNSAFE_TEMPLATES = {
    "end-of-turn-moves": ROLE_LOOP.replace("END", "'<end>'").replace("{{ TOOL }}", ""),
    "tool-turn-reads-the-assistant": ROLE_LOOP.replace("END", "'<eos>'").replace(
        "{{ TOOL }}", "{{ messages[loop.index0 - 1].content[:3] }}:"
    ),
}


@pytest.mark.parametrize(
    "name, message",
    [
        ("end-of-turn-moves", "renders an assistant turn differently once tool messages follow it"),
        ("tool-turn-reads-the-assistant", "writes the tool messages differently depending on what the assistant wrote"),
    ],
)
def test_a_template_that_cannot_be_made_safe_is_refused_naming_the_model_type_and_the_fix(name, message):
    tokenizer = build_char_tokenizer(PRINTABLE, chat_template=UNSAFE_TEMPLATES[name])
    with pytest.raises(ValueError, match=message) as refused:
        ConversationTemplate(tokenizer, Toolbox([add]).schemas, [tokenizer.eos_token_id], None, "llama")
    assert "this 'llama' model" in str(refused.value) and "rollout_func" in str(refused.value)


def test_a_stop_token_that_is_not_the_end_of_turn_is_refused_for_tools_and_the_end_of_turn_is_taken(tmp_path):
    tokenizer = qwen3_tokenizer()
    end_of_call, end_of_turn = tokenizer.convert_tokens_to_ids(["</tool_call>", EOS])
    schemas = Toolbox([add]).schemas
    eos = [tokenizer.eos_token_id, end_of_call]
    # A turn stopped at </tool_call> would be read without it (its call unreadable) and miss the template's <|im_end|>.
    with pytest.raises(ValueError, match=r"\['</tool_call>'\].*ends an assistant turn with '<\|im_end\|>'"):
        ConversationTemplate(tokenizer, schemas, eos, None, "qwen3", added_stop_token_ids=[end_of_call])
    ConversationTemplate(tokenizer, schemas, [end_of_turn], None, "qwen3", added_stop_token_ids=[end_of_turn])
    ConversationTemplate(tokenizer, [], eos, None, "qwen3", added_stop_token_ids=[end_of_call])  # no tools: no turns
    # The trainer passes the stop tokens generation_kwargs adds, before any work.
    args = make_config(tmp_path, max_completion_length=64, max_prompt_length=None,
                       generation_kwargs={"eos_token_id": end_of_call})
    with pytest.raises(ValueError, match="'</tool_call>'"):
        TargetPOTrainer(tiny_qwen3(tokenizer), [lambda completions, **kwargs: [0.0] * len(completions)], args=args,
                        train_dataset=guessing_dataset(num_prompts=8, seed=0), processing_class=tokenizer,
                        environment_factory=GuessingGame)


def test_a_template_whose_turn_holds_no_stop_token_is_refused_until_its_end_of_turn_is_added(tmp_path):
    # A base model's tokenizer: its EOS is not the chat template's end of turn, so turns would never stop.
    tokenizer = qwen3_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*QWEN3_SPECIAL_TOKENS, "<|endoftext|>"]})
    tokenizer.eos_token = "<|endoftext|>"
    schemas = Toolbox([add]).schemas
    with pytest.raises(ValueError, match=r"No stop token \(\['<\|endoftext\|>'\]\) is in .*</tool_call><\|im_end\|>"):
        ConversationTemplate(tokenizer, schemas, [tokenizer.eos_token_id], None, "qwen3")
    args = make_config(tmp_path, max_completion_length=64, max_prompt_length=None)
    dataset = guessing_dataset(num_prompts=8, seed=0)

    def build(args):
        return TargetPOTrainer(tiny_qwen3(tokenizer), [lambda completions, **kwargs: [0.0] * len(completions)],
                               args=args, train_dataset=dataset, processing_class=tokenizer,
                               environment_factory=GuessingGame)

    with pytest.raises(ValueError, match="Add the template's end-of-turn token"):
        build(args)
    end_of_turn = tokenizer.convert_tokens_to_ids(EOS)
    args = make_config(tmp_path, max_completion_length=64, max_prompt_length=None,
                       generation_kwargs={"eos_token_id": end_of_turn})
    trainer = build(args)
    assert end_of_turn in trainer._rollout_context.tool_loop.eos_token_ids
