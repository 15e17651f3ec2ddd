"""Image spans (Gemma 3's bidirectional attention inside each image) in every method.

Run on each rank: the same seed builds the same whole-sequence q, k, v and output gradient
everywhere; the ground truth is float64 attention with transformers' Gemma 3 mask written
out here, from scratch: (causal AND window) OR (same image AND inside the window), AND same
document (a later key of one's own image is always inside the window). The method sees this
rank's shard in float32 and the whole sequence's spans. Errors are relative to the ground
truth's max |value|.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import easy_context as ec


def span_mask(length: int, spans, window=None, doc=None) -> torch.Tensor:
    """(B, S, S) bool: query i sees key j (see the module doc)."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    rows = []
    for b, row in enumerate(spans):
        same = torch.zeros(length, length, dtype=torch.bool)
        for a, e in row:
            same |= (i >= a) & (i < e) & (j >= a) & (j < e)
        keep = (j <= i) | same
        if window is not None:
            keep &= j > i - window
        if doc is not None:
            keep &= doc[b][:, None] == doc[b][None, :]
        rows.append(keep)
    return torch.stack(rows)


def dense_attention(q, k, v, keep):
    """float64 attention of (B, S, H, D) q and (B, S, Hkv, D) k, v under ``keep`` (B, S, S)."""
    g = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    x = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.size(-1) ** 0.5
    x = x.masked_fill(~keep[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(x, -1).nan_to_num(0.0), v)


def cases(length: int) -> list[dict]:
    """Spans across shard boundaries (multiples of length / 8 at 4 ranks, zigzag halves
    included), one longer than a shard, a span of one token, rows with different spans, with
    and without a window shorter than a span, and packed documents."""
    h = length // 2
    row0 = ((4, 9), (10, h + 3), (length - 5, length))
    row1 = ((0, 3), (h - 2, h + 2), (h + 5, h + 6))
    return [dict(spans=(row0, row1)), dict(spans=(row0, row1), window=3),
            dict(spans=(row1, row0), window=h, docs=True),
            dict(spans=(((2, length - 2),),), window=5, batch=1)]


def _rel(x, ref) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def check_spans(method: str, ring_degree: int | None = None, half: int = 6,
                ignore_spans: bool = False) -> dict:
    """{case: {"out"|"dq"|"dk"|"dv": error}} on this rank. ``ignore_spans`` runs the method
    without its spans (what the test shows the spans change)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    length = 2 * half * world
    report = {}
    for n, case in enumerate(cases(length)):
        gen = torch.Generator().manual_seed(n)
        b = case.get("batch", 2)
        q = torch.randn(b, length, 4, 8, generator=gen)
        k, v = (torch.randn(b, length, 2, 8, generator=gen) for _ in range(2))
        dout = torch.randn(b, length, 4, 8, generator=gen)
        doc = None
        if case.get("docs"):  # two documents, the cut inside row 1's second span
            doc = torch.zeros(b, length, dtype=torch.long)
            doc[:, length // 2:] = 1
        keep = span_mask(length, case["spans"], case.get("window"), doc)
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref = dense_attention(*ref_in, keep)
        ref.backward(dout.double())
        refs = {"out": ref.detach(), "dq": ref_in[0].grad, "dk": ref_in[1].grad,
                "dv": ref_in[2].grad}
        def shard(t):
            return ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)
        sp_in = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
        out = ec.sequence_parallel_attention(
            *sp_in, method=method, ring_degree=ring_degree,
            document_ids=None if doc is None else shard(doc),
            sliding_window=case.get("window"),
            image_spans=None if ignore_spans else case["spans"])
        out.backward(shard(dout))
        got = {"out": out.detach(), "dq": sp_in[0].grad, "dk": sp_in[1].grad, "dv": sp_in[2].grad}
        report[" ".join(f"{k}={v}" for k, v in case.items() if k != "spans") or "spans"] = {
            name: _rel(got[name], shard(refs[name])) for name in refs}
    return report
