"""Memory planner: per-device memory of a training step, the method to use, how long a context fits.

    from easy_context.plan import load_shape, estimate_memory, choose_method, max_sequence_length
    shape = load_shape("Llama-2-7B")
    print(estimate_memory(shape, 700_000, 8, "zigzag_ring_attn", engine="deepspeed",
                          offload="params", checkpointing="full").table())

Pure arithmetic (no torch): the same estimator serves ``easy-context plan`` and
``recipe --dry-run``; benchmarks/plan_validation.py checks it against measured peaks.
"""

from .choose import ORDER, MethodChoice, choose_method, max_sequence_length, required_multiple
from .estimate import (
    CPU_RUNTIME_BYTES,
    GPU_RUNTIME_BYTES,
    MemoryEstimate,
    estimate_memory,
)
from .shapes import BUILTIN, ModelShape, load_shape, shape_from_config

__all__ = ["BUILTIN", "CPU_RUNTIME_BYTES", "GPU_RUNTIME_BYTES", "ORDER", "MemoryEstimate",
           "MethodChoice", "ModelShape", "choose_method", "estimate_memory", "load_shape",
           "max_sequence_length", "required_multiple", "shape_from_config"]
