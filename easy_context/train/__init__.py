"""``easy-context train``: DP x SP training of Hugging Face causal LMs."""

from .config import TrainConfig

__all__ = ["TrainConfig"]
