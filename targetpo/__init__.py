"""Target Policy Optimization for Hugging Face language models."""

from . import functional
from .config import GRPOConfig, TargetPOConfig
from .trainer import TargetPOTrainer

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "TargetPOConfig", "TargetPOTrainer", "functional", "__version__"]
