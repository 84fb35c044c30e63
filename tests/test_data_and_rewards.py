"""Datasets, the repeat sampler, reward scoring and validation."""

import math
import re

import numpy as np
import pytest
import torch
from conftest import count_letters_reward, make_config
from datasets import Dataset, IterableDataset
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForSequenceClassification

from targetpo import TargetPOTrainer
from targetpo.data import (
    ROLLOUT_USE,
    RepeatSampler,
    RolloutRows,
    is_conversational,
    render_prompts,
    validate_prompt_dataset,
)
from targetpo.demo import build_tiny_causal_lm
from targetpo.modeling.loading import load_tokenizer
from targetpo.rewards import RewardScorer, check_reward_output, unique_reward_names


# ------------------------------------------------------------------------------------------------ sampler
def test_repeat_sampler_order_without_shuffle():
    sampler = RepeatSampler(4, num_generations=2, prompts_per_rollout=2, repeat_count=2, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert len(sampler) == 16


def test_repeat_sampler_shuffles_whole_groups_reproducibly():
    sampler = RepeatSampler(10, num_generations=3, prompts_per_rollout=3, repeat_count=2, seed=7)
    order = list(sampler)
    assert len(order) == len(sampler) == 3 * 3 * 3 * 2  # the 10th prompt does not fill a rollout
    rollouts = [order[i : i + 18] for i in range(0, len(order), 18)]
    for rollout in rollouts:
        assert rollout[:9] == rollout[9:]  # each rollout is repeated
        assert all(rollout[i] == rollout[i + 1] == rollout[i + 2] for i in range(0, 9, 3))  # contiguous groups
    assert order == list(RepeatSampler(10, 3, 3, 2, seed=7))
    sampler.set_epoch(1)
    assert list(sampler) != order


def test_repeat_sampler_refuses_a_rollout_larger_than_the_dataset():
    with pytest.raises(ValueError, match="one rollout needs 5"):
        RepeatSampler(4, num_generations=2, prompts_per_rollout=5)


# ------------------------------------------------------------------------------------------------ datasets
def test_dataset_checks(tokenizer):
    validate_prompt_dataset(Dataset.from_dict({"prompt": ["a"]}), "train", tokenizer)
    with pytest.raises(ValueError, match="no 'prompt' column"):
        validate_prompt_dataset(Dataset.from_dict({"text": ["a"]}), "train", tokenizer)
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_dataset(Dataset.from_dict({"prompt": []}), "eval", tokenizer)
    with pytest.raises(ValueError, match="row 0 has type int"):
        validate_prompt_dataset(Dataset.from_dict({"prompt": [3]}), "train", tokenizer)
    validate_prompt_dataset(IterableDataset.from_generator(lambda: iter([{"prompt": "a"}])), "train", tokenizer)
    with pytest.raises(ValueError, match=r"train dataset's prompt in row 0 is empty"):  # a stream's first row
        validate_prompt_dataset(IterableDataset.from_generator(lambda: iter([{"prompt": ""}])), "train", tokenizer)
    with pytest.raises(ValueError, match="must be a map-style dataset .* or a stream"):
        validate_prompt_dataset(object(), "train", tokenizer)


def chat(content):
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    "first, bad, message",
    [
        ("ok", None, "row 5 is None.*filter"),
        ("ok", 3, "row 5 has type int"),
        ("ok", {"role": "user", "content": "Hi"}, "row 5 has type dict"),
        ("ok", "", "row 5 is empty.*filter"),
        ("ok", " \n", "row 5 is only whitespace"),
        ("ok", ["Hi", "there"], "row 5 has message 0 without a string 'role'"),
        (chat("ok"), [], "row 5 is an empty list of messages"),
        (chat("ok"), [{"role": "user"}], "row 5 has message 0 without a string 'role' and a 'content'"),
        (chat("ok"), chat("ok") + [{"content": "Hi"}], "row 5 has message 1 without"),
        (chat("ok"), chat(3), "row 5 has message 0 whose content is int"),
        (chat("ok"), chat(None), "row 5 has message 0 whose content is NoneType"),
        ("ok", chat("Hi"), "mixes prompt formats: row 0 is a string but row 5 is a list of chat messages"),
        (chat("ok"), "Hi", "mixes prompt formats: row 0 is a list of chat messages but row 5 is a string"),
    ],
)
def test_every_row_prompt_is_checked(tokenizer, first, bad, message):
    rows = [{"prompt": first}] * 5 + [{"prompt": bad}] + [{"prompt": first}] * 3  # any map-style dataset
    with pytest.raises(ValueError, match=f"The eval dataset's .*{message}|The eval dataset {message}"):
        validate_prompt_dataset(rows, "eval", tokenizer)


