"""The GRPO surface a TRL script relies on: its trainer and config classes, its quick-start ported with sed, its batch
layout, and how rewards become advantages."""

import dataclasses
import json
import math
import warnings

import datasets
import pytest
import torch
from conftest import make_config
from datasets import Dataset, IterableDataset
from scripted_policies import script_one_digit_answers
from split_group_workers import NUM_GENERATIONS, train
from test_split_groups import assert_same_weights_after_every_step, assert_steps_move_the_weights
from test_trainer_values import few_letters

from targetpo import GRPOConfig, GRPOTrainer, TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm, tool_calling_tokenizer
from targetpo.rewards import accuracy_reward

PROMPTS = ["Say cat:", "Say dog:", "Say sun:", "Say map:", "Say pen:", "Say cup:", "Say box:", "Say hat:"]


def test_a_grpo_config_trains_the_grpo_loss_it_names(tmp_path, tiny_model, tokenizer):
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, max_prompt_length=64, epsilon_high=0.28, scale_rewards="batch", max_steps=1,
        logging_steps=1, save_strategy="no",
    )
    reward = lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions]  # noqa: E731
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    # A script whose imports alone changed is told that it trains dapo, and how to train TPO.
    with pytest.warns(UserWarning, match=r"GRPOConfig, so this trainer trains its loss_type='dapo'.*TargetPOConfig"):
        trainer = TargetPOTrainer(tiny_model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert type(trainer.args) is TargetPOConfig
    for f in dataclasses.fields(GRPOConfig):
        assert getattr(trainer.args, f.name) == getattr(args, f.name), f.name
    assert trainer.args.loss_type == "dapo" and trainer.args.tpo_target_temperature == 1.0
    trainer.train()
    logs = trainer.state.log_history[0]
    assert "clip_ratio/region_mean" in logs and "tpo/target_entropy" not in logs  # a clipped-surrogate step
    # A GRPOConfig that asks for TPO trains TPO, and is not warned.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpo = TargetPOTrainer(tiny_model, reward, args=dataclasses.replace(args, loss_type="tpo"),
                              train_dataset=dataset, processing_class=tokenizer)
    assert tpo.args.loss_type == "tpo" and not [w for w in caught if "GRPOConfig" in str(w.message)]


#: TRL's GRPOTrainer quick-start, as TRL's README and GRPO trainer docs give it.
TRL_QUICK_START = """\
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
"""


def test_trls_quick_start_ported_with_sed_trains_trls_loss_and_says_so(tmp_path, monkeypatch):
    """The quick-start with every ``trl`` made ``targetpo``; only the Hub model and dataset are local stand-ins (a
    tiny chat model whose answers are "4" or "5", DeepMath's columns), and the run is two logged steps."""
    code = TRL_QUICK_START.replace("trl", "targetpo")
    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    tokenizer = tool_calling_tokenizer()
    script_one_digit_answers(build_tiny_causal_lm(tokenizer, max_positions=1024), tokenizer, "45").save_pretrained(model)
    tokenizer.save_pretrained(model)
    code = code.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(model)))
    deep_math = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "What is 2 + 3?"}]],
        "solution": ["$4$", "$5$"],
    })

    def load_dataset(path, split=None, **kwargs):
        assert (path, split) == ("targetpo-lib/DeepMath-103K", "train")
        return deep_math

    @dataclasses.dataclass
    class ShortRun(GRPOTrainer.default_config):
        """The trainer's defaults, over two logged steps."""

        max_steps: int = 2
        logging_steps: float = 1
        report_to: str | list[str] | None = "none"
        disable_tqdm: bool | None = True

    ShortRun.__name__ = GRPOTrainer.default_config.__name__  # names the output folder as the real default does
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(GRPOTrainer, "default_config", ShortRun)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    with pytest.warns(UserWarning, match=r"trains its loss_type='dapo' .*not TPO. For TPO, pass a TargetPOConfig"):
        exec(compile(code, "quick_start.py", "exec"), namespace)  # noqa: S102 - TRL's documented script, ported
    trainer = namespace["trainer"]
    assert type(trainer) is GRPOTrainer and trainer.args.output_dir == "Qwen2.5-0.5B-Instruct-GRPO"
    assert trainer.args.loss_type == "dapo" and trainer.args.max_completion_length == 256  # GRPOConfig's defaults
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    for entry in logs:
        # Groups whose answers differ (a gradient to follow), trained by a clipped-surrogate step, not TPO's.
        assert 0 < entry["rewards/accuracy_reward/mean"] < 1 and entry["grad_norm"] > 0
        assert "clip_ratio/region_mean" in entry and "tpo/target_entropy" not in entry


def test_accuracy_reward_compares_answers_as_mathematics():
    completions = [[{"role": "assistant", "content": "So it is \\boxed{\\frac{1}{2}}."}], "It is 0.5", "4", "I don't know",
                   "x + 1"]
    solutions = ["$\\frac{1}{2}$", "$\\frac12$", "$5$", "$4$", "not a formula at all"]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 0.0, 0.0, None]


