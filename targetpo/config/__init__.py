"""Configuration: the fields of a run with their ranges and choices (``fields.py``), and the checks made before any
work (``preflight.py``)."""

from .fields import FLAG_GROUPS, LOSS_TYPES, GRPOConfig, OneOf, Range, TargetPOConfig, close_names

__all__ = ["FLAG_GROUPS", "LOSS_TYPES", "GRPOConfig", "OneOf", "Range", "TargetPOConfig", "close_names"]
