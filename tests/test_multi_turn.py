"""Multi-turn rollouts: the tool loop, environments, rollout_func, and training on samples with tool-written tokens.

Most loop tests need the model to make particular tool calls, which a randomly initialised model does not: they
generate with ``ScriptedPolicy`` (``multi_turn_workers``), a rollout backend (the public interface) that writes given
turns. Every other part (tokenizer, chat template, transformers' response parsing, the tools, the trainer, gloo
processes) is real. The end-to-end tests sample from a real tiny model with the real backends.
"""

import asyncio
import contextlib
import copy
import functools
import json
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_config
from datasets import Dataset
from multi_turn_workers import ScriptedPolicy, halving_search, two_process_game_worker
from test_distributed import free_port

from targetpo import TargetPOTrainer
from targetpo.demo import (
    PRINTABLE,
    ROLE_TOKENS,
    GuessingGame,
    Lock,
    build_char_tokenizer,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    guessing_dataset,
    guessing_tokenizer,
    lock_dataset,
    lock_tokenizer,
)
from targetpo.episodes.async_runner import ToolCallLimits
from targetpo.episodes.chat_template import HERMES_FIELDS, ConversationTemplate, response_template
from targetpo.episodes.multi_turn import ToolLoop
from targetpo.episodes.tools import Toolbox, environment_tools
from targetpo.generation import SamplingSettings, TransformersBackend