def test_every_row_of_a_datasets_dataset_is_checked(tokenizer):
    for bad, message in [(None, "is None"), ("", "is empty"), ("  ", "is only whitespace")]:
        dataset = Dataset.from_dict({"prompt": ["ok"] * 1500 + [bad], "answer": ["a"] * 1501})
        with pytest.raises(ValueError, match=f"The train dataset's prompt in row 1500 {message}"):
            validate_prompt_dataset(dataset, "train", tokenizer)
        # Shuffled and selected rows are numbered as the trainer will read them.
        with pytest.raises(ValueError, match=f"row 3 {message}"):
            validate_prompt_dataset(dataset.select([0, 1, 2, 1500, 4]), "train", tokenizer)
    conversations = Dataset.from_dict({"prompt": [chat("ok")] * 3 + [chat(None)]})
    with pytest.raises(ValueError, match="row 3 has message 0 whose content is NoneType"):
        validate_prompt_dataset(conversations, "train", tokenizer)
    multimodal = [{"role": "user", "content": [{"type": "text", "text": "Describe"}]}]
    validate_prompt_dataset([{"prompt": multimodal}, {"prompt": chat("ok")}], "train", tokenizer)
    with pytest.raises(ValueError, match="row 1 has no 'prompt' \\(found \\['text'\\]\\)"):
        validate_prompt_dataset([{"prompt": "ok"}, {"text": "ok"}], "train", tokenizer)


def test_image_prompts_without_a_processor_are_refused_rather_than_trained_on_as_text(tokenizer):
    """Vision-language prompts in TRL's format (an image column, image content parts) need the model's processor:
    with a tokenizer alone, training would silently drop the images. Videos and audio are refused in any case."""
    with_image = [{"type": "image"}, {"type": "text", "text": "What is shown?"}]
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": with_image}]] * 2, "image": ["a.png", "b.png"]})
    with pytest.raises(ValueError, match=r"column\(s\) \['image'\]: prompts with images need the model's processor"):
        validate_prompt_dataset(rows, "train", tokenizer)
    with pytest.raises(ValueError, match=r"column\(s\) \['images'\].*remove_columns"):
        validate_prompt_dataset([{"prompt": "Describe", "images": ["a.png"]}], "train", tokenizer)
    validate_prompt_dataset(rows, "train", tokenizer, images_need=None)  # a processor's run takes them
    with pytest.raises(ValueError, match=r"\['video'\]: videos and audio are not supported"):
        validate_prompt_dataset([{"prompt": chat("ok"), "video": "a.mp4"}], "train", tokenizer, images_need=None)
    with pytest.raises(ValueError, match="has images but its prompts are plain strings"):
        validate_prompt_dataset([{"prompt": "Describe", "image": "a.png"}], "train", tokenizer, images_need=None)
    # Without the column, an image part in a message is refused by row.
    parts = [{"prompt": chat("ok")}, {"prompt": [{"role": "user", "content": with_image}]}]
    with pytest.raises(ValueError, match="row 1 has message 0 with a content part of type 'image'.*model's processor"):
        validate_prompt_dataset(parts, "train", tokenizer)


def test_prompts_are_read_a_batch_at_a_time_through_a_transform(tokenizer):
    """A `set_transform` that builds the prompt is honoured, and runs once per batch, not once per row."""
    calls = []

    def to_prompt(batch):
        calls.append(len(batch["question"]))
        return {"prompt": [question.strip() + "?" if question else question for question in batch["question"]]}

    dataset = Dataset.from_dict({"question": ["Why"] * 999 + [""]})
    dataset.set_transform(to_prompt)
    with pytest.raises(ValueError, match="row 999 is empty"):
        validate_prompt_dataset(dataset, "train", tokenizer)
    assert len(calls) <= 2  # row 0 (the column check), then one batch
    dataset = Dataset.from_dict({"prompt": ["ok", "ok"] * 5000})
    validate_prompt_dataset(dataset.with_format("numpy"), "train", tokenizer)


