"""Tiny vision-language models and their processors, built offline from configs with random weights.

``build_tiny_vlm(architecture, seed)`` returns ``(model, processor)`` for one of :data:`ARCHITECTURES`. Each model has
one text layer and one vision layer with hidden size 32 (a few tens of thousands of parameters); each processor pairs
the demo's character tokenizer (:func:`targetpo.demo.build_char_tokenizer`, one token per character), extended with the
special tokens that architecture needs, with the architecture's PIL image processor configured for tiny images, so an
image becomes only a handful of placeholder tokens. Nothing is downloaded. The LLaVA-NeXT one is the library's own
stand-in (:func:`targetpo.demo.build_tiny_vision_chat_model`).

The chat template (:func:`targetpo.demo.image_chat_template`) renders like :data:`targetpo.demo.CHAT_TEMPLATE` (``<role>content`` then a newline per message, and
``<assistant>`` as the generation prompt); a message's content may also be a list of parts ``{"type": "text", "text":
...}`` / ``{"type": "image"}``, an image part rendering as the placeholder text the processor expands.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
    SmolVLMVisionConfig,
)
from transformers.processing_utils import ProcessorMixin

from targetpo.demo import build_char_tokenizer, build_tiny_vision_chat_model, image_chat_template

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "llava_next", "idefics3", "smolvlm")

HIDDEN = 32  # text and vision hidden size
HEADS = 2  # attention heads (head_dim 16)
#: A one-layer vision tower over 28-pixel images in 7-pixel patches, for Gemma3's and Idefics3's (SmolVLM's) towers.
SIGLIP_LIKE_VISION = {
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "image_size": 28,
    "patch_size": 7,
}
MAX_POSITIONS = 512


def _tokenizer(named_tokens: dict[str, str], other_tokens: tuple[str, ...] = (), template: str | None = None):
    """The demo's character tokenizer plus special tokens: ``named_tokens`` also become attributes (``image_token`` and
    ``image_token_id``, ``boi_token``, ...), which several processors read."""
    tokenizer = build_char_tokenizer(named_special_tokens=named_tokens)
    if other_tokens:
        tokenizer.add_special_tokens({"extra_special_tokens": list(other_tokens)}, replace_extra_special_tokens=False)
    tokenizer.chat_template = template
    return tokenizer


def _text_kwargs(tokenizer, layers: int, hidden: int = HIDDEN) -> dict:
    """Text-config fields shared by every architecture: hidden 32, the tokenizer's vocabulary and ids."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }


def _finish(model_class, config, tokenizer, seed: int, after_init=None):
    """Instantiate with seeded random weights (without touching the global RNG) and set the generation ids.

    Generation never samples the media special tokens (``generation_config.suppress_tokens``): a random model would
    otherwise emit e.g. an ``<image>`` token, and a completion holding one makes the next forward over prompt +
    completion fail ("Image features and image tokens do not match"). Set ``suppress_tokens = None`` to allow them.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
        if after_init is not None:
            after_init(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    base_size = len(build_char_tokenizer())
    model.generation_config.suppress_tokens = list(range(base_size, len(tokenizer)))
    return model


# ------------------------------------------------------------------------------------------------------ processors
# Qwen2VLProcessor, Qwen2_5_VLProcessor and SmolVLMProcessor take a video processor too. Checking its class needs
# transformers' video-processor registry, whose classes need torchvision, and torchvision cannot be installed beside
# this torch build: constructing them fails with "VIDEO_PROCESSOR_MAPPING has no attribute '_extra_content'". These
# image-only subclasses are that boundary and nothing more: an ``__init__`` without ``video_processor`` (the
# processor's attributes are read from this signature, so saving and checking skip the video processor); calling,
# chat templates, decoding and the image path are the library's own code.


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor (torchvision is not installable here)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without a video processor (torchvision is not installable here)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
    """SmolVLMProcessor without a video processor (torchvision is not installable here).

    ``SmolVLMProcessor.__init__`` also insists on the ``num2words`` package, which only its video prompts use, and its
    ``apply_chat_template`` reads the video processor's frame settings; both are skipped here.
    """

    def __init__(self, image_processor, tokenizer, image_seq_len: int = 169, chat_template=None, **kwargs):
        self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
        self.image_token = getattr(tokenizer, "image_token", "<image>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", "<end_of_utterance>")
        self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
        self.image_seq_len = image_seq_len
        self.video_token = getattr(tokenizer, "video_token", "<video>")
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


# ------------------------------------------------------------------------------------------------------ builders
def _build_qwen(seed: int, text_layers: int, version: str):
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    tokenizer = _tokenizer(
        {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        ("<|vision_start|>", "<|vision_end|>"),
        image_chat_template(placeholder),
    )
    # 14-pixel patches merged 2x2, at least and at most 56*56 pixels: a square image is resized to 56x56, a 4x4 patch
    # grid, i.e. 16 patch rows and 4 tokens (other aspect ratios round to a few more, e.g. 50x30 -> 24 rows, 6 tokens).
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor_class = ImageOnlyQwen2VLProcessor if version == "2" else ImageOnlyQwen2_5_VLProcessor
    processor = processor_class(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    vision = {
        "depth": 1,
        "hidden_size": HIDDEN,
        "num_heads": HEADS,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if version == "2":
        vision.update(embed_dim=HIDDEN, mlp_ratio=2)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    else:
        vision.update(intermediate_size=2 * HIDDEN, out_hidden_size=HIDDEN, window_size=56, fullatt_block_indexes=[0])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    text = _text_kwargs(tokenizer, text_layers) | {
        # M-RoPE: the head_dim / 2 = 8 rotary frequencies split over (time, height, width).
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    return _finish(model_class, config, tokenizer, seed), processor


def build_tiny_qwen2_vl(seed: int = 0, text_layers: int = 1):
    """Qwen2-VL: 14-pixel patches, 2x2 merge; a square image becomes 56x56, i.e. 16 ``pixel_values`` rows and 4
    ``<|image_pad|>`` tokens between ``<|vision_start|>`` and ``<|vision_end|>``. 3-D M-RoPE positions, computed by the
    model from ``mm_token_type_ids`` (required with images) when ``position_ids`` is not given."""
    return _build_qwen(seed, text_layers, "2")


def build_tiny_qwen2_5_vl(seed: int = 0, text_layers: int = 1):
    """Qwen2.5-VL: as :func:`build_tiny_qwen2_vl` with the 2.5 vision tower (windowed attention, one full block)."""
    return _build_qwen(seed, text_layers, "2.5")


def build_tiny_gemma3(seed: int = 0, text_layers: int = 1):
    """Gemma3: a 28x28 SigLIP image of 7-pixel patches pooled to 4 ``<image_soft_token>`` tokens; an image part renders
    as ``<start_of_image>``, which the processor expands to ``\\n\\n<start_of_image>`` + 4 soft tokens +
    ``<end_of_image>\\n\\n``. ``token_type_ids`` marks the image tokens (bidirectional attention among them)."""
    tokenizer = _tokenizer(
        {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
        template=image_chat_template("<start_of_image>"),
    )
    tokens_per_image = 4
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=tokens_per_image,
    )
    text = _text_kwargs(tokenizer, text_layers) | {
        "num_key_value_heads": 1,
        "head_dim": HIDDEN // HEADS,
        "query_pre_attn_scalar": HIDDEN // HEADS,
        "layer_types": ["full_attention"] * text_layers,
        "sliding_window": 16,
    }
    vision = dict(SIGLIP_LIKE_VISION)
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        tie_word_embeddings=True,
    )

    def randomize_projection(model):
        # Gemma3 initializes its image projection to zeros, which would make every image embedding 0 and leave the
        # vision tower without gradients.
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)

    return _finish(Gemma3ForConditionalGeneration, config, tokenizer, seed, randomize_projection), processor


def build_tiny_llava_next(seed: int = 0, text_layers: int = 1):
    """LLaVA-Next: the demo's stand-in vision-language model (:func:`targetpo.demo.build_tiny_vision_chat_model`: 28x28
    crops, the base crop plus two per image, ``<image>`` expanded to 10 to 16 tokens), with this module's positions."""
    return build_tiny_vision_chat_model(seed, text_layers, max_positions=MAX_POSITIONS)