#: A Hermes-style template on the character tokenizer: calls are JSON inside <tool_call> tags (the library's fallback
#: response template reads them).
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<assistant>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}<eos>{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def hermes_tokenizer():
    tokenizer = build_char_tokenizer(PRINTABLE, chat_template=HERMES_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    return tokenizer


def call(tool, **arguments):
    return "<tool_call>" + json.dumps({"name": tool, "arguments": arguments}) + "</tool_call>"


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def broken(text: str) -> str:
    """A tool that always fails.

    Args:
        text: anything.
    """
    raise RuntimeError("the disk is full")


def run_loop(tokenizer, tools, turns_by_prompt, prompts, max_completion_length=400, max_iterations=None,
             limits=ToolCallLimits()):
    """Run the real tool loop; each prompt's scripted turns are played in order."""
    template = ConversationTemplate(tokenizer, Toolbox(tools).schemas, [tokenizer.eos_token_id])
    loop = ToolLoop(template, max_completion_length, max_iterations, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                    limits=limits)

    def policy(context):
        prompt = next(key for key in turns_by_prompt if f"<user>{key}" in context)
        return turns_by_prompt[prompt][context.count("<assistant>") - 1]

    texts = template.tokenizer.apply_chat_template
    rendered = [texts(p, tools=template.schemas, tokenize=False, add_generation_prompt=True) for p in prompts]
    encoded = tokenizer(rendered, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    toolboxes = [Toolbox(tools)] * len(prompts)
    try:
        return loop.run(ScriptedPolicy(tokenizer, policy), encoded["input_ids"], encoded["attention_mask"], toolboxes)
    finally:
        loop.close()


def user(text):
    return [{"role": "user", "content": text}]


def test_the_loop_runs_sync_and_async_tools_and_answers_every_kind_of_bad_call_with_an_error():
    tokenizer = hermes_tokenizer()
    both_started = asyncio.Event()
    arrived = []

    async def meet(name: str) -> str:
        """Wait until both samples' calls are running at once.

        Args:
            name: who arrives.
        """
        arrived.append(name)
        if len(arrived) == 2:
            both_started.set()
        await asyncio.wait_for(both_started.wait(), timeout=5)  # run one after the other, this times out
        return f"met {name}"

    turns = {
        "sum": [call("add", a=2, b=3), "five"],
        "meetA": [call("meet", name="A"), "ok"],
        "meetB": [call("meet", name="B"), "ok"],
        "raise": [call("broken", text="x"), "sorry"],
        "garbled": ['<tool_call>{"name": "add", "argu', "sorry"],
        "unknown": [call("nope"), "sorry"],
        "badargs": [call("add", a=1), "sorry"],
    }
    prompts = [user(key) for key in turns]
    rollout = run_loop(tokenizer, [add, meet, broken], turns, prompts, max_completion_length=400)

    results = [conversation[1]["content"] for conversation in rollout.conversations]
    assert results[0] == "5" and results[1] == "met A" and results[2] == "met B"
    assert results[3] == "Error: broken raised RuntimeError: the disk is full"
    assert results[4].startswith("Error: the tool call could not be read")
    assert results[5].startswith("Error: there is no tool named 'nope'")
    assert results[6].startswith("Error: wrong arguments for 'add'") and "'b'" in results[6]
    assert rollout.tool_calls == [1] * 7
    assert rollout.tool_failures == [0, 0, 0, 1, 1, 1, 1]
    assert rollout.turns == [2] * 7
    assert not rollout.completions.truncated.any()
    # The first assistant message carries the parsed call; the last one is the answer without a call.
    assert rollout.conversations[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert rollout.conversations[0][2] == {"role": "assistant", "content": "five"}


def test_a_call_past_tool_call_timeout_is_answered_with_an_error_and_the_turn_goes_on():
    release = threading.Event()  # set at the end: a hung sync tool's thread, which cannot be stopped, then ends

    def hang(text: str) -> str:
        """Never answer in time.

        Args:
            text: anything.
        """
        return "late" if release.wait(timeout=30) is False else "released"

    async def hang_async(text: str) -> str:
        """Never answer in time, asynchronously.

        Args:
            text: anything.
        """
        await asyncio.sleep(30)
        return "late"

    turns = {"sync": [call("hang", text="x"), "gave up"], "async": [call("hang_async", text="x"), "gave up"],
             "sum": [call("add", a=2, b=3), "five"]}
    try:
        rollout = run_loop(hermes_tokenizer(), [add, hang, hang_async], turns, [user(key) for key in turns],
                           limits=ToolCallLimits(timeout=0.5))
    finally:
        release.set()
    results = [conversation[1]["content"] for conversation in rollout.conversations]
    assert results[0] == "Error: hang did not finish within 0.5 s (tool_call_timeout); it was given up."
    assert results[1] == "Error: hang_async did not finish within 0.5 s (tool_call_timeout); it was given up."
    assert results[2] == "5"
    assert rollout.tool_failures == [1, 1, 0] and rollout.turns == [2, 2, 2]  # every sample went on to its answer


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("limits", [ToolCallLimits(), ToolCallLimits(timeout=30), ToolCallLimits(concurrency=2)])
def test_a_system_exit_in_a_tool_ends_the_run_wherever_the_tool_runs(limits, asynchronous):
    def leave(text: str) -> str:
        """Leave.

        Args:
            text: anything.
        """
        raise SystemExit(3)

    async def leave_async(text: str) -> str:
        """Leave.

        Args:
            text: anything.
        """
        raise SystemExit(3)

    leaving = leave_async if asynchronous else leave
    turns = {"leave": [call(leaving.__name__, text="x"), "gone"], "sum": [call("add", a=2, b=3), "five"]}
    ended = []

    def play() -> None:  # on a thread of its own: a run that waits forever for the tool fails the test instead
        try:
            run_loop(hermes_tokenizer(), [add, leaving], turns, [user(key) for key in turns], limits=limits)
        except BaseException as error:
            ended.append(error)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    player.join(timeout=60)
    assert not player.is_alive(), "the run waits forever for a tool that raised SystemExit"
    assert len(ended) == 1 and isinstance(ended[0], SystemExit) and ended[0].code == 3


@pytest.mark.parametrize("concurrency", [1, 2])
def test_sync_calls_of_different_samples_run_side_by_side_and_a_samples_own_calls_in_order(concurrency):
    both_waiting = threading.Barrier(2, timeout=2)  # passes only when two calls wait at once
    order = []

    def meet(name: str) -> str:
        """Wait until the other sample's call waits too.

        Args:
            name: who arrives.
        """
        try:
            both_waiting.wait()
            return f"met {name}"
        except threading.BrokenBarrierError:
            return f"{name} waited alone"

    def note(step: int) -> int:
        """Note a step.

        Args:
            step: the step.
        """
        time.sleep((4 - step) * 0.05)  # run side by side, the later steps would be noted first
        order.append(step)
        return step

    turns = {"A": [call("meet", name="A"), "ok"], "B": [call("meet", name="B"), "ok"],
             "steps": [call("note", step=1) + call("note", step=2) + call("note", step=3), "ok"]}
    limits = ToolCallLimits(timeout=None if concurrency == 1 else 30, concurrency=concurrency)
    rollout = run_loop(hermes_tokenizer(), [meet, note], turns, [user(key) for key in turns], limits=limits)
    results = [conversation[1]["content"] for conversation in rollout.conversations]
    if concurrency == 2:
        assert results[:2] == ["met A", "met B"]
    else:  # one after another: each meets nobody (as before this setting existed)
        assert results[:2] == ["A waited alone", "B waited alone"]
    assert order == [1, 2, 3]  # a sample's own calls in the order it made them


def test_each_sample_is_the_template_rendering_of_its_conversation_and_only_the_models_turns_are_trained():
    tokenizer = hermes_tokenizer()
    turns = {"sum": [call("add", a=2, b=3), call("add", a=5, b=5), "ten"], "none": ["hello"]}
    prompts = [user("sum"), user("none")]
    rollout = run_loop(tokenizer, [add], turns, prompts)
    completions = rollout.completions
    for index, (prompt, conversation) in enumerate(zip(prompts, rollout.conversations)):
        length = int(completions.attention_mask[index].sum())
        ids = completions.ids[index, :length].tolist()
        mask = completions.loss_mask[index, :length].bool().tolist()
        # The whole sequence is what the chat template writes for the conversation (from an independent rendering).
        whole = tokenizer.apply_chat_template(prompt + conversation, tools=[add], tokenize=False)
        prompt_text = tokenizer.apply_chat_template(prompt, tools=[add], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == whole[len(prompt_text) :]
        # The loss mask holds exactly the model's turns, each closed by its EOS.
        written = [token for token, on in zip(ids, mask) if on]
        expected = "".join(turn + "<eos>" for turn in turns[prompt[0]["content"]])
        assert tokenizer.decode(written, skip_special_tokens=False) == expected
    assert rollout.turns == [3, 1] and rollout.tool_calls == [2, 0]


def test_the_turn_limit_and_the_length_limit_truncate_a_sample():
    tokenizer = hermes_tokenizer()
    forever = [call("add", a=1, b=1)] * 10
    turns = {"loop": forever, "long": ["x" * 400], "fits": [call("add", a=1, b=2), "3"]}
    rollout = run_loop(tokenizer, [add], turns, [user("loop"), user("long"), user("fits")], max_completion_length=300,
                       max_iterations=2)
    # Two rounds of calls answered, the third turn still calls: cut there, its call not run.
    assert rollout.tool_calls[0] == 2 and rollout.turns[0] == 3
    assert rollout.conversations[0][-1]["tool_calls"] and rollout.conversations[0][-2]["role"] == "tool"
    assert rollout.completions.lengths[1] == 300  # the limit cut the turn mid-way
    assert rollout.completions.truncated.tolist() == [True, True, False]


def test_a_tool_result_too_long_for_the_room_left_ends_its_sample_without_it():
    def shout(text: str) -> str:
        """Repeat the text many times.

        Args:
            text: what to repeat.
        """
        return text * 500

    turns = {"loud": [call("shout", text="a"), "never"], "quiet": [call("add", a=1, b=2), "3"]}
    prompts = [user("loud"), user("quiet")]
    rollout = run_loop(hermes_tokenizer(), [add, shout], turns, prompts, max_completion_length=300)
    loud, quiet = rollout.conversations
    assert [message["role"] for message in loud] == ["assistant"] and loud[0]["tool_calls"]  # the result is left out
    assert [message["role"] for message in quiet] == ["assistant", "tool", "assistant"]
    assert rollout.completions.truncated.tolist() == [True, False]
    assert rollout.completions.lengths[0] == len(hermes_tokenizer()(call("shout", text="a"))["input_ids"]) + 1
    assert rollout.tool_calls == [1, 1] and rollout.turns == [1, 2]


def test_later_turns_are_generated_within_the_room_left():
    tokenizer = hermes_tokenizer()
    template = ConversationTemplate(tokenizer, Toolbox([add]).schemas, [tokenizer.eos_token_id])
    loop = ToolLoop(template, 100, None, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    first = call("add", a=1, b=1)
    backend = ScriptedPolicy(tokenizer, lambda context: first if context.count("<assistant>") == 1 else "2")
    encoded = tokenizer([template.render(user("q"), True)], add_special_tokens=False, return_tensors="pt")
    rollout = loop.run(backend, encoded["input_ids"], encoded["attention_mask"], [Toolbox([add])])
    first_turn = len(tokenizer(first)["input_ids"]) + 1
    tool_turn = len(template.tool_turn_ids([{"role": "tool", "name": "add", "content": "2"}]))
    assert backend.limits == [100, 100 - first_turn - tool_turn]
    assert rollout.completions.lengths.item() == first_turn + tool_turn + 2


def test_no_turn_is_generated_past_the_models_positions_and_a_turn_cut_by_them_goes_on():
    """Left-padded together, every row's positions run on for the turn's whole budget. A sample whose prompt fills
    the positions that max_completion_length leaves, and whose first turn was the longer one, has less room left
    than the other sample: the budget is lowered to its room and the other sample's long answer is written in two
    calls, read as one turn."""
    tokenizer = hermes_tokenizer()
    template = ConversationTemplate(tokenizer, Toolbox([add]).schemas, [tokenizer.eos_token_id])
    answer = "The tool says that one and one make two, so the answer is 2."
    script = {"full": [call("add", a=10**20, b=10**20), "ok"], "q": [call("add", a=1, b=1), answer]}

    def policy(context):  # the rest of the turn under way (a call cut by the positions wrote its start)
        prompt = next(key for key in script if f"<user>{key}" in context)
        turn = script[prompt][context.count("<assistant>") - 1]
        written = context.rsplit("<assistant>", 1)[1]
        assert turn.startswith(written)
        return turn[len(written) :]

    class PositionsRecorded(ScriptedPolicy):
        pads_rows_together = True  # as model.generate: each row's positions run on for the call's whole budget

        def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
            self.reaches.append(int(prompt_mask.sum(dim=1).max()) + max_new_tokens)
            return super().generate(prompt_ids, prompt_mask, max_new_tokens)

    max_completion_length = 160
    rendered = [template.render(user("full" * 20), True), template.render(user("q"), True)]
    script[rendered[0].split("<user>")[1].split("<")[0]] = script.pop("full")
    encoded = tokenizer(rendered, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    positions = int(encoded["attention_mask"].sum(dim=1).max()) + max_completion_length  # the first prompt fills them
    rollouts, reaches, budgets = {}, {}, {}
    for limit in (positions, None):
        backend = PositionsRecorded(tokenizer, policy)
        backend.reaches = []
        loop = ToolLoop(template, max_completion_length, None, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                        max_positions=limit)  # fmt: skip
        rollouts[limit] = loop.run(backend, encoded["input_ids"], encoded["attention_mask"], [Toolbox([add])] * 2)
        reaches[limit], budgets[limit] = backend.reaches, backend.limits
    assert max(reaches[None]) > positions  # unbounded, the second turn would pass the model's positions
    assert max(reaches[positions]) <= positions and len(reaches[positions]) == 3  # the answer's end: a third call
    # A backend that sends each row alone (vLLM) is not capped: every turn stays one request.
    alone = ScriptedPolicy(tokenizer, policy)
    loop = ToolLoop(template, max_completion_length, None, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                    max_positions=positions)  # fmt: skip
    loop.run(alone, encoded["input_ids"], encoded["attention_mask"], [Toolbox([add])] * 2)
    assert alone.limits == budgets[None] and len(alone.limits) == 2
    for rollout in rollouts.values():  # the same conversations either way, each turn read once
        assert rollout.turns == [2, 2] and rollout.completions.truncated.tolist() == [False, False]
        assert rollout.conversations[1][-1] == {"role": "assistant", "content": answer}
        assert [message["role"] for message in rollout.conversations[0]] == ["assistant", "tool", "assistant"]
    bounded, unbounded = rollouts[positions].completions, rollouts[None].completions
    assert torch.equal(bounded.ids, unbounded.ids) and torch.equal(bounded.loss_mask, unbounded.loss_mask)


def test_a_multi_turn_rollout_opens_the_policy_for_generation_once_for_all_its_turns():
    """Sharded weights are gathered for generation once per rollout, not once per turn."""
    tokenizer = guessing_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    opened = []

    @contextlib.contextmanager
    def generation_model():
        opened.append(True)
        yield model

    settings = SamplingSettings(
        max_new_tokens=100, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
        generation_kwargs=digits_only_generation_kwargs(tokenizer),
    )
    backend = TransformersBackend(settings, generation_model)
    game = GuessingGame()
    template = ConversationTemplate(tokenizer, Toolbox(environment_tools(game)).schemas, [tokenizer.eos_token_id])
    loop = ToolLoop(template, 100, 3, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    encoded = tokenizer([template.render(user("?"), True)] * 8, add_special_tokens=False, return_tensors="pt")
    games = [GuessingGame() for _ in range(8)]
    for secret, each in enumerate(games):
        each.reset(secret)
    torch.manual_seed(0)
    try:
        rollout = loop.run(
            backend, encoded["input_ids"], encoded["attention_mask"], [Toolbox(environment_tools(g)) for g in games]
        )
    finally:
        loop.close()
    assert max(rollout.turns) > 1  # the untrained model writes digits, each a call of `guess`: several turns
    assert len(opened) == 1
    backend.generate(encoded["input_ids"], encoded["attention_mask"])  # a single call outside a session opens it
    assert len(opened) == 2


def test_a_colocated_engine_with_sleep_mode_stays_awake_for_all_the_turns_of_a_rollout():
    """vLLM's sleep mode needs a GPU: a recorder stands in for the engine, and the backend's own code runs."""
    from targetpo.generation.vllm_backend import VLLMColocateBackend

    class RecordingEngine:
        def __init__(self):
            self.calls = []

        def wake_up(self):
            self.calls.append("wake")

        def sleep(self):
            self.calls.append("sleep")

        def generate(self, prompts, fields, seeds):
            self.calls.append("generate")
            return [[5, 2]] * len(prompts), [[-0.5, -0.1]] * len(prompts)

    backend = VLLMColocateBackend.__new__(VLLMColocateBackend)  # no engine to build: the recorder is set below
    backend.settings = SamplingSettings(max_new_tokens=4, eos_token_ids=(2,), pad_token_id=0)
    backend.fields, backend.engine, backend._awake = {}, RecordingEngine(), False
    ids, mask = torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.long)
    with backend.session():
        for _ in range(3):
            backend.generate(ids, mask, max_new_tokens=2)
    assert backend.engine.calls == ["wake", "generate", "generate", "generate", "sleep"]
    backend.generate(ids, mask)
    assert backend.engine.calls[5:] == ["wake", "generate", "sleep"]


#: Qwen's chat format, with Qwen 3.5's XML tool calls, on the character tokenizer.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_calls_are_read_with_the_tokenizers_template_then_transformers_one_for_the_model_then_hermes_markup():
    pytest.importorskip("transformers.cli.serving.utils", reason="transformers' per-model response templates")
    hermes = hermes_tokenizer()
    schemas = Toolbox([add]).schemas
    # Hermes markup, anchored at this template's own assistant header, also for a Qwen model with this template.
    for model_type in (None, "qwen2"):
        assert response_template(hermes, model_type) == {"start_anchor": "<assistant>", "fields": HERMES_FIELDS}
    # Qwen's format on a Qwen 3.5 model: transformers' template for it reads the XML calls.
    qwen = build_char_tokenizer(PRINTABLE, chat_template=QWEN_TEMPLATE)
    qwen.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})  # its end of turn, a stop token below
    turn = qwen.apply_chat_template(
        user("q") + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "add", "arguments": {"a": 2, "b": 3}}}]}], tokenize=False
    ).split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    read = {}
    for model_type in (None, "qwen3_5"):
        template = ConversationTemplate(qwen, schemas, qwen.convert_tokens_to_ids(["<|im_end|>"]), model_type=model_type)
        read[model_type] = template.parse(turn, template.render(user("q"), add_generation_prompt=True))
    message, problem = read["qwen3_5"]
    assert problem is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    # Without the model type only the Hermes JSON markup is known: the XML call is an error the model is shown.
    message, problem = read[None]
    assert "tool_calls" not in message and problem.startswith("Error: the tool call could not be read")
    # A tokenizer's own template comes first.
    qwen.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {"content": {}}}
    assert response_template(qwen, "qwen3_5") is qwen.response_template


