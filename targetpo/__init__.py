"""Target Policy Optimization for Hugging Face language models."""

from . import functional
from .config import GRPOConfig, TargetPOConfig
from .trainer import GRPOTrainer, TargetPOTrainer

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "TargetPOConfig", "TargetPOTrainer", "functional", "__version__"]
