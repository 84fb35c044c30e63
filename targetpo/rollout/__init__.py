"""Rollouts: where completions come from (``sources.py``), when and with which weights (``scheduler.py``), what they
are given of the trainer (``context.py``), their prompts (``prompts.py``) and their scores (``scoring.py``)."""