def test_a_transformers_without_per_model_response_templates_is_named_and_hermes_markup_is_read(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers.cli.serving.utils", None)  # as in a release without the module
    with pytest.warns(UserWarning, match="per-model response templates cannot be imported .* this qwen3_5 model"):
        assert response_template(hermes_tokenizer(), "qwen3_5") == {"start_anchor": "<assistant>",
                                                                     "fields": HERMES_FIELDS}


def test_an_environments_properties_are_state_not_tools_and_are_not_read_to_find_its_tools():
    class Counter:
        def reset(self, **row):
            self.count = 0

        @property
        def total(self) -> int:
            return self.count  # no such attribute before reset()

        @functools.cached_property
        def label(self) -> str:
            return str(self.count)

        def bump(self, by: int) -> int:
            """Add to the count.

            Args:
                by: how much.
            """
            self.count += by
            return self.count

    probe = Counter()  # the trainer reads the tools from an instance before any reset()
    assert [tool.__name__ for tool in environment_tools(probe)] == ["bump"]

    class Slotted(Counter):
        __slots__ = ("steps",)  # a slot, unset before reset()

    assert [tool.__name__ for tool in environment_tools(Slotted())] == ["bump"]


def guessing_trainer(
    tmp_path, backend_policy=None, reward_funcs=None, environment_factory=GuessingGame, dataset=None, **overrides
):
    tokenizer = guessing_tokenizer()
    settings = dict(
        max_completion_length=20, max_tool_calling_iterations=3, generation_kwargs=digits_only_generation_kwargs(tokenizer),
        per_device_train_batch_size=16, num_generations=4, max_steps=2, learning_rate=1e-3,
    )
    settings.update(overrides)
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
        reward_funcs,
        args=make_config(tmp_path, **settings),
        train_dataset=dataset if dataset is not None else guessing_dataset(num_prompts=64, seed=0),
        processing_class=tokenizer,
        environment_factory=environment_factory,
    )
    if backend_policy is not None:
        trainer.rollout_backend = ScriptedPolicy(tokenizer, backend_policy)
    return trainer


