"""The losses a run can train: one objective per ``loss_type`` (``registry.py``), and the regularisers that join any
of them (``regularisers.py``)."""

from .registry import OBJECTIVES

__all__ = ["OBJECTIVES"]
