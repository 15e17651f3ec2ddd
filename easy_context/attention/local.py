"""Attention on one device, as an autograd function over a block kernel.

This is what Ulysses runs after its all-to-all, and the single-process baseline that the
benchmarks compare against; it calls the same kernels as the ring methods.
"""

from __future__ import annotations

import torch

from .documents import document_mask
from .kernels import Kernel, default_scale, select_kernel
from .saving import run_saved

Tensor = torch.Tensor


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, kernel: Kernel, mask):
        out, lse = run_saved(lambda: kernel.forward(q, k, v, causal=causal, scale=scale, attn_mask=mask))
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale, ctx.kernel = causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, causal=ctx.causal,
                                         scale=ctx.scale, attn_mask=mask)
        return dq, dk, dv, None, None, None, None


def local_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                    softmax_scale: float | None = None, kernel: str | None = None,
                    document_ids: Tensor | None = None) -> Tensor:
    """Exact attention on one device. q: (B, S, Hq, D); k, v: (B, S, Hkv, D) -> (B, S, Hq, D).

    ``document_ids`` (B, S), optional: packed documents; no token attends across them.
    """
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    _, causal, mask = document_mask(document_ids, document_ids, causal)
    return _LocalAttention.apply(q, k, v, causal, scale, select_kernel(q, kernel), mask)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                        softmax_scale: float | None = None) -> Tensor:
    """The ground truth: plain PyTorch softmax attention with autograd, computed in float64
    (or the input's precision if higher). Memory O(S^2): for tests only."""
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    g = q.size(2) // k.size(2)
    qh = q.double().transpose(1, 2)
    kh = k.double().repeat_interleave(g, dim=2).transpose(1, 2)
    vh = v.double().repeat_interleave(g, dim=2).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(q.size(1), k.size(1), dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)