def test_environments_keep_state_per_sample_score_themselves_and_reach_reward_functions(tmp_path):
    seen = []

    def turns_used(completions, environments, secret, **kwargs):
        seen.append((copy.deepcopy(completions), environments, secret))
        return [float(sum(message["role"] == "tool" for message in conversation)) for conversation in completions]

    trainer = guessing_trainer(tmp_path, halving_search, reward_funcs=[turns_used], max_steps=1, log_completions=True)
    assert trainer._rollout_context.tool_loop.max_positions == 128  # the model's: no turn is generated past them
    trainer.train()
    conversations, environments, secrets = seen[0]
    assert len(environments) == len(conversations) == 16
    for conversation, environment, secret in zip(conversations, environments, secrets):
        assert environment.secret == secret  # reset(**row) got the row's columns
        answers = [message["content"] for message in conversation if message["role"] == "tool"]
        guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in conversation if m.get("tool_calls")]
        # Each answer is the game's verdict on that guess for this sample's own secret.
        for guess, answer in zip(guesses, answers):
            assert answer == ("=" if guess == secret else "+" if secret > guess else "-")
        assert environment.found == (secret != 0)  # halving finds every digit but 0 within three guesses
    logs = trainer.state.log_history[0]
    calls = [sum(message["role"] == "tool" for message in conversation) for conversation in conversations]
    assert logs["tools/call_frequency"] == pytest.approx(sum(calls) / len(calls))
    assert logs["tools/failure_frequency"] == 0
    assert logs["rewards/GuessingGame/mean"] == pytest.approx(sum(e.found for e in environments) / 16)
    assert logs["rewards/turns_used/mean"] == pytest.approx(sum(calls) / len(calls))
    # Lengths count the model's tokens alone: each turn is its guess (one digit) or nothing, then EOS.
    written = [sum(1 + len(m.get("tool_calls", [])) for m in c if m["role"] == "assistant") for c in conversations]
    assert logs["completions/mean_length"] == pytest.approx(sum(written) / len(written))
    assert logs["completions/max_length"] == max(written)
    table = trainer._completions.table
    assert any("tool guess: =" in text for text in table.completions)  # the table shows the conversation