def test_grpo_trainer_without_args_trains_grpo_configs_defaults_and_one_word_switches_to_tpo(
    tmp_path, tokenizer, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    tiny_model = build_tiny_causal_lm(tokenizer, max_positions=512)  # room for the default completion length
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    with pytest.warns(UserWarning, match=r"trains its loss_type='dapo'"):
        grpo = GRPOTrainer(tiny_model, reward, train_dataset=dataset, processing_class=tokenizer)
    defaults = GRPOConfig(output_dir="model-GRPO")
    for f in dataclasses.fields(GRPOConfig):
        assert getattr(grpo.args, f.name) == getattr(defaults, f.name), f.name
    assert grpo.args.loss_type == "dapo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TPO is what it was asked for: nothing to say
        tpo = TargetPOTrainer(tiny_model, reward, train_dataset=dataset, processing_class=tokenizer)
        switched = GRPOTrainer(tiny_model, reward, args=TargetPOConfig(output_dir="out"), train_dataset=dataset,
                               processing_class=tokenizer)
    assert tpo.args.loss_type == switched.args.loss_type == "tpo" and tpo.args.output_dir == "model-TargetPO"


@pytest.mark.parametrize("loss_type", ["tpo", "dapo"])
def test_trls_batch_layout_trains_a_group_over_an_optimiser_steps_micro_steps_as_one_micro_step(tmp_path, loss_type):
    """per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=8 and steps_per_generation left
    unset, as TRL lays it out: one rollout of one group per optimiser step, 2 of its rows per micro-step. Plain SGD:
    the weights after every step are those of the whole group in one micro-step."""
    spread = train(str(tmp_path / "spread"), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                   loss_type=loss_type, max_steps=2)
    assert spread.args.steps_per_generation == 4 and spread.args.generation_batch_size == NUM_GENERATIONS
    whole = train(str(tmp_path / "whole"), per_device_train_batch_size=NUM_GENERATIONS, loss_type=loss_type,
                  max_steps=2)
    assert whole.args.steps_per_generation == 1
    assert_same_weights_after_every_step(spread.recorded, whole.recorded)
    assert_steps_move_the_weights(whole.recorded[1:], whole.recorded[0])


def recorded_rewards(record):
    def first(completions, **kwargs):
        scores = [float(len(text)) for text in completions]
        record.append(scores)
        return scores

    def second(completions, **kwargs):
        # Leaves every fourth completion unscored (None), so a reward's statistics cover only what it scored.
        scores = [float(text.count("a") + 2 * text.count("b")) if index % 4 else None for index, text in enumerate(completions)]
        record.append(scores)
        return scores

    return [first, second]


def hand_advantages(per_func, weights, valid, num_generations, scale, aggregation):
    """The advantages as the config fields document them, written out group by group."""
    n = len(valid)
    if aggregation == "normalize_then_sum":
        total = [0.0] * n
        for column, weight in zip(zip(*per_func), weights):
            for start in range(0, n, num_generations):
                members = [i for i in range(start, start + num_generations) if valid[i] and column[i] is not None]
                values = [column[i] for i in members]
                if len(values) and max(values) > min(values):
                    mean = sum(values) / len(values)
                    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
                    for i in members:
                        total[i] += weight * (column[i] - mean) / std
        kept = [total[i] for i in range(n) if valid[i]]
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
        return [(total[i] - mean) / std if valid[i] and std > 0 else 0.0 for i in range(n)]
    scores = [sum(w * s for w, s in zip(weights, row) if s is not None) for row in per_func]
    kept = [scores[i] for i in range(n) if valid[i]]
    batch_mean = sum(kept) / len(kept)
    batch_std = math.sqrt(sum((v - batch_mean) ** 2 for v in kept) / len(kept))
    advantages = [0.0] * n
    for start in range(0, n, num_generations):
        members = [i for i in range(start, start + num_generations) if valid[i]]
        values = [scores[i] for i in members]
        if not values or max(values) == min(values):
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        divisor = {"group": std, "batch": batch_std, "none": 1.0}[scale]
        for i in members:
            advantages[i] = (scores[i] - mean) / divisor
    return advantages


@pytest.mark.parametrize(
    "scale, aggregation",
    [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), (False, "sum_then_normalize"),
     ("group", "normalize_then_sum")],
)
def test_advantages_follow_scale_rewards_and_multi_objective_aggregation(tmp_path, tiny_model, tokenizer, scale, aggregation):
    record = []
    args = make_config(
        tmp_path, scale_rewards=scale, multi_objective_aggregation=aggregation, reward_weights=[1.0, 0.5],
        mask_truncated_completions=True, max_completion_length=4, per_device_train_batch_size=16,
        generation_kwargs=few_letters(tokenizer),
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = TargetPOTrainer(
        tiny_model, recorded_rewards(record), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    per_func = list(zip(record[0], record[1]))
    valid = batch["valid"].tolist()
    assert not all(valid) and any(valid), "the rollout needs valid and invalid members to test"
    expected = hand_advantages(per_func, [1.0, 0.5], valid, 4, args.scale_rewards, aggregation)
    assert any(abs(value) > 0.1 for value in expected)
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-6)
    # The combined score the table and metrics show is the weighted sum either way.
    sums = [sum(w * s for w, s in zip([1.0, 0.5], row) if s is not None) for row in per_func]
    assert batch["scores"].tolist() == pytest.approx(sums)


def custom_code_model(directory, tokenizer):
    """A local model whose repository ships its own modelling code (``auto_map``), as some Hub models do."""
    build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "custom_llama.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "custom-llama"
    config["auto_map"] = {"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_trust_remote_code_is_off_unless_asked(tmp_path, tokenizer, prompt_dataset):
    path = custom_code_model(tmp_path / "custom", tokenizer)
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        TargetPOTrainer(path, reward, args=make_config(tmp_path), train_dataset=prompt_dataset)
    trainer = TargetPOTrainer(path, reward, args=make_config(tmp_path, trust_remote_code=True), train_dataset=prompt_dataset)
    assert type(trainer.model).__name__ == "CustomForCausalLM"  # the repository's own class ran


def test_shuffle_dataset_false_keeps_the_dataset_order(tmp_path, tiny_model, tokenizer):
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    orders = {}
    for shuffle in (True, False):
        args = make_config(tmp_path, shuffle_dataset=shuffle, per_device_train_batch_size=4, num_generations=4)
        trainer = TargetPOTrainer(tiny_model, lambda completions, **kw: [0.0] * len(completions), args=args,
                                  train_dataset=dataset, processing_class=tokenizer)
        orders[shuffle] = [index for index, _use in trainer._get_train_sampler()][:: args.num_generations]
    assert orders[False] == list(range(len(PROMPTS)))
    assert sorted(orders[True]) == list(range(len(PROMPTS))) and orders[True] != orders[False]


def test_cache_implementation_reaches_generate(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    seen = []
    original = type(tiny_model).generate

    def recording_generate(self, *args, **kwargs):
        seen.append(kwargs["generation_config"].cache_implementation)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "generate", recording_generate)
    args = make_config(tmp_path, cache_implementation="static", max_steps=1)
    trainer = TargetPOTrainer(tiny_model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.train()
    assert seen == ["static"]


def test_pad_to_multiple_of_pads_prompts_and_completions_without_changing_the_loss(tmp_path, tiny_model, tokenizer):
    args = make_config(tmp_path, pad_to_multiple_of=8, max_completion_length=5, generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, lambda completions, **kw: [float(c.count("a")) for c in completions],
                              args=args, train_dataset=Dataset.from_dict({"prompt": [p + "!" for p in PROMPTS]}),
                              processing_class=tokenizer)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    pad = tokenizer.pad_token_id
    prompt_width, completion_width = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    assert prompt_width % 8 == 0 and completion_width == 8  # 5 generated columns at most, padded to 8
    used_prompt = int(batch["prompt_mask"].any(dim=0).float().argmax())  # first column any prompt uses
    assert used_prompt > 0 and (batch["prompt_ids"][:, :used_prompt] == pad).all()
    assert (batch["completion_ids"][:, 5:] == pad).all() and batch["completion_attention_mask"][:, 5:].sum() == 0
    # The same rows without the padding give the same loss.
    trimmed = dict(batch)
    for key in ("prompt_ids", "prompt_mask"):
        trimmed[key] = batch[key][:, used_prompt:]
    for key in ("completion_ids", "completion_attention_mask", "completion_mask"):
        trimmed[key] = batch[key][:, :5]
    with torch.no_grad():
        padded_loss = trainer.compute_loss(trainer.model, dict(batch, targets=None))
        trimmed_loss = trainer.compute_loss(trainer.model, dict(trimmed, targets=None))
    assert padded_loss.item() == pytest.approx(trimmed_loss.item(), rel=1e-5)


def test_num_generations_eval_sets_the_evaluation_group_size(tmp_path, tiny_model, tokenizer):
    seen = []

    def reward(prompts, completions, **kwargs):
        scores = [float(len(c)) for c in completions]
        seen.append((list(prompts), scores))
        return scores

    args = make_config(tmp_path, num_generations_eval=2, per_device_eval_batch_size=4, eval_strategy="no",
                       generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}), processing_class=tokenizer)
    metrics = trainer.evaluate()
    prompts = [prompt for batch, _ in seen for prompt in batch]
    assert prompts == [p for p in PROMPTS[:4] for _ in range(2)]  # each eval prompt twice, in pairs
    spreads = []
    for _, scores in seen:
        for start in range(0, len(scores), 2):
            spreads.append(abs(scores[start] - scores[start + 1]) / 2)  # the population std of a pair
    # Logged per batch, then averaged over the batches.
    per_batch = [sum(spreads[i : i + 2]) / 2 for i in range(0, len(spreads), 2)]
    assert metrics["eval_reward_std"] == pytest.approx(sum(per_batch) / len(per_batch), rel=1e-6)
    assert 0 < metrics["eval_reward_std"]


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, tiny_model, tokenizer, prompt_dataset):
    from transformers import TrainerCallback

    initial = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    seen = []

    class Record(TrainerCallback):  # runs after the trainer's own callbacks
        def on_step_end(self, args, state, control, **kwargs):
            policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            reference = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
            seen.append((state.global_step, policy, reference))

    args = make_config(tmp_path, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.25, ref_model_sync_steps=2,
                       max_steps=4, generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, lambda completions, **kw: [float(c.count("a")) for c in completions],
                              args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.add_callback(Record())
    trainer.train()
    previous = initial
    for step, policy, reference in seen:
        for name, value in reference.items():
            if step % 2 == 0:  # ref <- 0.25 * policy + 0.75 * ref
                expected = 0.25 * policy[name] + 0.75 * previous[name]
            else:
                expected = previous[name]
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7)
        previous = reference
    assert any(not torch.equal(seen[-1][2][n], initial[n]) for n in initial), "the reference must have moved"


