"""One training step: how a rollout's rows become micro-steps, passes and optimiser steps (``layout.py``,
``token_budget.py``, ``split_groups.py``), and the policy's forward pass over the rows a step trains (``forward.py``)."""
