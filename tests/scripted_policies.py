"""Fixed weights that script what a tiny random model writes, so a test never depends on what it happens to sample.

:func:`script_one_bit_turns` makes a model's every turn after ``=`` one bit then ``<eos>`` (a call of the bits
tests' ``flip`` tool). Only the next token's kind is scripted: which bit stays the model's own random choice, so
rewards still differ, groups still train and log-probs still depend on every input, images included.
"""

from __future__ import annotations

import math

import torch

#: The two hidden dimensions that carry the script.
SCRIPT_DIMS = (0, 1)
#: The logit a token's script gives itself when it is the last token. It must stay well under the 100 that vLLM's
#: ``suppress_tokens`` logit bias takes off a suppressed ``=``, or the engine would write one.
SELF_LOGIT = 25.0


@torch.no_grad()
def script_one_bit_turns(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Set the model's word embeddings (and output head, tied or not) so that among ``0``, ``1`` and ``<eos>`` it
    writes a bit after ``=`` and ``<eos>`` after a bit, each with probability 1 - e^-45 or more.

    In the plane of :data:`SCRIPT_DIMS`, ``=`` is (1, 0), a bit (0, 1) and ``<eos>`` (-2, 3), times
    ``SELF_LOGIT / sqrt(hidden)``; every other token stays near 0 there. These coordinates dominate the last token's
    residual stream, so after the final norm its hidden state is about ``SELF_LOGIT`` times its own direction there:
    after ``=`` the bits score 0 and ``<eos>`` -50; after a bit the bits score 25 and ``<eos>`` 75. A few training
    steps at learning rate 0.05 move these weights by tenths at most, far inside the margins.
    """
    hidden = model.get_input_embeddings().weight.shape[1]
    scale = SELF_LOGIT / math.sqrt(hidden)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("=", "0", "1")}
    placement = {ids["="]: (1.0, 0.0), ids["0"]: (0.0, 1.0), ids["1"]: (0.0, 1.0), tokenizer.eos_token_id: (-2.0, 3.0)}
    tables = {id(table): table for table in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    for table in tables.values():
        for token, coordinates in placement.items():
            table[token, list(SCRIPT_DIMS)] = scale * torch.tensor(coordinates, dtype=table.dtype)
    return model
