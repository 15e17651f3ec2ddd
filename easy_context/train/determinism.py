"""``--deterministic``: kernels whose results do not depend on scheduling.

On GPUs several backward kernels accumulate with atomics (attention's dq, index_add,
scatter_add, cuBLAS split-K reductions), so two runs of the same step can differ in the last
bits, and a resumed run is then close to, not equal to, an uninterrupted one. This switch
asks for deterministic kernels everywhere:

- ``torch.use_deterministic_algorithms(True)``: torch picks deterministic kernels, and an op
  that has none raises at its first call instead of silently differing;
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS needs for reproducible matmuls (read
  when cuBLAS starts, so it is set before the model touches the GPU);
- cuDNN deterministic, without autotuning;
- the flash-attn kernel's deterministic backward (easy_context.attention.kernels reads
  ``torch.are_deterministic_algorithms_enabled()``).

Deterministic backward kernels are slower (flash-attn's by about 10-20%). CPU kernels here are
deterministic already at a fixed thread count.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Deterministic kernels inside the block (nothing changes when ``enabled`` is False);
    the previous settings come back at its end."""
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
