"""The kernels that run anywhere: the plain-PyTorch reference (the ground truth, and float64)
and torch's CPU flash op. Both meet the contract in contract.py; selection.py picks among
these, torch's CUDA ops (cuda_ops.py) and flash-attn (flash_attn_adapters.py)."""

from __future__ import annotations

import torch

from .contract import Kernel, check_block, default_scale, finite_lse, grouped, heads_first

Tensor = torch.Tensor


# --------------------------------------------------------------------------- reference
# The reference works on diagonal offsets: query row i may see key row j iff
# lo <= j - i <= hi (None: unbounded). A causal square is (None, 0); flash-attn's
# bottom-right window (left, right) on an (Sq, Sk) call is (Sk - Sq - left, Sk - Sq + right).
# Query rows are taken a tile at a time (each row is independent), and each tile only meets
# the keys its rows may see, so memory stays bounded and a band costs what it covers.
TILE_ELEMENTS = 1 << 24  # float32 scores per tile (64 MiB)


def offsets(sq: int, sk: int, causal: bool, window: tuple[int, int] | None):
    """(lo, hi) of the call, from the contract's ``causal`` and ``window`` arguments."""
    if window is None:
        return (None, 0) if causal else (None, None)
    left, right = window
    off = sk - sq
    return (off - left if left >= 0 else None), (off + right if right >= 0 else None)


def _key_range(r0: int, r1: int, sk: int, lo, hi) -> tuple[int, int]:
    """Keys [a, b) that some query row of [r0, r1) may see."""
    a = 0 if lo is None else min(sk, max(0, r0 + lo))
    b = sk if hi is None else max(0, min(sk, r1 - 1 + hi + 1))
    return a, max(a, b)