def test_a_resumed_run_goes_on_with_the_entropy_coefficient_and_the_synced_reference_it_had(
    tmp_path, tokenizer, prompt_dataset
):
    # Both move with training; a resume that restarted them from the config and the initial model would train on
    # with another bonus and another KL anchor.
    def run(out, resume=None, **overrides):
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        args = make_config(out, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=1,
                           use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.05, entropy_target=100.0,
                           max_steps=4, learning_rate=0.05, generation_kwargs=few_letters(tokenizer), **overrides)
        trainer = TargetPOTrainer(model, lambda completions, **kw: [float(c.count("a")) for c in completions],
                                  args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "a")
    run(tmp_path / "b", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    assert json.loads((checkpoint / "entropy_coefficient.json").read_text())["entropy_coef"] == pytest.approx(0.2)
    resumed = run(tmp_path / "c", resume=str(checkpoint))
    assert straight._step.loss.entropy_bonus.coefficient == pytest.approx(0.3)  # raised after each of the 4 steps (entropy under target)
    assert resumed._step.loss.entropy_bonus.coefficient == pytest.approx(straight._step.loss.entropy_bonus.coefficient)
    for model in ("ref_model", "model"):
        resumed_weights = dict(getattr(resumed, model).named_parameters())
        for name, value in getattr(straight, model).named_parameters():
            torch.testing.assert_close(resumed_weights[name], value, rtol=1e-5, atol=1e-6, msg=f"{model}.{name}")


def test_sync_ref_model_needs_a_reference_copy(tmp_path, tiny_model, tokenizer, prompt_dataset):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="beta=0 does not load"):
        make_config(tmp_path, sync_ref_model=True)
    with pytest.raises(ValueError, match="under PEFT the reference is the adapter-free base"):
        TargetPOTrainer(tiny_model, lambda completions, **kw: [0.0] * len(completions),
                        args=make_config(tmp_path, beta=0.1, sync_ref_model=True), train_dataset=prompt_dataset,
                        processing_class=tokenizer, peft_config=LoraConfig(r=2, target_modules=["q_proj"]))


