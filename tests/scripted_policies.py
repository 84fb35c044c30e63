"""Fixed weights that script what a tiny random model writes, so a test never depends on what it happens to sample.

A script is a table: each token placed at a point of a plane of two hidden dimensions (:data:`SCRIPT_DIMS`) in the
word embeddings (and output head, tied or not); every other token stays near 0 there. These coordinates dominate
the last token's residual stream, so after the final norm its hidden state is about ``SELF_LOGIT`` times its own
direction in the plane, and the next token ``t`` after the last token ``s`` scores about
``SELF_LOGIT * <c_s, c_t> / |c_s|`` plus the model's own, small, input-dependent logit. Only what the script fixes is
fixed: between tokens at the same point (two bits) the choice stays the model's own, so rewards still differ, groups
still train and log-probs still depend on every input, images included.
"""

from __future__ import annotations

import math

import torch

#: The two hidden dimensions that carry the script.
SCRIPT_DIMS = (0, 1)
#: The logit a unit-length point gives its own token when it is the last token. It must stay well under the 100 that
#: vLLM's ``suppress_tokens`` logit bias takes off a suppressed token, or the engine would write one.
SELF_LOGIT = 25.0


@torch.no_grad()
def place_tokens(model: torch.nn.Module, points: dict[int, tuple[float, float]]) -> torch.nn.Module:
    """Put each token id at its point of the script's plane, scaled so that the logits are as the module says."""
    scale = SELF_LOGIT / math.sqrt(model.get_input_embeddings().weight.shape[1])
    tables = {id(table): table for table in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    for table in tables.values():
        for token, point in points.items():
            table[token, list(SCRIPT_DIMS)] = scale * torch.tensor(point, dtype=table.dtype)
    return model


def script_one_bit_turns(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Among ``0``, ``1`` and ``<eos>``: a bit after ``=`` and ``<eos>`` after a bit (a call of the bits tests'
    ``flip`` tool per turn), each with probability 1 - e^-45 or more; which bit stays the model's choice.

    ``=`` at (1, 0), the bits at (0, 1), ``<eos>`` at (-2, 3): after ``=`` the bits score 0 and ``<eos>`` -50; after a
    bit the bits 25 and ``<eos>`` 75. A few training steps at learning rate 0.003 keep this.
    """
    ids = [tokenizer.convert_tokens_to_ids(token) for token in "=01"]
    return place_tokens(model, {ids[0]: (1.0, 0.0), ids[1]: (0.0, 1.0), ids[2]: (0.0, 1.0),
                                tokenizer.eos_token_id: (-2.0, 3.0)})


def script_ended_or_cut(model: torch.nn.Module, tokenizer, ending: str, running: str) -> torch.nn.Module:
    """Completions of a prompt ending in ``:`` that either end or run on to the length limit: the first token is one
    of ``ending`` or ``running`` (the model's own choice among them, about evenly), then ``<eos>`` follows an
    ``ending`` token and the same kind of token follows a ``running`` one, each with probability 1 - e^-25 or more.

    ``:`` at (1, 1), ``ending`` at (0, 1), ``running`` at (1, 0), ``<eos>`` at (-3, 2): after ``:`` the letters tie
    at 25/sqrt(2) and ``<eos>`` scores -25/sqrt(2); after an ending letter ``<eos>`` scores 50 and the letters 25 or
    0; after a running letter the running letters score 25, the ending ones 0 and ``<eos>`` -75.
    """
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ":" + ending + running}
    points = {ids[":"]: (1.0, 1.0), tokenizer.eos_token_id: (-3.0, 2.0)}
    points |= {ids[token]: (0.0, 1.0) for token in ending} | {ids[token]: (1.0, 0.0) for token in running}
    return place_tokens(model, points)


def script_one_digit_answers(model: torch.nn.Module, tokenizer, digits: str) -> torch.nn.Module:
    """A chat model whose every answer is one of ``digits`` (the model's own choice among them, about evenly), then
    ``<eos>``, each with probability 1 - e^-25 or more.

    ``<assistant>`` (the end of the generation prompt) at (1, 0), the digits at (2, 1), ``<eos>`` at (-2, 12): after
    ``<assistant>`` the digits score 50, ``<assistant>`` 25 and ``<eos>`` -50; after a digit ``<eos>`` scores
    25 * 8 / sqrt(5) ≈ 89 and the digits ≈ 56.
    """
    points = {tokenizer.convert_tokens_to_ids("<assistant>"): (1.0, 0.0), tokenizer.eos_token_id: (-2.0, 12.0)}
    points |= {tokenizer.convert_tokens_to_ids(digit): (2.0, 1.0) for digit in digits}
    return place_tokens(model, points)