def _tiles(q: Tensor, sk: int, lo, hi):
    """(r0, r1, a, b, mask or None) per tile of query rows."""
    b_, sq, hq, _ = q.shape
    width = sk if lo is None or hi is None else min(sk, hi - lo + 1)
    rows = max(1, TILE_ELEMENTS // max(1, b_ * hq * (width + 1)))
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        a, b = _key_range(r0, r1, sk, lo, hi)
        mask = None
        # j - i over the tile runs from a - (r1 - 1) to (b - 1) - r0: a mask only where the
        # offsets cut it (decided on the host, no device sync)
        if b > a and ((lo is not None and a - (r1 - 1) < lo) or (hi is not None and b - 1 - r0 > hi)):
            d = (torch.arange(a, b, device=q.device)[None, :]
                 - torch.arange(r0, r1, device=q.device)[:, None])
            mask = torch.ones_like(d, dtype=torch.bool)
            if lo is not None:
                mask &= d >= lo
            if hi is not None:
                mask &= d <= hi
        yield r0, r1, a, b, mask


def _scores(qg: Tensor, k: Tensor, scale: float, softcap: float | None, mask):
    """Scores (B, Hkv, G, rows, keys) in the work dtype; with softcap also tanh(x / c)."""
    x = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(x / softcap)
        x = t * softcap
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    return x, t


def masked_forward(q, k, v, scale, lo, hi, softcap=None):
    """Attention with diagonal offsets (lo, hi) and optional logit soft-capping; v may have
    its own head dim. Returns (out in q's dtype (B, Sq, Hq, Dv), lse (B, Hq, Sq) float32)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    hkv, g = grouped(q, k)
    dv = v.size(-1)
    qg = q.to(work).reshape(b, sq, hkv, g, d)
    out = torch.zeros(b, sq, hkv, g, dv, dtype=work, device=q.device)
    lse = torch.full((b, hkv, g, sq), float("-inf"), dtype=work, device=q.device)
    for r0, r1, a, e, mask in _tiles(q, k.size(1), lo, hi):
        if e <= a:
            continue
        s, _ = _scores(qg[:, r0:r1], k[:, a:e].to(work), scale, softcap, mask)
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - finite_lse(l).unsqueeze(-1))
        out[:, r0:r1] = torch.einsum("bhgqk,bkhd->bqhgd", p, v[:, a:e].to(work))
        lse[..., r0:r1] = l
    return out.reshape(b, sq, hq, dv).to(q.dtype), lse.reshape(b, hq, sq).float()


def masked_backward(dout, q, k, v, out, lse, scale, lo, hi, softcap=None):
    """The flash-attention backward of :func:`masked_forward`, given the final out and lse.
    Soft-capping: s = c tanh(x / c), so ds/dx = 1 - tanh^2."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    hkv, g = grouped(q, k)
    dv_dim = v.size(-1)
    qg = q.to(work).reshape(b, sq, hkv, g, d)
    do = dout.to(work).reshape(b, sq, hkv, g, dv_dim)
    o = out.to(work).reshape(b, sq, hkv, g, dv_dim)
    lse_g = finite_lse(lse).to(work).reshape(b, hkv, g, sq)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(k.shape, dtype=work, device=k.device)
    dv = torch.zeros(v.shape, dtype=work, device=v.device)
    for r0, r1, a, e, mask in _tiles(q, k.size(1), lo, hi):
        if e <= a:
            continue
        kt, vt = k[:, a:e].to(work), v[:, a:e].to(work)
        s, t = _scores(qg[:, r0:r1], kt, scale, softcap, mask)
        p = torch.exp(s - lse_g[..., r0:r1].unsqueeze(-1))
        dot = do[:, r0:r1]
        dv[:, a:e] += torch.einsum("bhgqk,bqhgd->bkhd", p, dot)
        dp = torch.einsum("bqhgd,bkhd->bhgqk", dot, vt)
        delta = (dot * o[:, r0:r1]).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        ds = ds * scale
        dq[:, r0:r1] = torch.einsum("bhgqk,bkhd->bqhgd", ds, kt)
        dk[:, a:e] += torch.einsum("bhgqk,bqhgd->bkhd", ds, qg[:, r0:r1])
    return dq.reshape(b, sq, hq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_forward(q, k, v, causal=False, scale=None, window=None, softcap=None):
    """Naive attention: out = softmax(q k^T * scale) v, lse = logsumexp(q k^T * scale); with
    flash-attn's ``window`` (left, right) and ``softcap`` when given."""
    check_block(q, k, causal, window)
    scale = default_scale(q.size(-1)) if scale is None else scale
    return masked_forward(q, k, v, scale, *offsets(q.size(1), k.size(1), causal, window), softcap)


def reference_backward(dout, q, k, v, out, lse, causal=False, scale=None, window=None,
                       softcap=None):
    """The flash-attention backward in plain PyTorch, given the final out and lse."""
    check_block(q, k, causal, window)
    scale = default_scale(q.size(-1)) if scale is None else scale
    return masked_backward(dout, q, k, v, out, lse, scale,
                           *offsets(q.size(1), k.size(1), causal, window), softcap)


REFERENCE = Kernel("reference", reference_forward, reference_backward, windows=True,
                   softcap=True, value_dim=True)


# --------------------------------------------------------------------------- CPU
def _cpu_forward(q, k, v, causal=False, scale=None, attn_mask=None):
    check_block(q, k, causal)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        heads_first(q), heads_first(k), heads_first(v), 0.0, causal, attn_mask=attn_mask,
        scale=scale)
    return out.transpose(1, 2), lse


def _cpu_backward(dout, q, k, v, out, lse, causal=False, scale=None, attn_mask=None):
    check_block(q, k, causal)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        heads_first(dout), heads_first(q), heads_first(k), heads_first(v),
        heads_first(out), finite_lse(lse).contiguous(), 0.0, causal, attn_mask=attn_mask,
        scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# torch's CPU op adds a float mask to each score tile it computes (its cost: one add per
# score); bands.py uses it for sliding bands (Kernel.additive_mask)
CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward, additive_mask=True)


KERNELS = {"reference": REFERENCE, "cpu_flash": CPU_FLASH}