def tiny_bf16_qwen2(tokenizer, tie_word_embeddings):
    """A one-layer Qwen2 in bf16, its output head tied to the input embeddings or not."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


#: Without mixed precision, and under bf16=True, whose autocast would run a plain nn.Linear head in bf16.
MIXED_PRECISION = pytest.mark.parametrize("bf16", [False, True], ids=["no-autocast", "bf16-autocast"])


@MIXED_PRECISION
def test_cast_lm_head_to_fp32_computes_the_log_probs_with_a_float32_head(tmp_path, tokenizer, prompt_dataset, bf16):
    model = tiny_bf16_qwen2(tokenizer, tie_word_embeddings=False)
    reward = lambda completions, **kw: [float(c.count("a")) for c in completions]  # noqa: E731
    args = make_config(tmp_path, cast_lm_head_to_fp32=True, beta=0.1, generation_kwargs=few_letters(tokenizer),
                       bf16=bf16, use_cpu=not torch.cuda.is_available())
    trainer = TargetPOTrainer(model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert trainer.ref_model.lm_head.weight.dtype == torch.float32  # the reference has the same head
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    logps, _ = trainer._token_logps(trainer.model, batch)
    # By hand: the bf16 body's last hidden states, then the float32 head on float32 inputs.
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_attention_mask"]], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), trainer.accelerator.autocast():
        hidden = model.model(input_ids=ids, attention_mask=attention, position_ids=positions).last_hidden_state
    with torch.no_grad():
        logits = hidden[:, batch["prompt_ids"].size(1) - 1 : -1].float() @ model.lm_head.weight.T
    suppressed = trainer._step.logps.suppressed_token_ids
    logits[..., suppressed] = float("-inf")
    expected = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    mask = batch["completion_attention_mask"].bool()
    torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-5, atol=1e-5)
    # A bf16 head's log-probs differ by far more than the tolerance above.
    bf16_logits = (hidden[:, batch["prompt_ids"].size(1) - 1 : -1] @ model.lm_head.weight.T.to(torch.bfloat16)).float()
    bf16_logits[..., suppressed] = float("-inf")
    bf16 = torch.log_softmax(bf16_logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    assert (bf16[mask] - expected[mask]).abs().max() > 1e-4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cast_lm_head_to_fp32_refuses_a_head_it_would_bypass(tokenizer, tied):
    from targetpo.modeling.loading import cast_output_head_to_fp32

    model = tiny_bf16_qwen2(tokenizer, tie_word_embeddings=tied)
    model.lm_head.__class__ = type("QuantisedHead", (torch.nn.Linear,), {})  # its own forward, which a cast replaces
    with pytest.raises(ValueError, match="needs a plain torch.nn.Linear output head, got QuantisedHead. Set "
                                         "cast_lm_head_to_fp32=False"):
        cast_output_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.bfloat16  # refused before anything changed


def test_cast_lm_head_to_fp32_refuses_a_head_whose_forward_accelerate_replaced(tokenizer):
    from accelerate.hooks import ModelHook, add_hook_to_module

    from targetpo.modeling.loading import cast_output_head_to_fp32

    model = tiny_bf16_qwen2(tokenizer, tie_word_embeddings=False)
    add_hook_to_module(model.lm_head, ModelHook())  # as device_map dispatch and offloading do
    with pytest.raises(ValueError, match="this one's forward is replaced"):
        cast_output_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_cast_lm_head_to_fp32_casts_the_head_peft_saves_and_its_original(tokenizer):
    """A model already wrapped by PEFT with modules_to_save=["lm_head"]: the trained copy and the original both compute
    in float32, under autocast too."""
    from peft import LoraConfig, get_peft_model

    from targetpo.modeling.loading import Float32OutputHead, cast_output_head_to_fp32

    config = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(tiny_bf16_qwen2(tokenizer, tie_word_embeddings=False), config)
    cast_output_head_to_fp32(model)
    wrapper = model.get_base_model().lm_head
    for head in (wrapper.original_module, *wrapper.modules_to_save.values()):
        assert type(head) is Float32OutputHead and head.weight.dtype == torch.float32
    hidden = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapper(hidden).dtype == torch.float32


@MIXED_PRECISION
def test_cast_lm_head_to_fp32_computes_a_tied_head_in_float32_from_the_shared_bf16_weight(
    tmp_path, tokenizer, prompt_dataset, bf16
):
    model = tiny_bf16_qwen2(tokenizer, tie_word_embeddings=True)
    embeddings = model.model.embed_tokens.weight
    reward = lambda completions, **kw: [float(c.count("a")) for c in completions]  # noqa: E731
    args = make_config(tmp_path, cast_lm_head_to_fp32=True, beta=0.1, generation_kwargs=few_letters(tokenizer),
                       learning_rate=0.05, bf16=bf16, use_cpu=not torch.cuda.is_available())
    trainer = TargetPOTrainer(model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    # The head still shares the embeddings, which keep their dtype; the reference's head is tied and cast the same way.
    assert model.lm_head.weight is embeddings and embeddings.dtype == torch.bfloat16
    reference = trainer.ref_model
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    assert reference.lm_head.weight.dtype == torch.bfloat16
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    start = batch["prompt_ids"].size(1) - 1
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_attention_mask"]], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), trainer.accelerator.autocast():
        hidden = model.model(input_ids=ids, attention_mask=attention, position_ids=positions).last_hidden_state

    def by_hand(logits):
        logits = logits.clone()
        logits[..., trainer._step.logps.suppressed_token_ids] = float("-inf")
        return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)

    mask = batch["completion_attention_mask"].bool()
    expected = by_hand(hidden[:, start:-1].float() @ embeddings.float().T)  # float32 from the bf16 values
    for network in (trainer.model, reference):
        logps, _ = trainer._token_logps(network, batch)
        torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-5, atol=1e-5)
    bf16 = by_hand((hidden[:, start:-1] @ embeddings.T).float())  # what a bf16 head would give: far off
    assert (bf16[mask] - expected[mask]).abs().max() > 1e-4
    # Training reaches the shared weight through the float32 head, and leaves it shared and bf16.
    before = embeddings.detach().clone()
    trainer.train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16 and not torch.equal(before, model.lm_head.weight.detach())


def tiny_moe(tokenizer):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config)


def test_router_aux_loss_joins_the_loss_of_a_mixture_of_experts_model(tmp_path, tokenizer, prompt_dataset):
    model = tiny_moe(tokenizer)
    reward = lambda completions, **kw: [float(c.count("a")) for c in completions]  # noqa: E731
    losses = {}
    for coef in (0.0, 0.5):
        args = make_config(tmp_path, router_aux_loss_coef=coef, generation_kwargs=few_letters(tokenizer))
        trainer = TargetPOTrainer(model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
        trainer.model.train()
        if coef == 0.0:
            batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        with torch.no_grad():
            losses[coef] = trainer.compute_loss(trainer.model, dict(batch, targets=None)).item()
    # By hand: the model's own load-balancing loss over the prompt and completion tokens it attends to.
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_attention_mask"]], dim=1)
    used = attention.any(dim=0)  # columns no row attends to are left out, as the trainer's forward does
    ids, attention = ids[:, used], attention[:, used]
    with torch.no_grad():
        aux = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                    output_router_logits=True).aux_loss.item()
    assert aux > 0.1
    assert losses[0.5] - losses[0.0] == pytest.approx(0.5 * aux, rel=1e-4)


def test_async_reward_functions_are_awaited_together(tmp_path, tiny_model, tokenizer, prompt_dataset):
    import asyncio

    meeting = {}

    async def first(completions, **kwargs):
        # Waits for the second function: only finishes if both run at the same time.
        meeting["first"] = asyncio.Event()
        await asyncio.wait_for(_second_started(meeting), timeout=10)
        return [float(len(c)) for c in completions]

    async def second(completions, **kwargs):
        meeting["second"] = True
        await asyncio.sleep(0)
        return [float(c.count("a")) for c in completions]

    def plain(completions, **kwargs):
        return [1.0] * len(completions)

    args = make_config(tmp_path, log_completions=True, generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, [first, plain, second], args=args, train_dataset=prompt_dataset,
                              processing_class=tokenizer)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    texts = trainer._completions.table.completions
    expected = [len(t) + 1.0 + t.count("a") for t in texts]
    assert batch["scores"].tolist() == pytest.approx(expected)
    assert trainer._completions.table.rewards["second"] == [float(t.count("a")) for t in texts]


async def _second_started(meeting):
    import asyncio

    while "second" not in meeting:
        await asyncio.sleep(0.001)


def test_an_async_reward_function_that_raises_is_named(tmp_path, tiny_model, tokenizer, prompt_dataset):
    async def broken(completions, **kwargs):
        raise RuntimeError("no judge")

    trainer = TargetPOTrainer(tiny_model, broken, args=make_config(tmp_path), train_dataset=prompt_dataset,
                              processing_class=tokenizer)
    trainer.model.train()
    with pytest.raises(ValueError, match="Reward function 'broken' raised RuntimeError: no judge"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_reward_functions_log_metrics_and_table_columns(tmp_path, tiny_model, tokenizer, prompt_dataset):
    from rich.console import Console

    from targetpo.reporting.completions import print_completions_table, table_columns

    def judged(completions, log_extra, log_metric, **kwargs):
        lengths = [len(c) for c in completions]
        log_metric("judge/mean_length", sum(lengths) / len(lengths))
        log_metric("judge/mean_length", 100.0)  # two values in one rollout: averaged with the first
        log_extra("verdict", ["long" if n > 2 else "short" for n in lengths])
        return [float(n) for n in lengths]

    args = make_config(tmp_path, log_completions=True, log_unique_prompts=True, max_steps=1,
                       generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, judged, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.train()
    table = trainer._completions.table
    lengths = [len(c) for c in table.completions]
    assert table.extra["verdict"] == ["long" if n > 2 else "short" for n in lengths]
    logged = trainer.state.log_history[0]["judge/mean_length"]
    assert logged == pytest.approx((sum(lengths) / len(lengths) + 100.0) / 2)
    console = Console(record=True, width=250)
    print_completions_table(table, console=console)
    text = console.export_text()
    assert "verdict" in text and "short" in text
    # log_unique_prompts: each prompt is written once, on its group's first row, in the printed table and in the one
    # trackers and the Hub get.
    for prompt in set(table.prompts):
        assert text.count(prompt) == 1
    written = [prompt if row % 4 == 0 else None for row, prompt in enumerate(table.prompts)]  # groups of 4
    assert table_columns(table)["prompt"] == written
    with pytest.raises(ValueError, match="log_extra\\('x', ...\\) got 1 values for 8 completions"):
        TargetPOTrainer(
            tiny_model, lambda completions, log_extra, **kw: log_extra("x", [1]) or [0.0] * len(completions),
            args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer,
        ).train()


def test_the_reward_attributes_trls_trainer_has_are_there_under_its_names(tmp_path, tiny_model, tokenizer,
                                                                          prompt_dataset):
    """A TRL script that reads trainer.reward_funcs, reward_func_names, reward_weights or reward_processing_classes
    ports unchanged: each holds what the trainer scores with, in the order given."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    def brevity(completions, **kwargs):
        return [-float(len(c)) for c in completions]

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    judge = Qwen2ForSequenceClassification(config)
    args = make_config(tmp_path, reward_weights=[0.5, 2.0])
    trainer = GRPOTrainer(tiny_model, [brevity, judge], args=args, train_dataset=prompt_dataset,
                          processing_class=tokenizer, reward_processing_classes=[None, tokenizer])
    assert trainer.reward_funcs == [brevity, judge]
    assert trainer.reward_func_names == ["brevity", "Qwen2ForSequenceClassification"]
    assert torch.equal(trainer.reward_weights, torch.tensor([0.5, 2.0]))
    assert trainer.reward_processing_classes == [None, tokenizer]
    assert trainer.reward_funcs is trainer.reward_scorer.funcs  # what scores, not a copy


