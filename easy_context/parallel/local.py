"""``local``: attention on one rank's whole sequence, no communication.

The method of data parallelism (every rank holds whole sequences; the user-facing name
``data_parallel`` is its alias), of one process, and what Ulysses runs after its all-to-all.
It calls the same block kernels as the ring methods, so its (out, lse) and gradients are
the reference the others are compared with, and it keeps packed documents apart the same way:
one kernel call per document (easy_context.attention.documents), never an (S, S) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.documents import ShardDocuments, once_per_ids
from ..attention.contract import Kernel, default_scale
from ..attention.selection import select_kernel
from ..attention.variants import Variant, with_softcap
from .blocks import (backward_block, block_calls, block_result, group_buffer_choice,
                     plain_documents)
from .function import check_inputs, run_attention
from .method import Method

Tensor = torch.Tensor
ALL = slice(None)


@dataclass(frozen=True)
class LocalAlgorithm:
    causal: bool
    scale: float
    kernel: Kernel
    kv_heads_per_group: int
    docs: ShardDocuments | None = None

    def _calls(self):
        return block_calls(self.docs, 0, ALL, 0, ALL, self.causal)

    def forward(self, q, k, v):
        return block_result(self.kernel, self._calls(), q, k, v, self.scale,
                            self.docs is not None and self.docs.repeated)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv):
        backward_block(self.kernel, self._calls(), dout, q, k, v, out, lse, self.scale,
                       sum_float32=self.docs is not None and self.docs.repeated,
                       into=(dq, dk, dv))


def local_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    softmax_scale: float | None = None, kernel: str | None = None,
                    document_ids: Tensor | None = None, variant: Variant | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """Exact attention on one device. q: (B, S, Hq, D); k, v: (B, S, Hkv, D) -> (B, S, Hq, D)
    (v may have its own head dim Dv: the output has it too).

    ``document_ids`` (B, S), optional: packed documents; no token attends across them.
    ``kernel`` names a backend (easy_context.attention.available_kernels()); default: chosen
    for q. ``variant``: a sliding window, chunks or soft-capping (attention/variants.py);
    ``sinks`` (Hq,): attention sinks (attention/sinks.py).
    """
    check_inputs(q, k, v, document_ids, sinks)
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    n = q.size(1)
    geometry = None if variant is None else variant.geometry(((((0, n, 0),),)), causal, n)
    if document_ids is not None:
        docs = once_per_ids(document_ids, ("local", geometry),
                            lambda: ShardDocuments.from_ids(document_ids.unsqueeze(0), geometry))
    else:
        docs = None if geometry is None else plain_documents((n,), geometry)
    chosen = with_softcap(select_kernel(q, kernel), variant and variant.softcap)
    # heads a group at a time when the kernel's backward workspace would pass the budget
    per_group = group_buffer_choice(lambda g: 0, q, k, chosen, (q.size(1), k.size(1)))
    algo = LocalAlgorithm(bool(causal), scale, chosen, per_group, docs)
    return run_attention(algo, q, k, v, sinks)


def local_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
               softmax_scale: float | None = None, document_ids: Tensor | None = None,
               ring_degree: int | None = None, variant: Variant | None = None,
               sinks: Tensor | None = None) -> Tensor:
    """The method's entry point: ``group`` is ignored (each rank attends to its own whole
    sequence)."""
    return local_attention(q, k, v, causal, softmax_scale, document_ids=document_ids,
                           variant=variant, sinks=sinks)


METHOD = Method(
    name="local", attention=local_attn, layout="whole", short="1",
    summary="each rank attends to its own whole sequences (no sequence split)",
    use_when="one device, or data parallelism: the sequence fits on one device",
    speed_rank=0, aliases=("data_parallel",))
