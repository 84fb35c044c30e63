"""The trainer's token log-probs of a rollout's completions: which rows go through the model, their images, and the
settings (temperature, suppressed tokens, chunked, Triton or Liger head) that make them the log-probs sampling saw.

The kernels themselves (``completion_logps``, ``packed_completion_logps``) live in ``modeling``; this module decides
what to feed them, and whether rows go through the model packed (``padding_free``) or padded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..batch import COMPLETION_ALIGNED, PROMPT_ALIGNED
from ..modeling.loading import forward_accepts_position_ids, is_peft_model
from ..modeling.logps import (
    completion_logps,
    liger_head_problem,
    packed_completion_logps,
    shared_prompt_completion_logps,
    triton_head_problem,
)
from ..modeling.output_head import chunked_head_problem
from ..modeling.packing import gpu_packing_cost, model_packing_problem, rows_packing_problem
from ..modeling.shared_prompt import model_sharing_problem, prompt_runs
from ..modeling.vision import SELF_POSITIONED_KEYS, collate_pixel_inputs
from .token_budget import joined_by_rows, pass_row_masks, pass_token_shares

#: The four tensors every batch of rows has, in ``completion_logps``'s order.
ROW_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")


class TokenLogps(NamedTuple):
    """A forward pass's per-token completion log-probs, entropies (or None) and router aux loss (or None)."""

    per_token: torch.Tensor
    entropies: torch.Tensor | None
    aux_loss: torch.Tensor | None


