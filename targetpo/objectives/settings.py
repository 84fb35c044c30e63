"""What each loss asks of the run's settings, known before any objective is built: whether it is a softmax over each
prompt group (TPO: a group's rows train together, and groups split over micro-steps need their softmax known ahead),
which settings it warns about, and how the block that says what trains names it. Plain Python: the config, the
step's layout and the run summary read it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .. import functional as F

#: The loss whose objective is the cross-entropy to the target q over whole groups.
TARGET_LOSS = "tpo"


def trains_whole_groups(loss_type: str) -> bool:
    """Whether the loss is a softmax over each prompt group (TPO), so a group's rows must be trained together."""
    return loss_type == TARGET_LOSS


def loss_description(args: Any) -> str:
    """The loss, with η for TPO, and the KL term when beta > 0."""
    if args.loss_type == TARGET_LOSS:
        loss = f"tpo (target temperature η = {args.tpo_target_temperature:g})"
    else:
        loss = f"{args.loss_type} (GRPO family)"
    return loss if args.beta == 0 else f"{loss} + KL to the reference, β = {args.beta:g}"


def _tpo_warnings(args: Any) -> list[str]:
    if args.importance_sampling_level != "token" or args.delta is not None:
        return [
            "importance_sampling_level and delta shape the GRPO-family losses; loss_type='tpo' fits the policy to "
            "its target q without an importance ratio, so they have no effect."
        ]
    return []


def _luspo_warnings(args: Any) -> list[str]:
    if args.importance_sampling_level != "sequence":
        return [
            "loss_type='luspo' scales GSPO's sequence ratios: set importance_sampling_level='sequence' as LUSPO does."
        ]
    return []


def _vespo_warnings(args: Any) -> list[str]:
    if args.importance_sampling_level != "token":
        return [
            "loss_type='vespo' builds its sequence weight from the token ratios itself; importance_sampling_level "
            "has no effect on it. Leave it at 'token'."
        ]
    return []


def _cispo_warnings(args: Any) -> list[str]:
    if args.epsilon_high is None:
        return [
            f"loss_type='cispo' caps the importance weights at epsilon_high, which defaults to epsilon "
            f"({args.epsilon}): every weight is then below 1. CISPO recommends epsilon_high=5.0."
        ]
    return []


#: The losses that sum a sequence's token losses and divide by a token count: a sequence-level ratio then weights
#: each sequence by its length (VESPO aside: it builds its sequence weight itself, and its own warning says so).
_SUMMED_OVER_TOKENS = tuple(
    name
    for name, loss in F.POLICY_GRADIENT_FAMILY.items()
    if loss.normaliser in (F.token_sum_over_count, F.token_sum_over_length_budget)
    and loss.surrogate is not F.vespo_surrogate
)
#: The losses without a clipped ratio for delta to cap.
_WITHOUT_CLIPPED_RATIO = tuple(
    name for name, loss in F.POLICY_GRADIENT_FAMILY.items() if loss.surrogate is not F.clipped_surrogate
)
#: Each loss's own warnings about the settings, beside those every loss shares.
_LOSS_WARNINGS: dict[str, Callable[[Any], list[str]]] = {
    TARGET_LOSS: _tpo_warnings,
    "luspo": _luspo_warnings,
    "vespo": _vespo_warnings,
}

#: Each loss's own warnings that come after the shared ones.
_LATE_LOSS_WARNINGS: dict[str, Callable[[Any], list[str]]] = {"cispo": _cispo_warnings}


def loss_setting_warnings(args: Any) -> list[str]:
    """The warnings about loss settings that have no effect on the chosen loss, or work against it, in order."""
    loss, level, delta = args.loss_type, args.importance_sampling_level, args.delta
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    found = list(_LOSS_WARNINGS.get(loss, lambda _: [])(args))
    if level == "sequence" and loss in _SUMMED_OVER_TOKENS:
        found.append(
            f"With importance_sampling_level='sequence', loss_type='{loss}' sums the sequence's loss over its "
            "tokens, weighting each sequence by its length rather than optimising GSPO's per-sequence objective. "
            "For GSPO use loss_type='grpo'."
        )
    if delta is not None and delta <= 1 + epsilon_high:
        found.append(
            f"delta ({delta}) caps the unclipped ratio below the upper clip 1 + epsilon_high "
            f"({1 + epsilon_high}): two-sided clipping expects delta > 1 + epsilon_high."
        )
    if delta is not None and loss in _WITHOUT_CLIPPED_RATIO:
        found.append(
            f"delta caps the clipped surrogates' ratio; loss_type='{loss}' has no such ratio, so delta has no effect."
        )
    if args.use_bias_correction_kl and args.beta == 0:
        found.append("use_bias_correction_kl corrects the KL term, which beta=0 switches off: it has no effect.")
    found += _LATE_LOSS_WARNINGS.get(loss, lambda _: [])(args)
    return found


def warn_about_loss_settings(args: Any) -> None:
    """Warn, at the line that built the config, about each of :func:`loss_setting_warnings`."""
    for message in loss_setting_warnings(args):
        warnings.warn(message, UserWarning, stacklevel=4)  # here, the config's __post_init__, its __init__, the caller