def test_tool_call_timeout_reaches_the_environments_tools_and_counts_as_a_failed_call(tmp_path):
    release, seen = threading.Event(), []

    class StuckOnFour(GuessingGame):
        def guess(self, number: int) -> str:
            """Guess the hidden digit; a guess of 4 never answers in time.

            Args:
                number: the guess, a digit from 0 to 7.
            """
            if number == 4:
                release.wait(timeout=30)
            return super().guess(number)

    def record(completions, **kwargs):
        seen.append(completions)
        return [0.0] * len(completions)

    trainer = guessing_trainer(tmp_path, halving_search, reward_funcs=[record], environment_factory=StuckOnFour,
                               max_steps=1, tool_call_timeout=0.3, max_completion_length=100)
    try:
        trainer.train()
    finally:
        release.set()
    answers = [[m["content"] for m in conversation if m["role"] == "tool"] for conversation in seen[0]]
    assert all(turn[0] == "Error: guess did not finish within 0.3 s (tool_call_timeout); it was given up." for turn in answers)
    failed = sum(answer.startswith("Error") for turn in answers for answer in turn)
    calls = sum(len(turn) for turn in answers)
    assert trainer.state.log_history[0]["tools/failure_frequency"] == pytest.approx(failed / calls)


def test_the_lock_opens_only_for_the_prompts_bits_pressed_in_reverse_one_call_each(tmp_path):
    lock = Lock()
    for pressed, opened in (("1011", True), ("1101", False), ("101", False), ("10110", False)):
        lock.reset(code="1011")
        assert [lock.press(int(key)) for key in pressed] == ["."] * len(pressed)  # no press tells anything
        assert lock.get_reward() == float(opened)
    with pytest.raises(ValueError, match="press 0 or 1"):
        lock.press(2)
    dataset = lock_dataset(4, num_prompts=4, seed=1)  # one rollout: all four prompts, each 4 times
    assert all(row["code"] == row["prompt"][0]["content"][::-1] for row in dataset)

    def policy(reverse):
        """Press the prompt's bits (reversed, or as shown) one turn each, then stop."""

        def turn(context):
            shown = context.split("<user>")[1][:4]
            pressed = context.count("<tool>")
            return (shown[::-1] if reverse else shown)[pressed] if pressed < 4 else ""

        return turn

    tokenizer = lock_tokenizer()
    for reverse in (True, False):
        trainer = TargetPOTrainer(
            build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
            None,
            args=make_config(tmp_path / str(reverse), max_completion_length=30, max_tool_calling_iterations=4,
                             per_device_train_batch_size=16, num_generations=4, max_steps=1,
                             generation_kwargs=digits_only_generation_kwargs(tokenizer, "01")),
            train_dataset=dataset,
            processing_class=tokenizer,
            environment_factory=Lock,
        )
        trainer.rollout_backend = ScriptedPolicy(tokenizer, policy(reverse))
        trainer.train()
        logs = trainer.state.log_history[0]
        palindromes = sum(row["code"] == row["code"][::-1] for row in dataset) / 4
        assert 0 < palindromes < 1, "the dataset must hold both kinds for the second run to mean anything"
        assert logs["rewards/Lock/mean"] == (1.0 if reverse else palindromes)
        assert logs["tools/call_frequency"] == 4 and logs["tools/failure_frequency"] == 0


