"""Prompts the trainer is given: checked in every row before any step, and fitted to the model's positions."""

import warnings

import pytest
from conftest import length_reward, make_config
from datasets import Dataset
from test_vllm import needs_vllm, reverse_config
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm, exact_reversal_reward, reverse_task_dataset, reverse_task_tokenizer
from targetpo.modeling.loading import max_positions
from targetpo.rollout.prompts import first_of_each_repeat

PROMPTS = ["Please say the word cat:", "Hi:", "Now write one more word, dog:", "Say sun:"]


@pytest.fixture
def short_context_model(tokenizer):
    return build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=16, seed=0)


def cut_warnings(caught):
    return [str(w.message) for w in caught if "keep only their last" in str(w.message)]


def test_prompts_keep_their_last_tokens_within_the_models_positions(tmp_path, tokenizer, short_context_model):
    """max_prompt_length=None: prompts take what the positions leave; the first rollout that cuts one says so, once."""
    dataset = Dataset.from_dict({"prompt": PROMPTS * 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is cut yet: nothing to say
        trainer = TargetPOTrainer(
            short_context_model, length_reward, args=make_config(tmp_path, max_prompt_length=None, max_steps=1),
            train_dataset=dataset, processing_class=tokenizer,
        )
    short = [{"prompt": prompt} for prompt in (PROMPTS[1], PROMPTS[3]) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer._rollout(short, mode="train")  # both fit: nothing is cut
        batch = trainer._rollout([{"prompt": prompt} for prompt in PROMPTS[:2] for _ in range(4)], mode="train")
        trainer._rollout([{"prompt": prompt} for prompt in PROMPTS[2:4] for _ in range(4)], mode="train")
    # Once, for the first rollout that cut a prompt, counting prompts (not a group's 4 rows).
    assert cut_warnings(caught) == [
        "1 of the 2 prompts of a rollout are longer than 10 tokens (the model's 16 positions less "
        "max_completion_length=6; max_prompt_length=None) and keep only their last 10. Drop or shorten such prompts "
        "(e.g. `dataset.filter(...)` on their token count), or make room: raise max_prompt_length or lower "
        "max_completion_length within the model's positions. Later cuts are not reported."
    ]
    assert batch["prompt_ids"].size(1) + batch["completion_ids"].size(1) <= 16  # prompt and completion fit
    assert batch["completion_ids"].size(1) == 6
    kept = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert kept[0] == PROMPTS[0][-10:] and kept[4] == PROMPTS[1]  # the last tokens; a short prompt whole
    trainer.train()
    assert trainer.state.global_step == 1


def test_the_default_max_prompt_length_says_nothing_until_a_prompt_is_cut(tmp_path, tokenizer):
    """The default max_prompt_length (512) beyond a 512-position model is no conflict of the user's: no warning for
    a run whose prompts fit (the guess demo's), one when a prompt is cut."""
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=512, seed=0)
    args = make_config(tmp_path, max_prompt_length=TargetPOConfig.max_prompt_length, max_completion_length=20,
                       max_steps=1)
    assert args.max_prompt_length + args.max_completion_length > 512
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = TargetPOTrainer(model, length_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  processing_class=tokenizer)
        trainer.train()
    long_prompt = "x" * 500
    with pytest.warns(UserWarning, match=r"^1 of the 2 prompts of a rollout are longer than 492 tokens \(the model's 512 "
                                         r"positions less max_completion_length=20; max_prompt_length=512\)"):
        batch = trainer._rollout([{"prompt": p} for p in (long_prompt, PROMPTS[0]) for _ in range(4)], mode="train")
    assert tokenizer.decode(batch["prompt_ids"][0]) == long_prompt[-492:]


def test_max_prompt_length_above_the_models_room_is_lowered(tmp_path, tokenizer, short_context_model):
    dataset = Dataset.from_dict({"prompt": PROMPTS * 2})
    with pytest.warns(UserWarning, match="max_prompt_length=14 and max_completion_length=4 exceed the model's 16 "
                                         "positions, so prompts longer than 12 tokens keep their last 12"):
        trainer = TargetPOTrainer(
            short_context_model, length_reward, args=make_config(tmp_path, max_prompt_length=14, max_completion_length=4),
            train_dataset=dataset, processing_class=tokenizer,
        )
    assert trainer._rollout_context.prompt_encoder.tokenize(PROMPTS[:1])[0].size(1) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the room: nothing to say
        trainer = TargetPOTrainer(
            short_context_model, length_reward, args=make_config(tmp_path, max_prompt_length=8, max_completion_length=4),
            train_dataset=dataset, processing_class=tokenizer,
        )
    with pytest.warns(UserWarning, match=r"^1 of the 1 prompts .* longer than 8 tokens \(max_prompt_length=8\)"):
        ids, _ = trainer._rollout_context.prompt_encoder.tokenize(PROMPTS[:1])
    assert tokenizer.decode(ids[0]) == PROMPTS[0][-8:]


def test_a_groups_repeats_of_its_prompt_are_tokenized_once(tmp_path, tokenizer, tiny_model):
    """Each run of equal prompts is rendered and tokenized once and its rows repeated: the same ids and mask as
    tokenizing every row; a prompt that comes back after another (or with other tools) is a run of its own."""
    trainer = TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path, max_prompt_length=10),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    encoder = trainer._rollout_context.prompt_encoder
    prompts = [PROMPTS[1]] * 3 + [PROMPTS[2]] * 2 + [PROMPTS[1]]
    seen = []

    def counting_tokenizer(text, **kwargs):
        seen.append(list(text))
        return tokenizer(text=text, **kwargs)

    encoder.tokenizer = counting_tokenizer
    with pytest.warns(UserWarning, match="^1 of the 2 prompts"):  # the long one, counted once
        ids, mask = encoder.tokenize(prompts)
    assert seen == [[PROMPTS[1], PROMPTS[2], PROMPTS[1]]]
    every_row = tokenizer(text=prompts, return_tensors="pt", padding=True, padding_side="left")
    assert ids.tolist() == every_row["input_ids"][:, -10:].tolist()
    assert mask.tolist() == every_row["attention_mask"][:, -10:].tolist()
    assert first_of_each_repeat(["a", "a", "a"], [["x"], ["x"], ["y"]]) == ([0, 2], [0, 0, 1])
    conversation = [{"role": "user", "content": "hi"}]
    assert first_of_each_repeat([conversation, list(conversation), "hi"]) == ([0, 2], [0, 0, 1])


def test_a_completion_as_long_as_the_context_is_refused(tmp_path, tokenizer, short_context_model):
    with pytest.raises(ValueError, match="max_completion_length=16 leaves no room .* 16 positions.*below 16"):
        TargetPOTrainer(
            short_context_model, length_reward, args=make_config(tmp_path, max_completion_length=16),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), processing_class=tokenizer,
        )


