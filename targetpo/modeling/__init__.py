"""The policy model: ``loading`` (models, tokenizers, PEFT, the frozen reference, position limits) and ``logps``
(token log-probs and entropies from a forward pass, and the output head's kernels)."""
