"""``local``: attention on one rank's whole sequence, no communication.

The method of data parallelism (every rank holds whole sequences; the user-facing name
``data_parallel`` is its alias), of one process, and what Ulysses runs after its all-to-all.
It calls the same block kernels as the ring methods, so its (out, lse) and gradients are
the reference the others are compared with, and it keeps packed documents apart the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.documents import document_mask
from ..attention.kernels import Kernel, default_scale, select_kernel
from .function import run_attention
from .method import Method

Tensor = torch.Tensor


@dataclass(frozen=True)
class LocalAlgorithm:
    causal: bool
    scale: float
    kernel: Kernel
    kv_heads_per_group: int

    def forward(self, q, k, v, doc):
        skip, causal, mask = document_mask(doc, doc, self.causal)
        return self.kernel.forward(q, k, v, causal=causal, scale=self.scale, attn_mask=mask)

    def backward(self, dout, q, k, v, out, lse, doc, dq, dk, dv):
        _, causal, mask = document_mask(doc, doc, self.causal)
        grads = self.kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=self.scale,
                                     attn_mask=mask)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)


def local_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    softmax_scale: float | None = None, kernel: str | None = None,
                    document_ids: Tensor | None = None) -> Tensor:
    """Exact attention on one device. q: (B, S, Hq, D); k, v: (B, S, Hkv, D) -> (B, S, Hq, D).

    ``document_ids`` (B, S), optional: packed documents; no token attends across them.
    ``kernel`` names a backend (easy_context.attention.KERNELS); default: chosen for q.
    """
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    algo = LocalAlgorithm(bool(causal), scale, select_kernel(q, kernel), k.size(2))
    return run_attention(algo, q, k, v, document_ids)


def local_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
               softmax_scale: float | None = None, document_ids: Tensor | None = None,
               ring_degree: int | None = None) -> Tensor:
    """The method's entry point: ``group`` is ignored (each rank attends to its own whole
    sequence)."""
    return local_attention(q, k, v, causal, softmax_scale, document_ids=document_ids)


METHOD = Method(
    name="local", attention=local_attn, layout="whole", short="1",
    summary="each rank attends to its own whole sequences (no sequence split)",
    use_when="one device, or data parallelism: the sequence fits on one device",
    speed_rank=0, aliases=("data_parallel",))