def test_environments_are_built_once_and_reset_for_every_rollout_and_an_async_get_reward_is_awaited(tmp_path):
    built, seen = [], []

    class AsyncScoredGame(GuessingGame):
        def __init__(self):
            built.append(self)

        async def get_reward(self):
            await asyncio.sleep(0)
            return 2.0 if self.found else -1.0

    def record(completions, environments, secret, **kwargs):
        seen.append(([id(environment) for environment in environments], [e.secret for e in environments], secret))
        return [0.0] * len(completions)

    trainer = guessing_trainer(tmp_path, halving_search, reward_funcs=[record], environment_factory=AsyncScoredGame)
    trainer.train()
    assert len(built) == 16  # the probe and 15 more, for the 16 samples of a rollout: none built for the second
    (first_ids, first_secrets, first_rows), (second_ids, second_secrets, second_rows) = seen
    assert first_ids == second_ids == [id(environment) for environment in built]
    assert first_secrets == first_rows and second_secrets == second_rows  # each reset with its new row
    assert first_rows != second_rows
    for log, rows in zip(trainer.state.log_history, (first_rows, second_rows)):
        # The awaited rewards: halving finds every secret but 0 within three guesses.
        expected = sum(2.0 if secret != 0 else -1.0 for secret in rows) / 16
        assert log["rewards/AsyncScoredGame/mean"] == pytest.approx(expected)


def test_reset_text_is_added_to_the_prompt_and_games_cut_by_the_turn_limit_are_masked_when_asked(tmp_path):
    class Announced(GuessingGame):
        def reset(self, secret, **row):
            super().reset(secret)
            return "!"

    contexts, secrets, batches = [], [], []

    def record_secrets(completions, secret, **kwargs):
        secrets.extend(secret)
        return [0.0] * len(completions)

    trainer = guessing_trainer(
        tmp_path, lambda context: contexts.append(context) or halving_search(context), reward_funcs=[record_secrets],
        max_steps=1, mask_truncated_completions=True, environment_factory=Announced,
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "?"}]] * 8, "secret": [0, 3] * 4}),
    )
    original = trainer._rollout
    trainer._rollout = lambda rows, mode: batches.append(original(rows, mode)) or batches[-1]
    trainer.train()
    assert all(context.startswith("<tools>guess<user>?!<assistant>") for context in contexts)
    cut = torch.tensor(secrets) == 0  # halving needs a fourth guess for 0: cut at the limit, truncated
    assert cut.any() and not cut.all()
    assert torch.equal(~batches[0]["valid"].cpu(), cut)
    assert (batches[0]["completion_mask"][cut] == 0).all()


