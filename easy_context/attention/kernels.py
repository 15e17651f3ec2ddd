"""Block attention kernels that return ``(out, lse)``, one per backend, chosen at run time.

Every sequence-parallel method computes attention block by block and merges the partial
results, so each kernel returns the log-sum-exp of its scores next to its output, and has a
backward that takes the *final* (merged) output and lse: with those, the per-block
gradients it returns are exactly the block's share of the full-attention gradients.

Shapes (the flash-attn layout, which every method uses):
    q:   (B, Sq, Hq, D)          k, v: (B, Sk, Hkv, D), Hq % Hkv == 0 (GQA)
    out: (B, Sq, Hq, D), q's dtype      lse: (B, Hq, Sq), float32, natural log
``causal=True`` means the top-left aligned mask tril(ones(Sq, Sk)); the methods only use it
on square diagonal blocks, where every alignment agrees.
``attn_mask`` is an optional additive float mask broadcastable to (B, Hq, Sq, Sk), used for
packed documents. A row whose keys are all masked has out = 0 and lse = -inf, so that a
merge ignores it (the CPU op itself reports lse = 0 there).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    """A backend: ``forward(q, k, v, causal, scale, attn_mask) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal, scale, attn_mask) -> (dq, dk, dv)``."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _dead_rows(attn_mask: Tensor | None) -> Tensor | None:
    """(…, Sq) True where a row's keys are all masked out."""
    if attn_mask is None:
        return None
    return torch.isneginf(attn_mask).all(dim=-1)


def _mark_dead_rows(lse: Tensor, attn_mask: Tensor | None) -> Tensor:
    dead = _dead_rows(attn_mask)
    if dead is None or not bool(dead.any()):
        return lse
    return lse.masked_fill(dead.expand_as(lse), float("-inf"))


def _finite_lse(lse: Tensor) -> Tensor:
    # Backward ops compute exp(s - lse): a dead row (lse = -inf) has no gradient, and 0 keeps
    # it finite (its masked scores are -inf, so its probabilities are exactly 0).
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


# --------------------------------------------------------------------------- reference
def _grouped(q: Tensor, k: Tensor) -> tuple[int, int]:
    hq, hkv = q.size(2), k.size(2)
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return hkv, hq // hkv