#: The <row_x_col_y> tags an Idefics3 processor writes before each tile of a split image (up to 6x6 tiles).
_ROW_COL_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))


def _build_idefics(seed: int, text_layers: int, smol: bool, hidden: int = HIDDEN):
    named = {
        "image_token": "<image>",
        "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>",
        "end_of_utterance_token": "<end_of_utterance>",
    }
    tokenizer = _tokenizer(named, _ROW_COL_TOKENS, image_chat_template("<image>"))
    image_kwargs = {
        "do_image_splitting": False,
        "size": {"longest_edge": 28},
        "max_image_size": {"longest_edge": 28},
    }
    # A 28x28 image of 7-pixel patches: 16 patches, pixel-shuffled by 2 into 4 <image> tokens (image_seq_len).
    tokens_per_image = 4
    image_processor_class, processor_class = (
        (SmolVLMImageProcessorPil, ImageOnlySmolVLMProcessor)
        if smol
        else (Idefics3ImageProcessorPil, Idefics3Processor)
    )
    processor = processor_class(
        image_processor=image_processor_class(**image_kwargs),
        tokenizer=tokenizer,
        image_seq_len=tokens_per_image,
        chat_template=tokenizer.chat_template,
    )
    vision = {**SIGLIP_LIKE_VISION, "hidden_size": hidden, "intermediate_size": 2 * hidden}
    config_class, vision_class, model_class = (
        (SmolVLMConfig, SmolVLMVisionConfig, SmolVLMForConditionalGeneration)
        if smol
        else (Idefics3Config, Idefics3VisionConfig, Idefics3ForConditionalGeneration)
    )
    config = config_class(
        # Tied on the text config too: vLLM reads it there (untied, it would leave its output head unloaded).
        text_config=LlamaConfig(**_text_kwargs(tokenizer, text_layers, hidden), tie_word_embeddings=True),
        vision_config=vision_class(**vision),
        image_token_id=tokenizer.image_token_id,
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return _finish(model_class, config, tokenizer, seed), processor


def build_tiny_idefics3(seed: int = 0, text_layers: int = 1, hidden: int = HIDDEN):
    """Idefics3 (SmolVLM v1's architecture): images resized to at most 28x28 and not split; 7-pixel patches
    pixel-shuffled by 2 into 4 ``<image>`` tokens, rendered as ``<fake_token_around_image><global-img>`` + 4
    ``<image>`` + ``<fake_token_around_image>``. ``pixel_values`` is (samples, images, 3, H, W) with a
    ``pixel_attention_mask`` (samples, images, H, W). ``hidden=128`` gives heads of 64 dimensions, which vLLM's CPU
    attention kernel takes (it refuses 16)."""
    return _build_idefics(seed, text_layers, smol=False, hidden=hidden)


def build_tiny_smolvlm(seed: int = 0, text_layers: int = 1):
    """SmolVLM (v2): as :func:`build_tiny_idefics3` with the SmolVLM classes and an image-only processor."""
    return _build_idefics(seed, text_layers, smol=True)


BUILDERS = {
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "gemma3": build_tiny_gemma3,
    "llava_next": build_tiny_llava_next,
    "idefics3": build_tiny_idefics3,
    "smolvlm": build_tiny_smolvlm,
}


def build_tiny_vlm(architecture: str, seed: int = 0, *, text_layers: int = 1):
    """A tiny ``(model, processor)`` pair of ``architecture`` (one of :data:`ARCHITECTURES`), random weights from
    ``seed``: the same seed gives the same weights, and the global RNG is left as it was.

    With one text layer, text positions never see how image positions attend to each other (they read the image
    tokens' layer-0 keys and values only), so e.g. dropping Gemma3's ``token_type_ids`` changes no text logit; pass
    ``text_layers=2`` where a test must see that.
    """
    if architecture not in BUILDERS:
        raise ValueError(f"Unknown architecture {architecture!r}; choose one of {ARCHITECTURES}.")
    return BUILDERS[architecture](seed, text_layers)
