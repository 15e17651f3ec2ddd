"""EasyContext: exact sequence-parallel long-context training for Hugging Face causal LMs."""

from .parallel import METHODS
from .sequence_parallel import (
    pad_for_sequence_parallel,
    required_multiple,
    sequence_parallel_attention,
    shard_sequence,
    unshard_sequence,
)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "pad_for_sequence_parallel",
    "required_multiple",
    "sequence_parallel_attention",
    "shard_sequence",
    "unshard_sequence",
]
