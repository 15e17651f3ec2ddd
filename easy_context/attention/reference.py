"""The ground truth for tests and benchmarks: plain softmax attention with autograd."""

from __future__ import annotations

import torch

from .contract import default_scale

Tensor = torch.Tensor


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