def test_log_completions_hub_repo_is_refused_offline_and_pushes_each_logged_table(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    import datasets
    import huggingface_hub.constants

    args = make_config(tmp_path, log_completions=True, log_completions_hub_repo="me/completions", max_steps=2,
                       hub_private_repo=True)
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    with pytest.raises(ValueError, match="the Hub is switched off \\(HF_HUB_OFFLINE=1\\)"):
        TargetPOTrainer(tiny_model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    # The Hub itself cannot be reached here: the push is recorded at datasets' boundary instead.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    pushed = []
    monkeypatch.setattr(datasets.Dataset, "push_to_hub", lambda self, repo, **kw: pushed.append((repo, kw, self.to_dict())))
    trainer = TargetPOTrainer(tiny_model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.train()
    assert [(repo, kw["split"], kw["private"]) for repo, kw, _ in pushed] == [
        ("me/completions", "step_0", True), ("me/completions", "step_1", True)
    ]
    rows = pushed[-1][2]
    assert rows["completion"] == trainer._completions.table.completions
    assert rows["reward"] == pytest.approx([float(len(c)) for c in rows["completion"]])


def test_a_failed_completions_push_warns_and_the_next_log_pushes_the_latest_table(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    import datasets
    import httpx
    import huggingface_hub.constants
    from huggingface_hub.errors import HfHubHTTPError

    # The Hub cannot be reached here: at datasets' boundary the first push meets the error a rate-limited Hub raises,
    # and later ones are recorded.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    pushed = []

    def push_to_hub(self, repo, **kw):
        if not pushed:
            pushed.append(None)
            request = httpx.Request("POST", "https://huggingface.co/api/datasets/me/completions/commit/main")
            raise HfHubHTTPError("429 Too Many Requests", response=httpx.Response(429, request=request))
        pushed.append((kw["split"], self.to_dict()["completion"]))

    monkeypatch.setattr(datasets.Dataset, "push_to_hub", push_to_hub)
    # Each rollout serves two logged steps: the first rollout's table fails at step 0 and is pushed at step 1.
    args = make_config(tmp_path, log_completions=True, log_completions_hub_repo="me/completions", max_steps=4,
                       steps_per_generation=2)
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    trainer = TargetPOTrainer(tiny_model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    with pytest.warns(UserWarning, match=r"step 0 to log_completions_hub_repo='me/completions' failed.*429"):
        trainer.train()
    assert trainer.state.global_step == 4  # the failure ended nothing
    assert [split for split, _ in pushed[1:]] == ["step_0", "step_2"]  # each rollout once, the failed one retried
    assert pushed[-1][1] == trainer._completions.table.completions


# ------------------------------------------------------------------------------------------------ streams and dicts
def recording_reward(seen):
    def reward(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return [float(len(c)) for c in completions]

    return reward


def stream_of(prompts):
    from datasets import IterableDataset

    def rows():
        yield from ({"prompt": prompt} for prompt in prompts)

    return IterableDataset.from_generator(rows)


class ReIterable:
    """A plain iterable without a length whose every `iter()` starts again from the first row."""

    def __init__(self, prompts):
        self.prompts = prompts

    def __iter__(self):
        return ({"prompt": prompt} for prompt in self.prompts)


@pytest.mark.parametrize("make_stream", ["to_iterable_dataset", "from_generator", "re-iterable"])
def test_a_streamed_train_dataset_trains_as_the_same_rows_in_order(tmp_path, tokenizer, make_stream):
    ten = PROMPTS + ["Say cow:", "Say owl:"]  # 2 prompts per rollout: the stream runs out after 5 rollouts
    runs = {}
    for kind in ("map", "stream"):
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        mapped = Dataset.from_dict({"prompt": ten})
        if kind == "map":
            dataset = mapped
        else:
            dataset = {
                "to_iterable_dataset": mapped.to_iterable_dataset, "from_generator": lambda: stream_of(ten),
                "re-iterable": lambda: ReIterable(ten),
            }[make_stream]()
        seen = []
        args = make_config(tmp_path / kind, shuffle_dataset=False, per_device_train_batch_size=4,
                           steps_per_generation=2, max_steps=12, generation_kwargs=few_letters(tokenizer))
        trainer = TargetPOTrainer(model, recording_reward(seen), args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
        trainer.train()
        runs[kind] = (seen, {n: p.detach().clone() for n, p in model.named_parameters()})
    seen, weights = runs["stream"]
    # 12 steps = 6 rollouts of 2 prompts x 4 completions: the stream in order, then again from its start.
    order = ten + ten[:2]
    assert seen == [[order[2 * r]] * 4 + [order[2 * r + 1]] * 4 for r in range(6)]
    assert seen == runs["map"][0]
    for name, value in weights.items():
        assert torch.equal(value, runs["map"][1][name]), name


def test_a_bad_row_in_a_stream_is_named_when_it_arrives(tmp_path, tiny_model, tokenizer):
    args = make_config(tmp_path, max_steps=4)
    trainer = TargetPOTrainer(tiny_model, recording_reward([]), args=args,
                              train_dataset=stream_of(PROMPTS[:3] + ["  "] + PROMPTS[3:]), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"train dataset's prompt in row 3 is only whitespace"):
        trainer.train()


@pytest.mark.parametrize(
    ("setting", "message"),
    [(dict(async_rollouts=True, use_vllm=True, vllm_mode="server"), "async_rollouts=True needs a map-style"),
     (dict(accelerator_config={"dispatch_batches": True}), "dispatch_batches=True sends batches from the main")],
)
def test_settings_a_stream_cannot_serve_are_refused(tmp_path, tiny_model, tokenizer, setting, message):
    with pytest.raises(ValueError, match=message):
        TargetPOTrainer(tiny_model, recording_reward([]), args=make_config(tmp_path, **setting),
                        train_dataset=stream_of(PROMPTS), processing_class=tokenizer)


def test_async_rollouts_take_a_streamed_eval_dataset():
    """async_rollouts reads the train dataset ahead by index; evaluation reads no rollout ahead, so a stream is fine."""
    from targetpo.data import check_streaming_supported

    args = TargetPOConfig(output_dir="unused", async_rollouts=True, use_vllm=True, vllm_mode="server",
                          num_generations=4, per_device_train_batch_size=8, report_to="none")
    check_streaming_supported(args, train_is_stream=False)
    with pytest.raises(ValueError, match="async_rollouts=True needs a map-style train dataset"):
        check_streaming_supported(args, train_is_stream=True)


def test_a_stream_is_read_without_dataloader_workers_which_map_style_loaders_keep(tmp_path, tokenizer):
    """TRL's behaviour: with a stream, dataloader_num_workers > 0 is a warning and the stream's loader reads in the main
    process (a worker each would repeat every prompt); map-style loaders keep the user's worker settings."""
    ten = PROMPTS + ["Say cow:", "Say owl:"]
    workers = dict(dataloader_num_workers=2, dataloader_persistent_workers=True, dataloader_prefetch_factor=3)
    runs = {}
    for kind in ("map", "stream"):
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        seen = []
        args = make_config(tmp_path / kind, shuffle_dataset=False, per_device_train_batch_size=4,
                           steps_per_generation=2, max_steps=12, generation_kwargs=few_letters(tokenizer),
                           **(workers if kind == "stream" else {}))
        dataset = Dataset.from_dict({"prompt": ten})
        if kind == "map":
            trainer = TargetPOTrainer(model, recording_reward(seen), args=args, train_dataset=dataset,
                                      processing_class=tokenizer)
        else:
            with pytest.warns(UserWarning, match="dataloader_num_workers=2 does not apply to streamed datasets: each "
                                                 "worker would read the whole stream"):
                trainer = TargetPOTrainer(model, recording_reward(seen), args=args, train_dataset=stream_of(ten),
                                          processing_class=tokenizer)
            assert trainer.get_train_dataloader().num_workers == 0
            # The user's settings still hold, and a map-style dataset's loader uses them.
            assert {name: getattr(trainer.args, name) for name in workers} == workers
            map_loader = trainer.get_eval_dataloader(Dataset.from_dict({"prompt": PROMPTS}))
            assert (map_loader.num_workers, map_loader.persistent_workers, map_loader.prefetch_factor) == (2, True, 3)
            with pytest.warns(UserWarning, match="dataloader_num_workers=2 does not apply"):
                assert trainer.get_eval_dataloader(stream_of(PROMPTS)).num_workers == 0
        trainer.train()
        runs[kind] = (seen, {n: p.detach().clone() for n, p in model.named_parameters()})
    # Every prompt once per epoch, in order (workers would have read the stream twice, each prompt twice in a row).
    order = ten + ten[:2]
    assert runs["stream"][0] == [[order[2 * r]] * 4 + [order[2 * r + 1]] * 4 for r in range(6)] == runs["map"][0]
    for name, value in runs["stream"][1].items():
        assert torch.equal(value, runs["map"][1][name]), name


def test_a_stream_passed_to_evaluate_scores_as_the_same_rows_map_style(tmp_path, tiny_model, tokenizer):
    """TRL's behaviour: a trainer built with map-style data evaluates a stream passed to `evaluate()`, checking it
    when passed, with the same rows, completions and metrics as the same prompts in a map-style dataset."""
    from transformers import set_seed

    seen = []
    args = make_config(tmp_path, per_device_eval_batch_size=8, generation_kwargs=few_letters(tokenizer))
    trainer = TargetPOTrainer(tiny_model, recording_reward(seen), args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    results = {}
    # 8 prompts, 2 per batch: the last batch is whole. (With a partial one, a map-style dataset's eval_loss would
    # weigh it by the prompts, not the completions, it holds: accelerate takes the dataset's length as the rows'.)
    for kind, dataset in (("map", Dataset.from_dict({"prompt": PROMPTS})), ("stream", stream_of(PROMPTS))):
        seen.clear()
        set_seed(0)  # the same samples for both
        metrics = trainer.evaluate(eval_dataset=dataset)
        timings = ("runtime", "per_second", "_seconds", "preparation_time")
        results[kind] = (list(seen), {k: v for k, v in metrics.items() if not k.endswith(timings)})
    assert results["stream"][0] == [[PROMPTS[i]] * 4 + [PROMPTS[i + 1]] * 4 for i in range(0, 8, 2)]
    assert results["stream"] == results["map"]
    assert {"eval_loss", "eval_reward", "eval_reward_std"} <= set(results["stream"][1])
    with pytest.raises(ValueError, match=r"The eval dataset has no 'prompt' column \(found \['text'\]\)"):
        trainer.evaluate(eval_dataset=IterableDataset.from_generator(lambda: iter([{"text": "Hi"}])))
    with pytest.raises(ValueError, match=r"eval dataset's prompt in row 5 is only whitespace"):
        trainer.evaluate(eval_dataset=stream_of(PROMPTS[:5] + [" "] + PROMPTS[5:]))


def constant_reward(prompts, completions, score, **kwargs):
    return [float(s) for s in score]


def test_each_named_eval_dataset_is_evaluated_under_its_name(tmp_path, tiny_model, tokenizer):
    evals = {
        "low": Dataset.from_dict({"prompt": PROMPTS[:2], "score": [1.0, 3.0]}),
        "high": Dataset.from_dict({"prompt": PROMPTS[2:6], "score": [10.0, 10.0, 20.0, 20.0]}).to_iterable_dataset(),
    }
    args = make_config(tmp_path, per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=1, max_steps=1)
    trainer = TargetPOTrainer(tiny_model, constant_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS, "score": [0.0] * 8}),
                              eval_dataset=evals, processing_class=tokenizer)
    trainer.train()
    logged = {key: value for entry in trainer.state.log_history for key, value in entry.items()}
    assert logged["eval_low_reward"] == pytest.approx(2.0) and logged["eval_high_reward"] == pytest.approx(15.0)
    # Within a group every completion scores the same: the spread is 0, the target is p_old itself.
    assert logged["eval_low_reward_std"] == 0 and logged["eval_high_reward_std"] == 0
    assert "eval_reward" not in logged and "eval_low_loss" in logged and "eval_high_loss" in logged
    metrics = trainer.evaluate(metric_key_prefix="test")
    assert metrics["test_low_reward"] == pytest.approx(2.0) and metrics["test_high_reward"] == pytest.approx(15.0)


def test_named_eval_datasets_keep_their_own_persistent_worker_loaders(tmp_path, tiny_model, tokenizer):
    # With persistent workers the Trainer keeps one loader per name; each evaluation must read its own dataset.
    evals = {
        "low": Dataset.from_dict({"prompt": PROMPTS[:2], "score": [1.0, 3.0]}),
        "high": Dataset.from_dict({"prompt": PROMPTS[2:4], "score": [10.0, 20.0]}),
    }
    args = make_config(tmp_path, per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=1, max_steps=2,
                       dataloader_num_workers=1, dataloader_persistent_workers=True)
    trainer = TargetPOTrainer(tiny_model, constant_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS, "score": [0.0] * 8}),
                              eval_dataset=evals, processing_class=tokenizer)
    trainer.train()
    rewards = [(name, entry[f"eval_{name}_reward"]) for entry in trainer.state.log_history for name in evals
               if f"eval_{name}_reward" in entry]
    assert rewards == [("low", pytest.approx(2.0)), ("high", pytest.approx(15.0))] * 2