def test_rows_are_read_from_datasets_that_read_batches_as_rows_or_as_columns():
    """A dataset's ``__getitems__`` may give a list of rows (datasets.Dataset) or a batch of columns: both are read
    as rows, each tagged with its micro-step; a dataset without it is read row by row."""

    class Rows(torch.utils.data.Dataset):  # read one row at a time
        def __init__(self, prompts):
            self.prompts = prompts

        def __len__(self):
            return len(self.prompts)

        def __getitem__(self, index):
            return {"prompt": self.prompts[index]}

    class Columns(Rows):
        def __getitems__(self, indices):
            return {"prompt": [self.prompts[index] for index in indices], "id": list(indices)}

    prompts = ["a", "b", "c", "d"]
    keys = [(2, 0), (0, 0), (3, 1)]
    read = RolloutRows(Columns(prompts)).__getitems__(keys)
    assert [(row["prompt"], row["id"], row[ROLLOUT_USE]) for row in read] == [("c", 2, 0), ("a", 0, 0), ("d", 3, 1)]
    assert not hasattr(Rows(prompts), "__getitems__")
    rows = RolloutRows(Rows(prompts)).__getitems__(keys)
    assert [(row["prompt"], row[ROLLOUT_USE]) for row in rows] == [("c", 0), ("a", 0), ("d", 1)]
    listed = RolloutRows(Dataset.from_dict({"prompt": prompts})).__getitems__(keys)
    assert [row["prompt"] for row in listed] == ["c", "a", "d"]


def test_a_rollouts_later_uses_are_given_the_rows_its_first_use_read(tmp_path, tiny_model, tokenizer):
    """Only a rollout's first use makes the rollout from its rows: with two micro-steps and two iterations (four uses
    of each rollout), the dataset's rows are read (here: built by a transform, as an image would be decoded) once a
    rollout, and the later uses are given the same rows, tagged with their use."""
    built = []

    def to_prompt(batch):
        built.extend(batch["question"])
        return {"prompt": [question + ":" for question in batch["question"]]}

    questions = ["Say cat", "Say dog", "Say cow", "Say pig"]
    data = Dataset.from_dict({"question": questions})
    data.set_transform(to_prompt)
    served = []
    args = make_config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, num_iterations=2, max_steps=8)
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    original = trainer._prepare_inputs

    def recording(rows):
        served.append([(row["prompt"], row[ROLLOUT_USE]) for row in rows])
        return original(rows)

    trainer._prepare_inputs = recording
    built.clear()  # what the trainer read when it checked the dataset
    trainer.train()
    # One epoch: 2 rollouts of 2 prompts x 4 completions, each served to 4 micro-steps.
    assert len(served) == 8 and [batch[0][1] for batch in served] == [0, 1, 2, 3] * 2
    assert sorted(built) == sorted(questions * 4)  # 2 rollouts of 8 rows, each row read once
    for first, later in ((served[0], served[1:4]), (served[4], served[5:8])):
        assert all([prompt for prompt, _ in batch] == [prompt for prompt, _ in first] for batch in later)

    # Without a first use read by the same reader (a resumed run, a dataloader worker), a later use reads its rows.
    rows = RolloutRows(data)
    built.clear()
    assert [row["prompt"] for row in rows.__getitems__([(2, 1), (2, 1)])] == ["Say cow:"] * 2 and len(built) == 2
    rows.__getitems__([(0, 0), (1, 0)])
    assert [row["prompt"] for row in rows.__getitems__([(1, 2), (0, 2)])] == ["Say dog:", "Say cat:"]
    assert len(built) == 4  # the first use's two reads only


def test_render_prompts(tokenizer):
    conversation = [{"role": "user", "content": "Hi"}]
    assert is_conversational({"prompt": conversation}) and not is_conversational({"prompt": "Hi"})
    texts = render_prompts(["plain", conversation, conversation + [{"role": "assistant", "content": "Sure,"}]], tokenizer)
    assert texts[0] == "plain"
    assert texts[1] == "<user>Hi\n<assistant>"
    assert texts[2] == "<user>Hi\n<assistant>Sure,"  # a final assistant message is continued