def test_positions_are_found_through_peft_and_composite_configs(tokenizer, short_context_model):
    from peft import LoraConfig, get_peft_model

    assert max_positions(get_peft_model(short_context_model, LoraConfig(r=2, target_modules=["q_proj"]))) == 16
    text = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=24,
    )
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    composite = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict()))
    assert getattr(composite.config, "max_position_embeddings", None) is None  # only the text config knows
    assert max_positions(composite) == 24


def test_bad_rows_stop_the_trainer_before_any_step(tmp_path, tiny_model, tokenizer, prompt_dataset):
    bad_train = Dataset.from_dict({"prompt": ["Say cat:"] * 7 + [" "]})
    with pytest.raises(ValueError, match="The train dataset's prompt in row 7 is only whitespace"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=bad_train,
                        processing_class=tokenizer)
    bad_eval = Dataset.from_dict({"prompt": ["Say cat:"] * 3 + [None]})
    with pytest.raises(ValueError, match="The eval dataset's prompt in row 3 is None"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset,
                        eval_dataset=bad_eval, processing_class=tokenizer)
    trainer = TargetPOTrainer(
        tiny_model, length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer
    )
    with pytest.raises(ValueError, match="The eval dataset's prompt in row 3 is None"):
        trainer.evaluate(eval_dataset=bad_eval)  # a dataset passed late is checked too
    assert trainer.state.global_step == 0


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_vllm_colocate_engine_takes_the_fitted_prompts(tmp_path):
    """The engine's context is the model's positions, and prompts cut to fit beside the completion are accepted."""
    tokenizer = reverse_task_tokenizer()
    model = build_tiny_causal_lm(tokenizer, max_positions=24, seed=0)
    dataset = reverse_task_dataset(length=30, num_prompts=16)  # prompts of 31 tokens
    trainer = TargetPOTrainer(
        model, exact_reversal_reward, train_dataset=dataset, processing_class=tokenizer,
        args=reverse_config(tmp_path, vllm_mode="colocate", max_prompt_length=None, max_steps=1),
    )
    assert trainer.rollout_backend.engine.llm.llm_engine.model_config.max_model_len == 24
    with pytest.warns(UserWarning, match="prompts of a rollout are longer than 18 tokens .* keep only their last 18"):
        trainer.train()
    assert trainer.state.global_step == 1
