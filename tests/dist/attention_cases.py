"""Every sequence-parallel method against the full-sequence reference, run on each rank.

Each rank builds the same full q, k, v and upstream gradient from one seed, computes the
float64 reference output and gradients on the whole sequence, shards everything with the
method's own layout code, runs the method on its shard, and compares its shard of the output
and of dq/dk/dv with the reference's shard. Errors are max |x - ref| / max |ref|.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.attention import reference_attention
from easy_context.parallel.local import local_attention

# (batch, seq per 2N-chunk, q heads, kv heads, head dim): lengths are not powers of two;
# GQA 8/2; head dims 64 and 80.
SHAPES = [(2, 5, 8, 2, 64), (1, 3, 4, 4, 80)]
DTYPES = [torch.float32, torch.bfloat16]
CASES = [(shape, causal, dtype) for shape in SHAPES for causal in (True, False) for dtype in DTYPES]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def check_method(method: str, ring_degree: int | None = None, cases=CASES, seed: int = 0,
                 kv_heads_per_group: int | None = None):
    """Run on every rank. Returns {case: {"out"|"dq"|"dk"|"dv": (err_method, err_single)}}.

    ``kv_heads_per_group``: run the method's per-group passes with this many KV heads (the
    buffer budget is set to what that group size needs); None: the device's budget."""
    import contextlib

    from easy_context.parallel.head_groups import attention_buffer_budget

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for (b, chunk, hq, hkv, d), causal, dtype in cases:
        length = chunk * 2 * world
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(b, length, h, d, generator=gen) for h in (hq, hkv, hkv))
        dout = torch.randn(b, length, hq, d, generator=gen)
        # ground truth: float64 on the whole sequence
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out = reference_attention(*ref_in, causal=causal)
        ref_out.backward(dout.double())
        refs = {"out": ref_out.detach(), "dq": ref_in[0].grad, "dk": ref_in[1].grad, "dv": ref_in[2].grad}
        # what one process gets with the same kernel and dtype, for scale
        one_in = [t.to(dtype).detach().clone().requires_grad_() for t in (q, k, v)]
        one_out = local_attention(*one_in, causal=causal)
        one_out.backward(dout.to(dtype))
        single = {"out": one_out.detach(), "dq": one_in[0].grad, "dk": one_in[1].grad, "dv": one_in[2].grad}
        # the method on this rank's shard
        shard = lambda t: ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)
        sp_in = [shard(t).to(dtype).detach().clone().requires_grad_() for t in (q, k, v)]
        budget = contextlib.nullcontext()
        if kv_heads_per_group is not None:
            m = ec.get_method(method)
            dims = ec.parallel.AttentionDims(hq, hkv, d)
            s_local = length // world
            a = torch.tensor([], dtype=dtype).element_size()
            budget = attention_buffer_budget(
                m.group_buffers(dims, s_local, a, world, ring_degree, kv_heads_per_group)
                - m.group_buffers(dims, s_local, a, world, ring_degree, 0))
        with budget:
            sp_out = ec.sequence_parallel_attention(*sp_in, method=method, causal=causal,
                                                    ring_degree=ring_degree)
            sp_out.backward(shard(dout).to(dtype))
        mine = {"out": sp_out.detach(), "dq": sp_in[0].grad, "dk": sp_in[1].grad, "dv": sp_in[2].grad}
        key = f"B{b} L{length} H{hq}/{hkv} D{d} {'causal' if causal else 'full'} {str(dtype)[6:]}"
        report[key] = {name: (_rel(mine[name], shard(refs[name])), _rel(single[name], refs[name]))
                       for name in refs}
    return report


