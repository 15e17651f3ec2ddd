"""One decode step's attention over a KV cache split across ranks.

Each rank holds some of the keys (its prefill shard, plus the new tokens it was handed). The
new token's query is the same on every rank, so each rank attends to its own keys, giving a
partial (out, lse) over a disjoint set of keys, and the partials are merged exactly as the
ring methods merge blocks (attention/merge.py):

    lse = log sum_r exp(lse_r)        out = sum_r exp(lse_r - lse) out_r

One all-gather of the (B, Hq, Dv + 1) partials per layer: a few KB, whatever the length.
The mask is written from the keys' positions (a cache holds them, in whatever layout the
prefill method used): a key is seen when it is valid (not padding), and, for a sliding
window, when ``q - k < window``; for chunked attention when both sit in the same chunk.
Attention sinks join the softmax once, after the merge (attention/sinks.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.merge import merge_into
from ..attention.sinks import fold_sinks
from ..parallel.comm import gather_shards

Tensor = torch.Tensor


def visible_keys(key_positions: Tensor, key_valid: Tensor, query_positions: Tensor,
                 sliding_window: int | None = None, chunk_size: int | None = None) -> Tensor:
    """(B, n) bool: which of the n cached keys the (B,) queries see. Every cached key comes
    before the query (or is the query's own), so causality is already given."""
    seen = key_valid & (key_positions <= query_positions[:, None])
    if sliding_window is not None:
        seen &= (query_positions[:, None] - key_positions) < sliding_window
    if chunk_size is not None:
        seen &= (key_positions // chunk_size) == (query_positions[:, None] // chunk_size)
    return seen


def partial_attention(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, scale: float,
                      softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of one query per row over this rank's keys.

    q (B, Hq, D); k (B, Hkv, n, D), v (B, Hkv, n, Dv) (the cache's layout); seen (B, n).
    Returns out (B, Hq, Dv) float32 and lse (B, Hq) float32; a row that sees no key here has
    lse = -inf and out = 0 (it then counts for nothing in the merge)."""
    b, hq, d = q.shape
    hkv = k.size(1)
    qg = q.view(b, hkv, hq // hkv, d)  # GQA: the query heads that share each KV head
    # the scores in float32 from the start, as the prefill's kernels make them: a bf16 matmul
    # would round each q.k to 8 bits of mantissa before the float32 softmax
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)).mul_(scale)  # (B, Hkv, G, n)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G)
    dead = torch.isneginf(lse)
    p = scores.sub_(torch.where(dead, 0.0, lse).unsqueeze(-1)).exp_()  # exp(-inf) = 0
    out = torch.matmul(p.to(v.dtype), v).float()  # (B, Hkv, G, Dv)
    return out.view(b, hq, -1), lse.view(b, hq)


def merged_attention(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, scale: float,
                     group: dist.ProcessGroup | None, world: int,
                     softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """The exact attention of the (B, Hq, D) queries over the keys of every rank of
    ``group``: this rank's partial, one all-gather, the merge in rank order (every rank
    merges the same parts in the same order, so every rank gets the same bits), then the
    sinks. Returns (B, 1, Hq, Dv) in q's dtype."""
    out, lse = partial_attention(q, k, v, seen, scale, softcap)
    b, hq, dv = out.shape
    if world > 1:
        mine = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # (B, Hq, Dv + 1) float32
        parts = gather_shards(mine, group)  # (world, B, Hq, Dv + 1)
        out = torch.zeros(b, 1, hq, dv, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, 1), float("-inf"), dtype=torch.float32, device=q.device)
        for part in parts:
            merge_into(out, lse, part[..., :dv].unsqueeze(1), part[..., dv].unsqueeze(-1))
    else:
        out, lse = out.unsqueeze(1), lse.unsqueeze(-1)  # (B, 1, Hq, Dv), (B, Hq, 1)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype)
