"""The kernels that run anywhere: the plain-PyTorch reference (the ground truth, and float64)
and torch's CPU flash op. Both meet the contract in contract.py; selection.py picks among
these, torch's CUDA ops (cuda_ops.py) and flash-attn (flash_attn_adapters.py)."""

from __future__ import annotations

import torch

from .contract import Kernel, check_block, default_scale, finite_lse, grouped, heads_first

Tensor = torch.Tensor


# --------------------------------------------------------------------------- reference
def _reference_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scores (B, Hkv, G, Sq, Sk) in float32 or float64, GQA by grouping, not repeating K."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    hkv, g = grouped(q, k)
    qg = q.to(work).reshape(b, sq, hkv, g, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(work)) * scale
    if causal:
        keep = torch.ones(sq, k.size(1), dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def reference_forward(q, k, v, causal=False, scale=None):
    """Naive attention: out = softmax(q k^T * scale) v, lse = logsumexp(q k^T * scale)."""
    check_block(q, k, causal)
    scale = default_scale(q.size(-1)) if scale is None else scale
    b, sq, hq, d = q.shape
    s = _reference_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq)
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(p.dtype)).reshape(b, sq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq).float()


def reference_backward(dout, q, k, v, out, lse, causal=False, scale=None):
    """The flash-attention backward in plain PyTorch, given the final out and lse."""
    check_block(q, k, causal)
    scale = default_scale(q.size(-1)) if scale is None else scale
    b, sq, hq, d = q.shape
    hkv, g = grouped(q, k)
    s = _reference_scores(q, k, causal, scale)
    work = s.dtype
    p = torch.exp(s - finite_lse(lse).to(work).reshape(b, hkv, g, sq, 1))
    do = dout.to(work).reshape(b, sq, hkv, g, d)
    o = out.to(work).reshape(b, sq, hkv, g, d)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(work))
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, Hkv, G, Sq, 1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(work)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(work).reshape(b, sq, hkv, g, d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = Kernel("reference", reference_forward, reference_backward)


# --------------------------------------------------------------------------- CPU
def _cpu_forward(q, k, v, causal=False, scale=None):
    check_block(q, k, causal)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        heads_first(q), heads_first(k), heads_first(v), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def _cpu_backward(dout, q, k, v, out, lse, causal=False, scale=None):
    check_block(q, k, causal)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        heads_first(dout), heads_first(q), heads_first(k), heads_first(v),
        heads_first(out), finite_lse(lse).contiguous(), 0.0, causal, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)


KERNELS = {"reference": REFERENCE, "cpu_flash": CPU_FLASH}