def _per_document_reference(q, k, v, doc, causal):
    """float64 attention run on each document separately, then put back in place. A document
    is every token with one id, wherever it lies (ids that return to an earlier value join
    that document again, which is what document_ids means)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.size(0)):
        for d in doc[b].unique():
            idx = (doc[b] == d).nonzero().squeeze(1)
            out[b, idx] = reference_attention(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx],
                                              causal=causal)[0]
    return out


def document_ids(length: int, pattern: str) -> torch.Tensor:
    """(2, length) ids. "packed": non-decreasing, sample 0 with documents that straddle
    shards, sample 1 with many short ones and a long one (different boundaries per row).
    "repeated": ids that return to earlier values (the same document in separate
    stretches, and stretches that fall in one shard twice)."""
    doc = torch.zeros(2, length, dtype=torch.long)
    if pattern == "packed":
        for i, starts in enumerate([[5, length // 2 + 3], [1, 2, 9, 10, length - 4]]):
            for s in starts:
                doc[i, s:] += 1
        return doc
    pos = torch.arange(length)
    doc[0] = torch.where((pos // 5) % 3 == 1, 7, 2)        # 2 2 2 2 2 7 7 7 7 7 2 2 ...
    doc[1] = (pos * 7 % 3) + 10 * (pos >= length // 2)      # short interleaved stretches
    return doc


def check_documents(method: str, ring_degree: int | None = None, seed: int = 0,
                    patterns=("packed", "repeated"), budgets=(None, 0)):
    """Packed documents: the method with document_ids equals attention per document.

    GQA (4 query heads on 2 KV heads), batch 2 with different boundaries per row, causal
    and not, each id ``pattern``, and each KV-head group ``budget`` (None: the device's,
    which runs these tiny shapes in one group; 0: one KV head per group). At one rank the
    method's own function runs (not the one-rank shortcut of sequence_parallel_attention).
    Returns {case: {"out"|"dq"|"dk"|"dv": error}} (fp32, relative to max |ref|).
    """
    from easy_context.parallel.head_groups import attention_buffer_budget

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    b, hq, hkv, d = 2, 4, 2, 32
    length = 2 * world * 6
    for pattern in patterns:
        doc = document_ids(length, pattern)
        for causal in (True, False):
            gen = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(b, length, h, d, generator=gen) for h in (hq, hkv, hkv))
            dout = torch.randn(b, length, hq, d, generator=gen)
            ref_in = [t.double().requires_grad_() for t in (q, k, v)]
            ref_out = _per_document_reference(*ref_in, doc, causal)
            ref_out.backward(dout.double())
            refs = {"out": ref_out.detach(), "dq": ref_in[0].grad, "dk": ref_in[1].grad,
                    "dv": ref_in[2].grad}
            shard = lambda t: ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)
            for budget in budgets:
                sp_in = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
                kw = dict(causal=causal, document_ids=shard(doc), ring_degree=ring_degree)
                with attention_buffer_budget(budget) if budget is not None else _nothing():
                    if world == 1:
                        sp_out = ec.get_method(method).attention(*sp_in, **kw)
                    else:
                        sp_out = ec.sequence_parallel_attention(*sp_in, method=method, **kw)
                    sp_out.backward(shard(dout))
                mine = {"out": sp_out.detach(), "dq": sp_in[0].grad, "dk": sp_in[1].grad,
                        "dv": sp_in[2].grad}
                key = f"{pattern} {'causal' if causal else 'full'} budget={budget}"
                report[key] = {n: _rel(mine[n], shard(refs[n])) for n in refs}
    return report


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def count_document_scans(method: str, ring_degree: int | None = None, layers: int = 3) -> dict:
    """Run ``method`` as ``layers`` layers of one micro-batch would (the same ids tensor each
    time, forward and backward), then once with new ids and once after an in-place change;
    count the host scans of the ids (ShardDocuments.from_ids: each comes with the ids'
    all-gather where the method gathers them)."""
    from easy_context.attention import documents
    from easy_context.sequence_parallel import shard_sequence

    counts = {"scans": 0}
    real_from_ids = documents.ShardDocuments.from_ids

    def from_ids(ids, *args, **kwargs):
        counts["scans"] += 1
        return real_from_ids(ids, *args, **kwargs)

    documents.ShardDocuments.from_ids = staticmethod(from_ids)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 16 * world, h, 8) for h in (4, 2, 2))
        ids = torch.repeat_interleave(torch.arange(4), 4 * world).unsqueeze(0)
        local = [shard_sequence(t, method, rank, world, ring_degree=ring_degree).requires_grad_()
                 for t in (q, k, v)]
        doc = shard_sequence(ids, method, rank, world, ring_degree=ring_degree)
        kw = {"document_ids": doc, "ring_degree": ring_degree}
        for _ in range(layers):
            ec.sequence_parallel_attention(*local, method, **kw).sum().backward()
        per_batch = dict(counts)
        ec.sequence_parallel_attention(*local, method, **{**kw, "document_ids": doc.clone()}).sum().backward()
        doc.add_(0)  # an in-place change: the ids might differ now
        ec.sequence_parallel_attention(*local, method, **kw).sum().backward()
        with torch.inference_mode():  # as the evals run: ids without a version counter
            frozen = doc.clone()
            for _ in range(2):
                ec.sequence_parallel_attention(*(t.detach() for t in local), method,
                                               **{**kw, "document_ids": frozen})
    finally:
        documents.ShardDocuments.from_ids = real_from_ids
    return {"per_batch": per_batch, "total": counts}
