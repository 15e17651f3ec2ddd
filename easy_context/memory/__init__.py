"""Memory savers: a loss that never builds the full logits (and, later, checkpointing/offload)."""

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