def _reference_scores(q: Tensor, k: Tensor, causal: bool, scale: float, attn_mask: Tensor | None):
    """Scores (B, Hkv, G, Sq, Sk) in float32 or float64, GQA by grouping, not repeating K."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    hkv, g = _grouped(q, k)
    qg = q.to(work).view(b, sq, hkv, g, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(work)) * scale
    if causal:
        keep = torch.ones(sq, k.size(1), dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        m = attn_mask.to(work)
        m = m.expand(b, hq, sq, k.size(1)).reshape(b, hkv, g, sq, k.size(1))
        s = s + m
    return s


def reference_forward(q, k, v, causal=False, scale=None, attn_mask=None):
    """Naive attention: out = softmax(q k^T * scale + mask) v, lse = logsumexp(...)."""
    scale = default_scale(q.size(-1)) if scale is None else scale
    b, sq, hq, d = q.shape
    s = _reference_scores(q, k, causal, scale, attn_mask)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq); -inf for a dead row
    p = torch.exp(s - _finite_lse(lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(p.dtype)).reshape(b, sq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq).float()


def reference_backward(dout, q, k, v, out, lse, causal=False, scale=None, attn_mask=None):
    """The flash-attention backward in plain PyTorch, given the final out and lse."""
    scale = default_scale(q.size(-1)) if scale is None else scale
    b, sq, hq, d = q.shape
    hkv, g = _grouped(q, k)
    s = _reference_scores(q, k, causal, scale, attn_mask)
    work = s.dtype
    p = torch.exp(s - _finite_lse(lse).to(work).view(b, hkv, g, sq, 1))
    do = dout.to(work).view(b, sq, hkv, g, d)
    o = out.to(work).view(b, sq, hkv, g, d)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(work))
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, Hkv, G, Sq, 1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(work)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(work).view(b, sq, hkv, g, d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = Kernel("reference", reference_forward, reference_backward)


# --------------------------------------------------------------------------- CPU
def _heads_first(t: Tensor) -> Tensor:
    # (B, S, H, D) -> (B, H, S, D) as a view; the CPU op keeps its input's memory layout for
    # its output, so transposing back gives a contiguous (B, S, H, D) tensor without a copy.
    return t.transpose(1, 2)


def _cpu_forward(q, k, v, causal=False, scale=None, attn_mask=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal,
        attn_mask=None if attn_mask is None else attn_mask.to(q.dtype), scale=scale)
    return out.transpose(1, 2), _mark_dead_rows(lse, attn_mask)


def _cpu_backward(dout, q, k, v, out, lse, causal=False, scale=None, attn_mask=None):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v),
        _heads_first(out), _finite_lse(lse).contiguous(), 0.0, causal,
        attn_mask=None if attn_mask is None else attn_mask.to(q.dtype), scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)


# --------------------------------------------------------------------------- CUDA (torch ops)
def _repeat_kv(q: Tensor, t: Tensor) -> Tensor:
    # torch's CUDA flash/efficient ops want equal head counts; flash-attn does not need this.
    _, g = _grouped(q, t)
    return t if g == 1 else t.repeat_interleave(g, dim=2)


def _sum_groups(dt: Tensor, hkv: int) -> Tensor:
    b, s, hq, d = dt.shape
    return dt if hq == hkv else dt.view(b, s, hkv, hq // hkv, d).sum(3)


def _cuda_forward(q, k, v, causal=False, scale=None, attn_mask=None):
    kr, vr = _repeat_kv(q, k), _repeat_kv(q, v)
    if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and q.size(-1) <= 256:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _heads_first(q), _heads_first(kr), _heads_first(vr), 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    else:
        bias = None if attn_mask is None else attn_mask.to(q.dtype).expand(
            q.size(0), q.size(2), q.size(1), k.size(1))
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _heads_first(q), _heads_first(kr), _heads_first(vr), bias, True, 0.0, causal,
            scale=scale)
        lse = lse[..., : q.size(1)]  # the efficient kernel pads lse's length
    return out.transpose(1, 2), _mark_dead_rows(lse.float(), attn_mask)


def _cuda_backward(dout, q, k, v, out, lse, causal=False, scale=None, attn_mask=None):
    kr, vr = _repeat_kv(q, k), _repeat_kv(q, v)
    lse = _finite_lse(lse).contiguous()
    qh, kh, vh, oh, doh = map(_heads_first, (q, kr, vr, out, dout))
    if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and q.size(-1) <= 256:
        sq, sk = q.size(1), k.size(1)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, None, None, sq, sk, 0.0, causal, seed, seed, scale=scale)
    else:
        bias = None if attn_mask is None else attn_mask.to(q.dtype).expand(
            q.size(0), q.size(2), q.size(1), k.size(1))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, bias, oh, lse, seed, seed, 0.0, [True, True, True, False], causal,
            scale=scale)
    hkv = k.size(2)
    return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), hkv), _sum_groups(dv.transpose(1, 2), hkv)


CUDA_TORCH = Kernel("cuda_torch", _cuda_forward, _cuda_backward)


# --------------------------------------------------------------------------- flash-attn package
def _flash_attn_kernel() -> Kernel:
    """Wrap flash-attn's private per-block ops (the public API hides lse in backward)."""
    import inspect

    from flash_attn import flash_attn_interface as fai

    fwd_params = inspect.signature(fai._flash_attn_forward).parameters
    bwd_params = inspect.signature(fai._flash_attn_backward).parameters

    def _kw(params, **kw):
        # flash-attn renamed window_size -> window_size_left/right across 2.x releases.
        if "window_size" in params:
            kw["window_size"] = (-1, -1)
        else:
            kw["window_size_left"], kw["window_size_right"] = -1, -1
        for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("return_softmax", False),
                            # --deterministic (easy_context.train.determinism)
                            ("deterministic", torch.are_deterministic_algorithms_enabled()),
                            ("rng_state", None)):
            if name in params:
                kw[name] = value
        return {k: v for k, v in kw.items() if k in params}

    def forward(q, k, v, causal=False, scale=None, attn_mask=None):
        if attn_mask is not None:
            return _cuda_forward(q, k, v, causal, scale, attn_mask)
        scale = default_scale(q.size(-1)) if scale is None else scale
        res = fai._flash_attn_forward(q, k, v, **_kw(fwd_params, dropout_p=0.0, softmax_scale=scale,
                                                      causal=causal))
        return res[0], res[1].float()

    def backward(dout, q, k, v, out, lse, causal=False, scale=None, attn_mask=None):
        if attn_mask is not None:
            return _cuda_backward(dout, q, k, v, out, lse, causal, scale, attn_mask)
        scale = default_scale(q.size(-1)) if scale is None else scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fai._flash_attn_backward(dout.contiguous(), q, k, v, out, _finite_lse(lse).contiguous(),
                                 dq, dk, dv, **_kw(bwd_params, dropout_p=0.0, softmax_scale=scale,
                                                   causal=causal))
        return dq, dk, dv

    return Kernel("flash_attn", forward, backward)


@functools.lru_cache(maxsize=None)
def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=None)
def _flash_attn_cached() -> Kernel:
    return _flash_attn_kernel()


KERNELS = {"reference": REFERENCE, "cpu_flash": CPU_FLASH, "cuda_torch": CUDA_TORCH}


def select_kernel(q: Tensor, name: str | None = None) -> Kernel:
    """The kernel for ``q``'s device and dtype, or the one called ``name``.

    CPU: torch's flash op. CUDA: the flash-attn package for fp16/bf16 when it is installed,
    else torch's flash op (fp16/bf16) or memory-efficient op (fp32). Anything else: reference.
    """
    if name is not None:
        if name == "flash_attn":
            return _flash_attn_cached()
        if name not in KERNELS:
            raise ValueError(f"unknown attention kernel {name!r}; choose one of "
                             f"{sorted(KERNELS) + ['flash_attn']}")
        return KERNELS[name]
    if q.device.type == "cpu":
        return CPU_FLASH if q.dtype != torch.float64 else REFERENCE
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_available():
            return _flash_attn_cached()
        return CUDA_TORCH
    return REFERENCE
