"""Block attention kernels that return ``(out, lse)``, one per backend, chosen at run time.

Every sequence-parallel method computes attention block by block and merges the partial
results, so each kernel returns the log-sum-exp of its scores next to its output, and has a
backward that takes the *final* (merged) output and lse: with those, the per-block
gradients it returns are exactly the block's share of the full-attention gradients.

The contract every backend meets (tested on CPU for all of them, see tests/unit/test_kernels*):
    q:   (B, Sq, Hq, D)          k, v: (B, Sk, Hkv, D), Hq % Hkv == 0 (GQA, never repeated
         by the caller); any strides with a contiguous last dim (head-group and row views)
    forward(q, k, v, causal, scale)  -> out (B, Sq, Hq, D) in q's dtype,
                                        lse (B, Hq, Sq) float32, natural log
    backward(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv shaped like q, k, v
``causal=True`` is only ever handed a *square* block (Sq == Sk, the same tokens on both
sides): there the top-left alignment of torch's ops and the bottom-right alignment of
flash-attn agree, so no backend's convention matters. Kernels refuse anything else.
No kernel takes a mask: packed documents are cut into sub-blocks that are each either full
or causal-square (easy_context.attention.documents), so no (Sq, Sk) tensor ever exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    """A backend: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def check_block(q: Tensor, k: Tensor, causal: bool) -> None:
    """The one shape rule of the contract: causal blocks are square (see the module doc)."""
    if causal and q.size(1) != k.size(1):
        raise ValueError(f"a causal block must be square (the same tokens on both sides); got "
                         f"{q.size(1)} query rows and {k.size(1)} key rows")


def grouped(q: Tensor, k: Tensor) -> tuple[int, int]:
    """(KV heads, query heads per KV head)."""
    hq, hkv = q.size(2), k.size(2)
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return hkv, hq // hkv


def finite_lse(lse: Tensor) -> Tensor:
    # Backward ops compute exp(s - lse): a row that saw no key in any block (lse = -inf) has
    # no gradient, and 0 keeps it finite (no sub-block contains such a row, so no score of it
    # is ever formed).
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


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
def heads_first(t: Tensor) -> Tensor:
    # (B, S, H, D) -> (B, H, S, D) as a view; the CPU op keeps its input's memory layout for
    # its output, so transposing back gives a contiguous (B, S, H, D) tensor without a copy.
    return t.transpose(1, 2)


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


# --------------------------------------------------------------------------- selection
KERNELS = {"reference": REFERENCE, "cpu_flash": CPU_FLASH}


def available_kernels() -> dict[str, Kernel]:
    """Every kernel this machine can name: the CPU ones, torch's CUDA ops, and the installed
    flash-attn adapters (whether a GPU is present or not)."""
    from .cuda_ops import CUDA_TORCH, CUDA_TORCH_EFFICIENT, CUDA_TORCH_FLASH
    from .flash_attn_adapters import installed_flash_attn_kernels

    return {**KERNELS, **{k.name: k for k in (CUDA_TORCH, CUDA_TORCH_FLASH, CUDA_TORCH_EFFICIENT)},
            **{k.name: k for k in installed_flash_attn_kernels()}}


def select_kernel(q: Tensor, name: str | None = None) -> Kernel:
    """The kernel for ``q``'s device, dtype and head dim, or the one called ``name``.

    CPU: torch's flash op (float64: the reference). CUDA, fp16/bf16: flash-attn-4 on sm90+
    or flash-attn 2.6+ on sm80+ when installed and the head dim suits it
    (flash_attn_adapters.usable), else torch's CUDA ops, which pick their flash or
    memory-efficient kernel per call and fall back to the reference rather than fail
    (cuda_ops.py). Anything else: the reference.
    """
    if name is not None:
        kernels = KERNELS if name in KERNELS else available_kernels()
        if name not in kernels:
            raise ValueError(f"unknown or unavailable attention kernel {name!r}; choose one of "
                             f"{sorted(available_kernels())}")
        return kernels[name]
    if q.device.type == "cpu":
        return CPU_FLASH if q.dtype != torch.float64 else REFERENCE
    if q.device.type == "cuda":
        from .cuda_ops import CUDA_TORCH
        from .flash_attn_adapters import flash_attn_for

        return flash_attn_for(q) or CUDA_TORCH
    return REFERENCE