# ------------------------------------------------------------------------------------------------ rewards
def test_scorer_passes_columns_and_state_and_weights_none():
    calls = {}

    def first(prompts, completions, completion_ids, label, trainer_state, **kwargs):
        calls.update(label=label, state=trainer_state, ids=completion_ids)
        return [1.0, None, 3]

    def second(completions, **kwargs):
        return np.array([0.5, 0.5, 0.5])  # numpy results are accepted too

    scorer = RewardScorer([first, second], reward_weights=[2.0, 1.0])
    scores = scorer.score(["p"] * 3, ["a", "b", "c"], [[1], [2], [3]], {"label": [7, 8, 9]}, "STATE", torch.device("cpu"))
    assert calls == {"label": [7, 8, 9], "state": "STATE", "ids": [[1], [2], [3]]}
    assert scores.shape == (3, 2) and math.isnan(scores[1, 0].item())
    assert scorer.names == ["first", "second"]
    assert torch.equal(scorer.weights, torch.tensor([2.0, 1.0]))


def test_reward_functions_of_one_name_are_numbered_in_order(tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    reward_model = Qwen2ForSequenceClassification(config)
    funcs = [lambda completions, **kwargs: [1.0] * len(completions), count_letters_reward, reward_model]
    funcs += [lambda completions, **kwargs: [2.0] * len(completions), reward_model]
    scorer = RewardScorer(funcs, reward_processing_classes=[None, None, tokenizer, None, tokenizer])
    assert scorer.names == [
        "<lambda>_1", "count_letters_reward", "Qwen2ForSequenceClassification_1", "<lambda>_2",
        "Qwen2ForSequenceClassification_2",
    ]
    # A function already named like a number keeps its name; the shared name skips it.
    assert unique_reward_names(["f", "f_1", "f"]) == ["f_2", "f_1", "f_3"]


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0], "returned 1 scores for 2 completions"),
        ("ab", "must return a list"),
        ([1.0, "x"], "returned 'x' \\(str\\) for completion 1"),
        ([1.0, float("inf")], "returned inf for completion 1"),
        ([1.0, [2.0]], "returned \\[2.0\\] \\(list\\)"),
    ],
)
def test_bad_outputs_name_the_function(output, message):
    with pytest.raises(ValueError, match=f"Reward function 'judge' {message}"):
        check_reward_output(output, "judge", 2)


def test_valid_outputs_convert_to_floats():
    assert check_reward_output([1, True, np.float32(0.5), torch.tensor(2.0)], "f", 4) == [1.0, 1.0, 0.5, 2.0]
    values = check_reward_output(torch.tensor([1.0, 2.0]), "f", 2)
    assert values == [1.0, 2.0]


def test_scorer_wraps_exceptions_with_the_name():
    def broken(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(ValueError, match="Reward function 'broken' raised KeyError"):
        RewardScorer(broken).score(["p"], ["c"], [[1]], {}, None, torch.device("cpu"))


def test_scorer_names_the_missing_column_before_calling_any_function():
    """Where the columns are known only at scoring (a rollout_func's extra fields), the check runs there."""
    called = []

    def first(completions, **kwargs):
        called.append("first")
        return [1.0] * len(completions)

    def needs_verdict(completions, verdict, *, strict, lenient=True, **kwargs):
        return [1.0] * len(completions)

    scorer = RewardScorer([first, needs_verdict])
    with pytest.raises(ValueError, match=re.escape(
        "Reward function 'needs_verdict' needs the argument(s) ['verdict', 'strict'], which the rollout (its columns: "
        "['label']) does not give."
    )):
        scorer.score(["p"], ["c"], [[1]], {"label": [0], "log_extra": None}, None, torch.device("cpu"))
    assert called == []  # refused before any work
    scores = scorer.score(["p"], ["c"], [[1]], {"verdict": [1], "strict": [True]}, None, torch.device("cpu"))
    assert scores.tolist() == [[1.0, 1.0]]


def test_scorer_refuses_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="at least one"):
        RewardScorer([])
    with pytest.raises(TypeError, match="callable, a PreTrainedModel or a model id"):
        RewardScorer([3])
    with pytest.raises(ValueError, match="reward_processing_classes` has 2 entries for 1"):
        RewardScorer(count_letters_reward, reward_processing_classes=[tokenizer, tokenizer])