class PolicyLogps:
    """Per-token completion log-probs of rollout rows under a model (the policy, its old self or the reference)."""

    def __init__(
        self,
        temperature: float,
        suppressed_token_ids: torch.Tensor,
        use_position_ids: bool,
        chunk_size: int | None,
        liger: bool,
        rows_per_pass: int,
        padding_free: bool = False,
        head_kernel: str = "torch",
        token_budget: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        share_prompts: bool = False,
    ):
        self.temperature = temperature
        self.suppressed_token_ids = suppressed_token_ids  # tokens sampling never picks get no probability here either
        self.use_position_ids = use_position_ids
        self.chunk_size = chunk_size
        self.liger = liger
        self.rows_per_pass = rows_per_pass
        self.padding_free = padding_free
        self.head_kernel = head_kernel
        self.token_budget = token_budget  # max_tokens_per_micro_batch: the passes without gradient are cut by it too
        # The mixed precision the model's forward runs under (the accelerator's): a chunked head, called outside the
        # forward, then computes as the model's own head would, in bf16 under bf16=True with float32 master weights.
        self.autocast = autocast
        self.share_prompts = share_prompts  # share_prompt_forward: each prompt read once for the rows that share it
        self._model_packing_problems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> str | None
        self._model_sharing_problems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> str | None
        self._noted: set[tuple[str, str, str]] = set()  # the reasons a warning has given

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        unwrapped: nn.Module,
        temperature: float,
        suppressed: set[int],
        device: torch.device,
        sharded: bool,
        use_liger_kernel: bool,
        chunk_size: int | None,
        rows_per_pass: int,
        padding_free: bool = False,
        head_kernel: str = "torch",
        token_budget: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        share_prompts: bool = False,
    ) -> PolicyLogps:
        """The settings that fit ``model`` (as the trainer wraps it): chunks, Liger and the Triton head only where
        they are exact."""
        # Chunked log-probs call the output head outside the model's forward, which sharded weights do not allow.
        asked_chunk_size = chunk_size
        chunk_size = chunk_size if chunk_size and not sharded and _chunked_head_applies(model, chunk_size) else None
        liger = use_liger_kernel and _liger_can_compute_logps(model, sharded, bool(suppressed))
        if liger:
            chunk_size = chunk_size or 512  # the entropy metric is still computed in chunks
        triton_problem = _triton_logps_problem(model, sharded, asked_chunk_size)
        if head_kernel == "auto":
            head_kernel = auto_head_kernel(device, liger, triton_problem)
        elif head_kernel == "triton" and triton_problem is not None:
            warnings.warn(
                f"logps_head_kernel='triton': the log-probs are computed by torch instead because {triton_problem}.",
                stacklevel=4,
            )
            head_kernel = "torch"
        packing_cost = gpu_packing_cost(unwrapped, device) if padding_free else None
        if packing_cost is not None:
            warnings.warn(packing_cost, stacklevel=4)
        suppressed_ids = torch.tensor(sorted(suppressed), dtype=torch.long, device=device)
        use_position_ids = forward_accepts_position_ids(unwrapped)
        return cls(
            temperature,
            suppressed_ids,
            use_position_ids,
            chunk_size,
            liger,
            rows_per_pass,
            padding_free,
            head_kernel,
            token_budget,
            autocast,
            share_prompts,
        )

    def __call__(
        self,
        model: nn.Module,
        batch: Mapping[str, Any],
        with_entropy: bool = False,
        rows: torch.Tensor | None = None,
        entropy_grad: bool = False,
        router_aux_loss: bool = False,
    ) -> TokenLogps:
        """Log-probs (and entropies) of ``batch`` under ``model``, as sampling saw them.

        With ``rows`` (bool), only those rows go through the model; the others read 0 and carry no gradient.
        ``batch`` may be a plain mapping of the four ``ROW_TENSORS``.
        """
        selected = _selected_rows(batch, rows)
        take = (lambda value: value) if selected is None else (lambda value: value[selected])
        pixel_inputs = batch.get("pixel_inputs")
        image_inputs, prompt_aligned, completion_aligned = _image_inputs(batch, selected, take)
        rows_tensors = [take(batch[key]) for key in ROW_TENSORS]
        settings = {
            "temperature": self.temperature,
            "with_entropy": with_entropy,
            "entropy_grad": entropy_grad,
            "router_aux_loss": router_aux_loss,
            "suppressed_token_ids": self.suppressed_token_ids,
            "chunk_size": self.chunk_size,
            "liger": self.liger,
            "head_kernel": self.head_kernel,
        }
        packed = self._packs(model, rows_tensors, with_images=pixel_inputs is not None)
        shared = not packed and self._shares_prompts(model, rows_tensors, pixel_inputs is not None, router_aux_loss)
        with self.autocast():
            if packed:
                results = packed_completion_logps(model, *rows_tensors, **settings)
            elif shared:
                del settings["router_aux_loss"]
                results = shared_prompt_completion_logps(model, *rows_tensors, **settings)
            else:
                results = completion_logps(
                    model,
                    *rows_tensors,
                    image_inputs=image_inputs,
                    prompt_aligned=prompt_aligned,
                    completion_aligned=completion_aligned,
                    # A model with multimodal rotary positions numbers a prompt with images itself, as generation did.
                    use_position_ids=self.use_position_ids
                    and not (image_inputs and any(key in image_inputs for key in SELF_POSITIONED_KEYS)),
                    **settings,
                )
        logps, entropies = results[:2]
        aux_loss = results[2] if router_aux_loss else None
        if selected is not None:
            logps, entropies = (_scatter_rows(value, selected, batch) for value in (logps, entropies))
        return TokenLogps(logps, entropies, aux_loss)

    def packs(self, model: nn.Module, batch: Mapping[str, Any]) -> bool:
        """Whether ``batch``'s rows go through ``model`` packed (a pass's cost in tokens depends on it)."""
        rows_tensors = [batch[key] for key in ROW_TENSORS]
        return self._packs(model, rows_tensors, with_images=batch.get("pixel_inputs") is not None)

    def token_passes(
        self, model: nn.Module, batch: Any, rows: torch.Tensor | None, group_size: int | None = None
    ) -> list[torch.Tensor]:
        """``rows`` of ``batch`` (bool; None: all) cut into passes of at most ``token_budget`` tokens, as row masks
        (``token_budget.pass_row_masks``); with ``group_size`` a group's rows share a pass."""
        packed = self.packs(model, batch)
        prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_attention_mask"]
        return pass_row_masks(prompt_mask, completion_mask, rows, self.token_budget, packed, group_size)

    def by_passes(self, model: nn.Module, batch: Any, passes: list[torch.Tensor], **settings: Any) -> TokenLogps:
        """:meth:`__call__` over each pass's rows (bool masks), put together and detached (for passes without
        gradient): every row's values from its pass. A router's loss is each pass's weighted by its share of the
        passes' tokens (``pass_token_shares``)."""
        shares = pass_token_shares(batch["prompt_mask"], batch["completion_attention_mask"], passes)
        parts = [self(model, batch, rows=rows, **settings) for rows in passes]
        per_token, entropies = (joined_by_rows(values, passes) for values in zip(*(part[:2] for part in parts)))
        aux_losses = [share * part.aux_loss for share, part in zip(shares, parts) if part.aux_loss is not None]
        aux_loss = torch.stack(aux_losses).sum() if aux_losses else None
        return TokenLogps(per_token, entropies, aux_loss)

    def _packs(self, model: nn.Module, rows_tensors: list[torch.Tensor], with_images: bool) -> bool:
        """Whether the rows go through ``model`` packed: with ``padding_free``, where it gives the padded pass's
        log-probs; where it would not, a warning says why, once for each reason."""
        if not self.padding_free:
            return False
        if model not in self._model_packing_problems:  # before any check of the rows: every process probes together
            self._model_packing_problems[model] = model_packing_problem(model)
        subject, problem = f"{type(getattr(model, 'module', model)).__name__}'s", self._model_packing_problems[model]
        if problem is None:
            subject, problem = "these", _rows_padded_only(rows_tensors, with_images)
        self._note_padded_rows("padding_free", subject, problem, "not packed ones")
        return problem is None

    def _shares_prompts(
        self, model: nn.Module, rows_tensors: list[torch.Tensor], with_images: bool, router_aux_loss: bool
    ) -> bool:
        """Whether the rows go through ``model`` with each prompt read once for the consecutive rows that share it:
        with ``share_prompts``, where it gives the padded pass's log-probs and some rows share a prompt; where it
        would not give them, a warning says why, once for each reason."""
        if not self.share_prompts:
            return False
        if model not in self._model_sharing_problems:  # probed once: a forward pass of two short rows
            can_probe = self.chunk_size is not None
            self._model_sharing_problems[model] = model_sharing_problem(model) if can_probe else None
        subject, problem = f"{type(getattr(model, 'module', model)).__name__}'s", self._model_sharing_problems[model]
        if problem is None and self.chunk_size is None:
            problem = (
                "the output head cannot run on the final hidden states (logps_chunk_size=0, sharded weights, or "
                "logits that are not the head applied to them)"
            )
        if problem is None:
            subject, problem = "these", _rows_padded_only(rows_tensors, with_images)
            if router_aux_loss and not with_images:  # the images, then the router, then the rows: the first named
                problem = "the router's load-balancing loss counts every row's prompt tokens"
        self._note_padded_rows("share_prompt_forward", subject, problem, "each reading its prompt")
        # Rows that share no prompt (one completion per prompt in this batch) are the padded pass itself.
        return problem is None and len(prompt_runs(rows_tensors[0], rows_tensors[1]).firsts) < len(rows_tensors[0])

    def _note_padded_rows(self, setting: str, subject: str, problem: str | None, instead: str) -> None:
        """A warning, once for each reason, that ``setting`` falls back to padded rows because of ``problem``."""
        if problem is not None and (setting, subject, problem) not in self._noted:
            self._noted.add((setting, subject, problem))
            warnings.warn(
                f"{setting}: {subject} log-probs are computed from padded rows, {instead}, because {problem}. They "
                "are the same values, computed with padding.",
                stacklevel=4,
            )

    def batched(self, model: nn.Module, batch: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probs of a whole rollout, a training micro-batch (or with ``token_budget``, a pass of at most that many
        tokens) at a time; with ``rows`` (bool), of those rows only (the others read 0)."""
        if self.token_budget is not None:
            return self.by_passes(model, batch, self.token_passes(model, batch, rows)).per_token
        parts = []
        for start in range(0, len(batch), self.rows_per_pass):
            part = slice(start, start + self.rows_per_pass)
            parts.append(self(model, batch.rows(part), rows=None if rows is None else rows[part]).per_token)
        return torch.cat(parts)

    def of_reference(
        self, batch: Any, reference: nn.Module | None, policy: nn.Module, unwrap: Callable[[nn.Module], nn.Module]
    ) -> torch.Tensor:
        """The reference's log-probs: its frozen copy's, or under PEFT the policy's with its adapters switched off."""
        if reference is not None:
            return self.batched(reference, batch)
        with unwrap(policy).disable_adapter():
            return self.batched(policy, batch)


def _rows_padded_only(rows_tensors: list[torch.Tensor], with_images: bool) -> str | None:
    """Why these rows can go through the model only padded (neither packed nor with shared prompts), or None."""
    if with_images:
        return "the prompts have images, whose inputs are laid out along the padded rows"
    return rows_packing_problem(rows_tensors[1], rows_tensors[3])


def _image_inputs(
    batch: Mapping[str, Any], selected: torch.Tensor | None, take: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """Prompts with images: the selected rows' pixels collated, and the per-token extras of prompts and completions;
    three Nones without images."""
    pixel_inputs = batch.get("pixel_inputs")
    if pixel_inputs is None:
        return None, None, None
    pixel_rows = pixel_inputs if selected is None else [pixel_inputs[i] for i in selected.tolist()]
    # Read by key: `batch` may be a dict copy of a record.
    prompt_aligned, completion_aligned = (
        {key[len(prefix) :]: take(value) for key, value in batch.items() if key.startswith(prefix)}
        for prefix in (PROMPT_ALIGNED, COMPLETION_ALIGNED)
    )
    return collate_pixel_inputs(pixel_rows), prompt_aligned, completion_aligned


def _selected_rows(batch: Mapping[str, Any], rows: torch.Tensor | None) -> torch.Tensor | None:
    """Indices of the rows to pass through the model; None: all of them."""
    if rows is None or bool(rows.all()):
        return None
    if rows.any():
        return rows.nonzero().squeeze(-1)
    # Still one (the shortest) row through the model, masked out of the loss by the caller: every parameter then gets
    # a zero gradient, as the full computation gives it. Without one, DDP and ZeRO wait for gradients that never come,
    # and the optimiser would skip its step (momentum, weight decay) instead.
    lengths = batch["prompt_mask"].sum(dim=1) + batch["completion_attention_mask"].sum(dim=1)
    return lengths.argmin().reshape(1)


def _scatter_rows(values: torch.Tensor | None, selected: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The selected rows' values in place, 0 for every other row of ``batch``."""
    if values is None:
        return None
    return values.new_zeros(batch["completion_ids"].shape).index_copy(0, selected, values)


def _chunked_head_applies(model: nn.Module, chunk_size: int) -> bool:
    """Whether ``model``'s head may run on its final hidden states, ``chunk_size`` positions at a time
    (:func:`chunked_head_problem`); where it may not, a warning names the model and why."""
    problem = chunked_head_problem(model)
    if problem is not None:
        unwrapped = getattr(model, "module", model)  # DDP
        name = type(unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped).__name__
        warnings.warn(
            f"logps_chunk_size={chunk_size}: {name}'s log-probs are computed from one full logits tensor, not "
            f"{chunk_size} positions at a time from its final hidden states, because {problem}. Chunks would give "
            "wrong log-probs for it; the full logits give the right ones, at the memory of the (batch, length, "
            "vocabulary) logits.",
            stacklevel=5,
        )
    return problem is None


def _liger_can_compute_logps(model: nn.Module, sharded: bool, suppresses_tokens: bool) -> bool:
    """Whether Liger's fused kernel can compute the log-probs exactly; if not, a warning says why."""
    if sharded:
        problem = "the weights are sharded (ZeRO-3 or FSDP2) and the kernel needs the whole output head"
    elif suppresses_tokens:
        problem = "generation suppresses tokens, which the kernel cannot leave out of the softmax"
    else:
        problem = liger_head_problem(model)
    if problem is not None:
        warnings.warn(
            f"use_liger_kernel: the training log-probs do not use Liger's fused kernel because {problem}; they "
            "are computed by targetpo's chunked head instead.",
            stacklevel=5,
        )
    return problem is None


def _triton_logps_problem(model: nn.Module, sharded: bool, chunk_size: int | None) -> str | None:
    """Why the Triton head cannot compute the log-probs (it needs a chunked plain linear head), or None."""
    if sharded:
        return "the weights are sharded (ZeRO-3 or FSDP2) and the kernels need the whole output head"
    if not chunk_size:
        return "logps_chunk_size=0 asks for one full logits tensor, computed by the model"
    return triton_head_problem(model)


def auto_head_kernel(device: torch.device, liger: bool, triton_problem: str | None) -> str:
    """``logps_head_kernel="auto"``: the Triton head on an NVIDIA GPU of compute capability 8.0 or above (Ampere and
    later) where it applies and its kernels run, torch everywhere else.

    On one H200 the Triton head took the bf16 training step from 1.51x TRL's time to 0.96x (docs/benchmarks.md); on
    the CPU its kernels only run in Triton's interpreter, far slower than torch. Older and non-NVIDIA GPUs were never
    measured. A GPU where the kernels fail to compile or launch (no C compiler, say) gets torch, with a warning saying
    why, since that is fixable."""
    if device.type != "cuda" or torch.version.hip is not None or liger or triton_problem is not None:
        return "torch"
    if importlib.util.find_spec("triton") is None or torch.cuda.get_device_capability(device) < (8, 0):
        return "torch"
    try:
        from ..modeling.triton_head import launch_problem
    except ImportError as error:  # a Triton that does not match this torch, say
        problem = f"ImportError: {error}"
    else:
        problem = launch_problem(device)
    if problem is not None:
        warnings.warn(
            f"logps_head_kernel='auto': torch computes the output head because Triton's kernels failed to run on "
            f"this GPU ({problem}). Fix Triton's set-up to get its head, or set logps_head_kernel='torch' to "
            "silence this.",
            stacklevel=5,  # auto_head_kernel, for_model, the trainer's set-up, its __init__, the user's code
        )
        return "torch"
    return "triton"
