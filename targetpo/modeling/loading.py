"""Models and tokenizers: loading the policy, its processing class and tokenizer, PEFT wrapping, the frozen
reference, the float32 output head, and the prompt-length limit a model's positions set."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .vision import is_processor


def from_pretrained_or_explain(loader: Any, name_or_path: str, what: str, **kwargs: Any) -> Any:
    """``loader.from_pretrained`` with an error that says what to do when the files cannot be found or fetched."""
    try:
        return loader.from_pretrained(name_or_path, **kwargs)
    except OSError as error:
        raise OSError(
            f"Could not load the {what} {name_or_path!r}: it is not a local directory and could not be fetched from the "
            "Hugging Face Hub (no network, a wrong name, or a gated repository). Pass a local path, or set HF_HUB_OFFLINE=1 "
            f"with the files already in the cache. Cause: {error}"
        ) from error


def model_identifier(model: PreTrainedModel) -> str | None:
    """The id or path a model was loaded from, or None for a model built from a config."""
    name = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return name or None


def is_vision_language(config: Any) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def load_policy(
    model: str | PreTrainedModel, model_init_kwargs: dict[str, Any] | None, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The policy: loaded from an id or path with ``model_init_kwargs``, or the given model as it is."""
    if isinstance(model, str):
        kwargs = {"trust_remote_code": trust_remote_code, **(model_init_kwargs or {})}
        for key in ("dtype", "torch_dtype"):
            if isinstance(kwargs.get(key), str) and kwargs[key] != "auto":
                kwargs[key] = getattr(torch, kwargs[key])
        config = from_pretrained_or_explain(
            AutoConfig, model, "model", trust_remote_code=trust_remote_code, revision=kwargs.get("revision")
        )
        loader = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        return from_pretrained_or_explain(loader, model, "model", **kwargs)
    if model_init_kwargs:
        raise ValueError(
            "model_init_kwargs only applies when `model` is an id or path; the model passed is already built."
        )
    if not isinstance(model, (PreTrainedModel, nn.Module)) or not hasattr(model, "generate"):
        raise TypeError(
            f"`model` must be a model id, a path or a PreTrainedModel for causal LM, got {type(model).__name__}."
        )
    return model


def load_policy_and_processing(
    model: str | PreTrainedModel, processing_class: Any, args: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Any]:
    """The policy, its tokenizer, and a vision-language model's processor (which encodes prompts with images and
    renders them with its chat template; None for other models), each as given or loaded from the model's id."""
    policy = load_policy(model, args.model_init_kwargs, args.trust_remote_code)
    processing_class = load_processing_class(policy, processing_class, args.trust_remote_code)
    tokenizer = load_tokenizer(policy, processing_class, args.trust_remote_code)
    return policy, tokenizer, processing_class if is_processor(processing_class) else None


def load_processing_class(model: PreTrainedModel, processing_class: Any, trust_remote_code: bool = False) -> Any:
    """``processing_class`` as given; for a vision-language model given without one, its processor (which encodes
    images as well as text). Other models' tokenizers are loaded by :func:`load_tokenizer`."""
    if processing_class is not None or not is_vision_language(getattr(model, "config", None)):
        return processing_class
    name = model_identifier(model)
    if name is None:
        raise ValueError(
            "The vision-language model was built from a config and has no processor to load: pass `processing_class=` "
            "its processor (e.g. `AutoProcessor.from_pretrained(...)`)."
        )
    return from_pretrained_or_explain(AutoProcessor, name, "processor", trust_remote_code=trust_remote_code)