def test_reward_model_scores_are_its_first_logit(tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    scorer = RewardScorer(model, reward_processing_classes=tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id  # needed to find each row's last token
    prompts, completions = ["Say a:", "Say b:"], ["a", "bbbb"]
    scores = scorer.score(prompts, completions, [[], []], {}, None, torch.device("cpu"))
    # Each text scored alone (no padding) must give the same value as the right-padded batch.
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        alone = model(**tokenizer(prompt + completion, return_tensors="pt")).logits[0, 0]
        assert scores[index, 0].item() == pytest.approx(alone.item(), abs=1e-5)


def test_reward_models_render_conversations_with_the_runs_chat_template_kwargs(tmp_path):
    from targetpo.demo import build_char_tokenizer

    template = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}{% if loud %}!!!{% endif %}"
    tokenizer = build_char_tokenizer(chat_template=template)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    prompts, completions = [[{"role": "user", "content": "Say a"}]], [[{"role": "assistant", "content": "a"}]]
    scores = {}
    for kwargs in ({"loud": True}, None):
        scorer = RewardScorer(model, reward_processing_classes=tokenizer, chat_template_kwargs=kwargs)
        scores[bool(kwargs)] = scorer.score(prompts, completions, [[]], {}, None, torch.device("cpu"))[0, 0].item()
    by_hand = {loud: model(**tokenizer(f"u:Say a;a:a;{'!!!' if loud else ''}", add_special_tokens=False,
                                       return_tensors="pt")).logits[0, 0].item() for loud in (True, False)}  # fmt: skip
    assert scores[True] == pytest.approx(by_hand[True], abs=1e-5)
    assert scores[False] == pytest.approx(by_hand[False], abs=1e-5) and by_hand[True] != pytest.approx(by_hand[False])
    # The trainer hands the run's chat_template_kwargs to its reward models.
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0), model,
        args=make_config(tmp_path, chat_template_kwargs={"loud": True}), processing_class=tokenizer,
        reward_processing_classes=tokenizer, train_dataset=Dataset.from_dict({"prompt": prompts * 2}),
    )  # fmt: skip
    assert trainer.reward_scorer.chat_template_kwargs == {"loud": True}


def test_reward_models_can_be_scored_after_the_functions(tokenizer):
    # With sharded weights a reward model's forward is a collective, which the trainer runs apart from the functions.
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1,
    )
    torch.manual_seed(0)
    scorer = RewardScorer([count_letters_reward, Qwen2ForSequenceClassification(config)], [None, tokenizer])
    prompts, completions, device = ["Say a:", "Say b:"], ["aa", "bbbb"], torch.device("cpu")
    together = scorer.score(prompts, completions, [[], []], {}, None, device)
    functions_only = scorer.score(prompts, completions, [[], []], {}, None, device, models=False)
    assert functions_only[:, 0].tolist() == [2.0, 0.0] and torch.isnan(functions_only[:, 1]).all()
    assert torch.equal(scorer.score_models(functions_only, prompts, completions, device), together)


def test_reward_model_built_from_config_needs_its_tokenizer(tokenizer):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1)
    with pytest.raises(ValueError, match="reward_processing_classes"):
        RewardScorer(Qwen2ForSequenceClassification(config))


def test_policy_and_reward_model_load_their_tokenizers_from_their_directories_with_eos_as_pad(tmp_path, tokenizer):
    # One loader serves both: no tokenizer passed, so each comes from its model's directory; saved without a pad token,
    # it pads with EOS (the reward model's config takes that pad id to find each row's last token).
    eos_id = tokenizer.eos_token_id
    policy_dir, reward_dir = tmp_path / "policy", tmp_path / "reward"
    policy = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128)
    policy.save_pretrained(policy_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1)
    Qwen2ForSequenceClassification(config).save_pretrained(reward_dir)
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(policy_dir)
    tokenizer.save_pretrained(reward_dir)

    policy_tokenizer = load_tokenizer(AutoModelForCausalLM.from_pretrained(policy_dir), None)
    assert policy_tokenizer.pad_token_id == eos_id and policy_tokenizer.padding_side == "left"
    assert policy_tokenizer.name_or_path == str(policy_dir)
    scorer = RewardScorer(str(reward_dir))
    assert scorer.tokenizers[0].pad_token_id == eos_id
    assert scorer.funcs[0].config.pad_token_id == eos_id
    assert scorer.tokenizers[0].name_or_path == str(reward_dir)


def test_reward_model_id_that_cannot_be_reached():
    with pytest.raises(OSError, match="Could not load the reward model 'no-such-org/rm'"):
        RewardScorer("no-such-org/rm")


def test_reward_weights_must_be_finite():
    with pytest.raises(ValueError, match="finite"):
        RewardScorer([count_letters_reward], reward_weights=[float("nan")])
