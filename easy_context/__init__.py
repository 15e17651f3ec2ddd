"""EasyContext: exact sequence-parallel long-context training for Hugging Face causal LMs.

Importing the package is light; every sequence-parallel method becomes a transformers
attention implementation as soon as transformers' modeling code is imported, before or
after this package (easy_context.integrations.registration, .hf).
"""

from .utils.lazy import lazy_exports

# Public name -> the module that defines it. Attributes are imported on first use (PEP 562),
# so ``import easy_context`` stays light; see integrations/registration.py for when the
# methods become transformers attention implementations.
_EXPORTS = {
    "apply_seq_parallel_monkey_patch": "compat",
    "prepare_dataloader": "compat",
    "prepare_seq_parallel_inputs": "compat",
    "prepare_vision_inputs": "integrations.vision",
    "apply_sequence_parallel": "integrations.hf",
    "causal_lm_loss": "integrations.hf",
    "check_model_supported": "integrations.hf",
    "hf_attention_name": "integrations.hf",
    "enable_sequence_parallel": "integrations.trainer",
    "generate": "generation",
    "GenerationResult": "generation",
    "SequenceParallelMixin": "integrations.trainer",
    "ParallelMesh": "mesh",
    "SPGroup": "mesh",
    "build_mesh": "mesh",
    "METHODS": "parallel",
    "get_method": "parallel",
    "local_attention": "parallel.local",
    "Variant": "attention.variants",
    "pad_for_sequence_parallel": "sequence_parallel",
    "required_multiple": "sequence_parallel",
    "sequence_parallel_attention": "sequence_parallel",
    "shard_batch": "sequence_parallel",
    "shard_sequence": "sequence_parallel",
    "unshard_sequence": "sequence_parallel",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

from .integrations import registration as _registration  # noqa: E402

_registration.install()

__version__ = "0.1.0"

__all__ = list(_EXPORTS)