def load_tokenizer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, set up for generation: left padding and a pad token (EOS when it has none)."""
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        # A multimodal processor wraps its tokenizer; rollouts only need the tokenizer.
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    tokenizer = model_tokenizer(
        model,
        tokenizer,
        trust_remote_code,
        "tokenizer",
        "The model was built from a config and has no tokenizer to load: pass `processing_class=` a tokenizer.",
    )
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no EOS token: set `tokenizer.eos_token` so completions can end.")
    tokenizer.padding_side = "left"
    return tokenizer


def model_tokenizer(
    model: PreTrainedModel, tokenizer: Any, trust_remote_code: bool, what: str, when_built_from_config: str
) -> Any:
    """``tokenizer``, or else the one saved with ``model`` (``when_built_from_config`` is the error when the model has
    no id to load it from), with a pad token: its EOS token when it has none."""
    if tokenizer is None:
        name = model_identifier(model)
        if name is None:
            raise ValueError(when_built_from_config)
        tokenizer = from_pretrained_or_explain(AutoTokenizer, name, what, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: rollout and training log-probs then come from the same function."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention modules read it per call
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "attention_dropout", None), float):
        config.attention_dropout = 0.0


def apply_peft(model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool) -> nn.Module:
    """Wrap the model with trainable adapters; only the adapter weights will train."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as error:
        raise ImportError("`peft_config` needs the peft package: pip install 'targetpo[peft]'.") from error
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"`peft_config` must be a peft.PeftConfig, got {type(peft_config).__name__}.")
    if gradient_checkpointing:
        # Frozen embeddings give activations without grad; checkpointed adapters then receive no gradient.
        model.enable_input_require_grads()
    return get_peft_model(model, peft_config)


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def frozen_reference(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of the policy, in eval mode, for the KL penalty."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def matmul_dtype(device: torch.device, weight: torch.Tensor) -> torch.dtype:
    """The dtype a linear head's matrix products run in: autocast's where it is on (as ``nn.Linear`` would run, so
    float32 master weights under ``bf16=True`` compute in bf16), else the weight's (float64 too: autocast leaves it)."""
    if torch.is_autocast_enabled(device.type) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


class Float32OutputHead(nn.Linear):
    """A linear output head that computes in float32, from float32 inputs, under autocast too (which would run an
    ``nn.Linear`` in bf16 under ``bf16=True``).

    ``cast_lm_head_to_fp32`` gives the head this class. A head tied to the input embeddings keeps the shared weight in
    its dtype (casting it would cast the embeddings too): the cast happens inside each forward pass, and the gradient
    reaches the shared weight in its own dtype.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(hidden.device.type, enabled=False):
            return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def cast_output_head_to_fp32(model: nn.Module) -> None:
    """Compute the output head in float32, feeding it float32 hidden states; the rest keeps its precision.

    Its logits, and so the token log-probs, are then computed in float32 even when the model runs in bf16, under
    autocast too. The head becomes a :class:`Float32OutputHead`: an untied one with float32 weights, a head tied to
    the input embeddings still sharing them in their dtype.
    """
    base = model.get_base_model() if is_peft_model(model) else model
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError("cast_lm_head_to_fp32=True needs a model with an output head (`get_output_embeddings()`).")
    # PEFT's modules_to_save keeps the original head and a trained copy per adapter, and calls the active one.
    linears = [head.original_module, *head.modules_to_save.values()] if _saves_modules(head) else [head]
    for linear in linears:
        # Its forward becomes a float32 nn.Linear's, which would bypass another class's or a replaced one's.
        if type(linear) is not nn.Linear:
            raise ValueError(
                f"cast_lm_head_to_fp32=True needs a plain torch.nn.Linear output head, got {type(linear).__name__}. "
                "Set cast_lm_head_to_fp32=False."
            )
        if "forward" in vars(linear) or hasattr(linear, "_hf_hook"):
            raise ValueError(
                "cast_lm_head_to_fp32=True needs an output head that computes with torch.nn.Linear's forward; this "
                "one's forward is replaced (accelerate's device_map dispatch or offloading). Load the model on one "
                "device, or set cast_lm_head_to_fp32=False."
            )
    for linear in linears:
        if embeddings is None or linear.weight is not embeddings.weight:
            linear.float()
        linear.__class__ = Float32OutputHead  # a class, not a patched forward, so copies (the reference) keep it


def _saves_modules(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's ``modules_to_save`` wrapper (an original module and a trained copy per adapter)."""
    return isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict) and hasattr(module, "original_module")


def module_in_use(module: nn.Module) -> nn.Module:
    """The module a PEFT wrapper calls in its place: for ``modules_to_save``, the active adapter's trained copy (the
    original where adapters are off or the active one has no copy here); for trainable tokens, the token adapter;
    ``module`` itself for any other module."""
    if _saves_modules(module):
        active = module.active_adapters
        if module.disable_adapters or not active or active[0] not in module.modules_to_save:
            return module.original_module
        return module.modules_to_save[active[0]]
    token_adapter = getattr(module, "token_adapter", None)
    if isinstance(token_adapter, nn.Module) and hasattr(module, "original_module"):
        return token_adapter
    return module


