"""Memory: the savers (a loss that never builds the full logits, activation checkpointing and
offload, max-length mode's fused layers) and the measure (peak.py: a region's peak memory)."""

from easy_context.memory.loss import (
    ChunkedLinearCrossEntropy,
    chunked_cross_entropy,
    count_valid_targets,
    global_token_mean,
    logits_cross_entropy,
)

__all__ = [
    "ChunkedLinearCrossEntropy",
    "chunked_cross_entropy",
    "count_valid_targets",
    "global_token_mean",
    "logits_cross_entropy",
]
