"""EasyContext: exact sequence-parallel long-context training for Hugging Face causal LMs.

Importing the package registers every sequence-parallel method as a transformers attention
implementation (see easy_context.integrations.hf).
"""

from .compat import (
    apply_seq_parallel_monkey_patch,
    prepare_dataloader,
    prepare_seq_parallel_inputs,
)
from .integrations.hf import (
    apply_sequence_parallel,
    causal_lm_loss,
    check_model_supported,
    hf_attention_name,
)
from .mesh import ParallelMesh, SPGroup, build_mesh
from .parallel import METHODS, get_method
from .parallel.local import local_attention
from .sequence_parallel import (
    pad_for_sequence_parallel,
    required_multiple,
    sequence_parallel_attention,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "ParallelMesh",
    "SPGroup",
    "build_mesh",
    "get_method",
    "local_attention",
    "shard_batch",
    "apply_seq_parallel_monkey_patch",
    "apply_sequence_parallel",
    "causal_lm_loss",
    "check_model_supported",
    "hf_attention_name",
    "pad_for_sequence_parallel",
    "prepare_dataloader",
    "prepare_seq_parallel_inputs",
    "required_multiple",
    "sequence_parallel_attention",
    "shard_sequence",
    "unshard_sequence",
]