@torch.no_grad()
def mix_weights_into(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """``target <- alpha * source + (1 - alpha) * target``, parameter by parameter (matched by name)."""
    source_parameters = dict(source.named_parameters())
    for name, parameter in target.named_parameters():
        parameter.lerp_(source_parameters[name].detach().to(parameter.dtype), alpha)


def forward_accepts_position_ids(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's forward takes ``position_ids``; PEFT wrappers are looked through."""
    if is_peft_model(model):
        model = model.get_base_model()
    forward = getattr(model, "forward", None)
    try:
        return "position_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def max_positions(model: nn.Module) -> int | None:
    """The model's context length (``max_position_embeddings``), from a composite model's text config if it has one;
    None when the config does not say. A PEFT model hands on its base model's config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for each in (text_config, config):
        positions = getattr(each, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            return positions
    return None


def prompt_token_limit(
    max_prompt_length: int | None, max_completion_length: int, positions: int | None, warn_if_lowered: bool = True
) -> int | None:
    """The most prompt tokens a rollout keeps: ``max_prompt_length``, lowered so prompt and completion fit the model.

    Refuses a ``max_completion_length`` that leaves no room for a prompt; warns when a ``max_prompt_length`` the user
    set (``warn_if_lowered``) is lowered. None (no limit) takes the room without a word: prompts cut to it are
    reported when they are cut (:class:`PromptLimit`).
    """
    if positions is None:
        return max_prompt_length
    if max_completion_length >= positions:
        raise ValueError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt: the model has {positions} "
            f"positions (max_position_embeddings) for prompt and completion together. Set max_completion_length "
            f"below {positions}, leaving room for the prompts."
        )
    room = positions - max_completion_length
    if max_prompt_length is not None and max_prompt_length <= room:
        return max_prompt_length
    if max_prompt_length is not None and warn_if_lowered:
        warnings.warn(
            f"max_prompt_length={max_prompt_length} and max_completion_length={max_completion_length} exceed the "
            f"model's {positions} positions, so prompts longer than {room} tokens keep their last {room}. Set "
            f"max_prompt_length to at most {room}, or lower max_completion_length.",
            stacklevel=3,
        )
    return room


class PromptLimit:
    """The most prompt tokens a rollout keeps (``tokens``; None: no limit), and a warning the first time prompts are
    cut to it.

    ``max_prompt_length`` is lowered so prompt and completion fit the model's ``positions``; only a value the user set
    (not ``prompt_length_is_default``) is warned about at once, since the default binds nothing until a prompt is cut.
    """

    def __init__(
        self,
        max_prompt_length: int | None,
        max_completion_length: int,
        positions: int | None,
        prompt_length_is_default: bool = False,
    ):
        self.tokens = prompt_token_limit(
            max_prompt_length, max_completion_length, positions, warn_if_lowered=not prompt_length_is_default
        )
        if self.tokens == max_prompt_length:
            self._why = f"max_prompt_length={max_prompt_length}"
        else:
            self._why = (
                f"the model's {positions} positions less max_completion_length={max_completion_length}; "
                f"max_prompt_length={max_prompt_length}"
            )
        self._reported = False

    def report_cut(self, num_cut: int, num_prompts: int) -> None:
        """Warn, the first time any are, that ``num_cut`` of a rollout's ``num_prompts`` distinct prompts were cut."""
        if num_cut == 0 or self._reported:
            return
        self._reported = True
        warnings.warn(
            f"{num_cut} of the {num_prompts} prompts of a rollout are longer than {self.tokens} tokens ({self._why}) "
            f"and keep only their last {self.tokens}. Drop or shorten such prompts (e.g. `dataset.filter(...)` on "
            "their token count), or make room: raise max_prompt_length or lower max_completion_length within the "
            "model's positions. Later cuts are not reported.",
            stacklevel=3,
        )


def prepare_policy(policy: nn.Module, args: Any, peft_config: Any = None) -> tuple[nn.Module, nn.Module | None]:
    """The policy as it trains (fp32 output head, PEFT adapters, no dropout, as ``args`` say) and its frozen reference
    copy, or None: without a KL term (``beta=0``), or under PEFT, where the reference is the same network with its
    adapters switched off."""
    if args.cast_lm_head_to_fp32:  # before the reference is copied from the policy, so it has the same head
        cast_output_head_to_fp32(policy)
    if peft_config is not None:
        policy = apply_peft(policy, peft_config, args.gradient_checkpointing)
    if args.disable_dropout:
        disable_dropout(policy)
    reference = frozen_reference(policy) if args.beta > 0 and not is_peft_model(policy) else None
    return policy, reference