class UnscoredGame(GuessingGame):
    """The game without its own reward: the recorded reward function is the only score."""

    get_reward = None


def conversation_score(conversations):
    """A dense score of a whole conversation: its guesses (out-of-range ones count 9) and how many messages it took."""
    return [
        float(sum(min(call["function"]["arguments"]["number"], 9) for m in c for call in m.get("tool_calls", [])) + len(c))
        for c in conversations
    ]


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(steps_per_generation=2, max_steps=4)],
    ids=["one-step-per-rollout", "rollout-serves-two-steps"],
)
def test_each_sgd_step_on_sampled_multi_turn_games_is_the_hand_built_gradient_over_the_models_tokens(
    tmp_path, monkeypatch, settings
):
    from test_trainer_values import assert_step_matches, reference_step, train_and_record

    tokenizer = guessing_tokenizer()
    settings = {
        "max_steps": 2, "max_completion_length": 20, "max_tool_calling_iterations": 3, "per_device_train_batch_size": 16,
        "num_generations": 4, "generation_kwargs": digits_only_generation_kwargs(tokenizer), **settings,
    }
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, dataset=guessing_dataset(num_prompts=64, seed=0), score=conversation_score,
        trainer_kwargs={"environment_factory": UnscoredGame}, **settings,
    )
    masks = torch.cat([tensors["completion_mask"] for _, tensors in run.rollouts])
    attention = torch.cat([tensors["completion_attention_mask"] for _, tensors in run.rollouts])
    assert ((attention == 1) & (masks == 0)).any(), "some tool-written tokens must be in the samples to test"
    for step in range(run.trainer.state.global_step):
        assert_step_matches(run, step, reference_step(run, step))


@pytest.mark.parametrize("collective", [False, True], ids=["local-backend", "collective-backend"])
def test_two_processes_play_their_own_number_of_turns_and_log_the_metrics_of_every_sample(tmp_path, collective):
    """Process 0's samples end after one turn, process 1's after three or four. A backend whose generation is
    collective must be called as often on every process (process 0 keeps stepping); any other generates alone."""
    mp.spawn(two_process_game_worker, args=(2, free_port(), str(tmp_path), collective), nprocs=2, join=True)
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    turns = [[sum(m["role"] == "assistant" for m in c) for c in rank["conversations"]] for rank in (first, second)]
    calls = [[sum(m["role"] == "tool" for m in c) for c in rank["conversations"]] for rank in (first, second)]
    assert turns[0] == [1] * 8 and calls[0] == [0] * 8
    assert set(turns[1]) <= {3, 4} and calls[1] == [turn - 1 for turn in turns[1]]
    assert second["generate_calls"] == max(turns[1])
    assert first["generate_calls"] == (max(turns[1]) if collective else 1)
    for rank in (first, second):  # every process logs the metrics of all 16 samples
        log = next(entry for entry in rank["log"] if "tools/call_frequency" in entry)
        assert log["tools/call_frequency"] == pytest.approx(sum(calls[1]) / 16)
        assert log["multi_turn/turns_per_sample"] == pytest.approx((8 + sum(turns[1])) / 16)
        assert log["tools/failure_frequency"] == 0


@pytest.mark.parametrize(
    "problem, message",
    [
        (dict(tools=[add], string_prompts=True), "conversational train dataset"),
        (dict(tools=[add], rollout_func=lambda prompts, trainer: {}), "rollout_func replaces"),
        (dict(tools=[lambda x: x]), "cannot be described to the model"),
        (dict(environment_factory=lambda: object()), "has no reset() method"),
        (dict(environment_factory={}), "environment_factory is an empty dict"),
        (dict(tools=[add], plain_template=True), "no `response_template`"),
    ],
)
def test_impossible_multi_turn_setups_are_refused_before_any_work(tmp_path, problem, message):
    tokenizer = hermes_tokenizer()
    problem = dict(problem)
    if problem.pop("plain_template", False):
        tokenizer.chat_template = HERMES_TEMPLATE.replace("<tool_call>", "[").replace("</tool_call>", "]")
    prompts = ["q1", "q2"] if problem.pop("string_prompts", False) else [user("q1"), user("q2")]
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        args = make_config(tmp_path)
        TargetPOTrainer(
            build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128),
            lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
            processing_class=tokenizer,
            **problem,
        )


# ------------------------------------------------------------------------------------------------ rollout_func
def scripted_rollout(tokenizer, trailing="xy", trailing_trained=False):
    """A rollout_func writing, per sample, "a"s and "b"s (varying within each group), an EOS, a tool result "=",
    one more model token, an EOS, then a trailing tool result; a note per sample is an extra field."""

    def rollout_func(prompts, trainer):
        prompt_ids, completion_ids, masks, notes = [], [], [], []
        for index, prompt in enumerate(prompts):
            model_part = tokenizer("a" * (index % 3 + 1) + "b" * (index % 2), add_special_tokens=False)["input_ids"]
            tool = tokenizer("=", add_special_tokens=False)["input_ids"]
            tail = tokenizer(trailing, add_special_tokens=False)["input_ids"]
            eos = [tokenizer.eos_token_id]
            ids = model_part + eos + tool + tokenizer("c", add_special_tokens=False)["input_ids"] + eos + tail
            mask = [1] * (len(model_part) + 1) + [0] * len(tool) + [1, 1] + [int(trailing_trained)] * len(tail)
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(ids)
            masks.append(mask)
            notes.append(f"sample {index}")
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": masks, "note": notes}

    return rollout_func


def ab_score(completions):
    return [float(text.count("a") + 2 * text.count("b")) for text in completions]


def test_rollout_func_samples_train_exactly_on_their_loss_mask_and_tool_tokens_after_it_change_no_gradient(
    tmp_path, tokenizer, monkeypatch
):
    from test_trainer_values import assert_step_matches, reference_step, train_and_record

    def run(name, **options):
        return train_and_record(
            tmp_path / name, tokenizer, monkeypatch, max_steps=1, score=ab_score,
            trainer_kwargs={"rollout_func": scripted_rollout(tokenizer, **options)},
        )

    plain, other_tail, tail_trained = run("plain"), run("other", trailing="zw"), run("trained", trailing_trained=True)
    mask = plain.rollouts[0][1]["completion_mask"]
    assert (mask.sum(1) < plain.rollouts[0][1]["completion_attention_mask"].sum(1)).all()
    assert_step_matches(plain, 0, reference_step(plain, 0))
    # Other tool-written tokens at the end: the same step, to the last bit.
    for name, param in plain.step_weights[1].named_parameters():
        assert torch.equal(param, dict(other_tail.step_weights[1].named_parameters())[name]), name
    # The same tokens in the loss: a different step (the check above can fail).
    assert any(
        not torch.equal(param, dict(tail_trained.step_weights[1].named_parameters())[name])
        for name, param in plain.step_weights[1].named_parameters()
    )


def test_rollout_func_extra_fields_reach_reward_functions_and_a_missing_eos_is_truncation(tmp_path, tokenizer):
    seen = {}

    def reward(completions, note, **kwargs):
        seen["note"] = note
        return [0.0] * len(completions)

    def rollout_func(prompts, trainer):
        result = scripted_rollout(tokenizer, trailing="")(prompts, trainer)
        result["completion_ids"][0] = result["completion_ids"][0][:2]  # "a" and EOS: ended
        result["env_mask"][0] = [1, 1]
        result["completion_ids"][1] = result["completion_ids"][1][:1]  # "a" without EOS: truncated
        result["env_mask"][1] = [1]
        return result

    batches = []
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128), reward,
        args=make_config(tmp_path, max_steps=1, mask_truncated_completions=True),
        train_dataset=Dataset.from_dict({"prompt": ["p1", "p2", "p3", "p4"]}), processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    original = trainer._rollout
    trainer._rollout = lambda rows, mode: batches.append(original(rows, mode)) or batches[-1]
    trainer.train()
    assert seen["note"] == [f"sample {index}" for index in range(8)]
    assert batches[0]["valid"].tolist() == [True, False] + [True] * 6


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("completion_ids"), "lacks \\['completion_ids'\\]"),
        (lambda r: r["prompt_ids"].pop(), "'prompt_ids' has 7 entries for 8 prompts"),
        (lambda r: r["env_mask"][3].append(1), "'env_mask' for sample 3 must have one entry per completion token"),
        (lambda r: r["env_mask"][2].__setitem__(0, 2), "'env_mask' for sample 2 must hold only 0 and 1"),
        (lambda r: r["completion_ids"][5].__setitem__(0, 10**6), "'completion_ids' for sample 5 holds ids outside"),
        (lambda r: r.update(logprobs=[[0.5] * len(ids) for ids in r["completion_ids"]]), "finite log-probabilities"),
        (lambda r: r.update(loss_mask=r["env_mask"]), "both 'env_mask' and 'loss_mask'"),
        (lambda r: r.update(completions=["x"] * 8), "extra field\\(s\\) \\['completions'\\]"),
        (
            lambda r: (r["completion_ids"][4].extend([5] * 200), r["env_mask"][4].extend([1] * 200)),
            "sample 4 has .* more than the model's 128 positions",
        ),
    ],
)
def test_a_bad_rollout_func_result_is_a_clear_error(tmp_path, tokenizer, change, message):
    def rollout_func(prompts, trainer):
        result = scripted_rollout(tokenizer)(prompts, trainer)
        change(result)
        return result

    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128), ab_score,
        args=make_config(tmp_path, max_steps=1), train_dataset=Dataset.from_dict({"prompt": ["p1", "p2", "p3", "p4"]}),
        processing_class=tokenizer, rollout_func=rollout_func,
    )
    with pytest.raises(ValueError, match=message):
        trainer.train()
