"""Running one block of attention as its kernel calls (easy_context.attention.documents).

A block is query rows of one shard against key rows of another. Without packed documents it
is one kernel call; with them, one call per document present on both sides (documents.py).
Every method's engine calls these two functions on block views, so all methods treat
documents the same way and no mask exists anywhere.
"""

from __future__ import annotations

import functools

import torch

from ..attention.documents import (Call, Geometry, ShardDocuments, group_key, once_per_ids,
                                   whole_block)
from ..attention.contract import Kernel
from ..attention.merge import merge_into
from ..attention.variants import adapt
from ..attention.workspace import block_workspace
from .comm import gather_shards
from .head_groups import buffer_budget, kv_heads_per_group

Tensor = torch.Tensor
ALL = slice(None)


def _is_whole(calls: list[Call]) -> bool:
    return (len(calls) == 1 and calls[0].batch == ALL and calls[0].q == ALL
            and calls[0].kv == ALL and calls[0].window is None)


def _window(c: Call) -> dict:
    return {} if c.window is None else {"window": c.window}


def forward_block(kernel: Kernel, calls: list[Call], q: Tensor, k: Tensor, v: Tensor,
                  scale: float, out: Tensor, lse: Tensor) -> None:
    """Merge the block's calls into ``out`` (B, Sq, H, D) and ``lse`` (B, H, Sq), float32
    accumulators (views) over the block's query rows; q, k, v are the block's views."""
    kernel = adapt(kernel)
    for c in calls:
        o, l = kernel.forward(q[c.batch, c.q], k[c.batch, c.kv], v[c.batch, c.kv],
                              causal=c.causal, scale=scale, **_window(c))
        merge_into(out[c.batch, c.q], lse[c.batch, :, c.q], o, l)


def block_result(kernel: Kernel, calls: list[Call], q: Tensor, k: Tensor, v: Tensor,
                 scale: float, repeated: bool = False) -> tuple[Tensor, Tensor]:
    """The block's own (out in q's dtype, lse float32), for a caller that needs it whole
    (one-rank attention, a DistFlashAttn helper). With non-decreasing ids every query row is
    in at most one call, so results are written in place; ids that repeat are merged."""
    kernel = adapt(kernel)
    if _is_whole(calls):
        c = calls[0]
        return kernel.forward(q, k, v, causal=c.causal, scale=scale)
    b, s, h, _ = q.shape
    shape = (b, s, h, v.size(-1))
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    if repeated:
        out = torch.zeros(shape, dtype=torch.float32, device=q.device)
        forward_block(kernel, calls, q, k, v, scale, out, lse)
        return out.to(q.dtype), lse
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    for c in calls:
        o, l = kernel.forward(q[c.batch, c.q], k[c.batch, c.kv], v[c.batch, c.kv],
                              causal=c.causal, scale=scale, **_window(c))
        out[c.batch, c.q] = o
        lse[c.batch, :, c.q] = l
    return out, lse


def backward_block(kernel: Kernel, calls: list[Call], dout: Tensor, q: Tensor, k: Tensor,
                   v: Tensor, out: Tensor, lse: Tensor, scale: float, sum_float32: bool = False,
                   into: tuple[Tensor, Tensor, Tensor] | None = None,
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The block's dq, dk, dv (shaped like the block's q, k, v, in their dtype), written into
    ``into`` when given.

    One whole call: the kernel's own result. Several: each call's gradients are added to
    zeroed block-shaped buffers (rows outside every call have no gradient from this block;
    0 + x is exact). With ids that repeat (``sum_float32``) a row can get several partials
    from one block: then they are summed in float32 and rounded once.
    """
    kernel = adapt(kernel)
    if _is_whole(calls):
        c = calls[0]
        grads = kernel.backward(dout, q, k, v, out, lse, causal=c.causal, scale=scale)
        if into is None:
            return grads
        for dst, g in zip(into, grads):
            dst.copy_(g)
        return into
    wide = torch.float32 if sum_float32 and q.dtype != torch.float64 else None
    if into is not None and wide is None:
        grads = list(into)
        for g in grads:
            g.zero_()
    else:
        grads = [torch.zeros_like(t, dtype=wide or t.dtype,
                                  memory_format=torch.contiguous_format) for t in (q, k, v)]
    for c in calls:
        dq, dk, dv = kernel.backward(dout[c.batch, c.q], q[c.batch, c.q], k[c.batch, c.kv],
                                     v[c.batch, c.kv], out[c.batch, c.q],
                                     lse[c.batch, :, c.q], causal=c.causal, scale=scale,
                                     **_window(c))
        grads[0][c.batch, c.q] += dq
        grads[1][c.batch, c.kv] += dk
        grads[2][c.batch, c.kv] += dv
        del dq, dk, dv
    if wide is not None:
        if into is not None:
            for dst, g in zip(into, grads):
                dst.copy_(g)
            return into
        grads = [g.to(t.dtype) for g, t in zip(grads, (q, k, v))]
    return grads[0], grads[1], grads[2]


def shard_documents(doc: Tensor | None, group, geometry: Geometry | None = None,
                    local_len: int | None = None) -> ShardDocuments | None:
    """The document runs of every rank's shard of ``group`` (one all-gather of the ids and one
    host copy, once per micro-batch: documents.once_per_ids), or None without documents.
    With a ``geometry`` (a sliding window or chunks), the runs know where each shard sits:
    then there is a plan even without documents (shards of ``local_len`` rows)."""
    if doc is None:
        if geometry is None:
            return None
        return plain_documents((local_len,) * len(geometry.segments), geometry)
    return once_per_ids(doc, ("shards", group_key(group), geometry),
                        lambda: ShardDocuments.from_ids(gather_shards(doc, group), geometry))


@functools.lru_cache(maxsize=64)
def plain_documents(lengths: tuple[int, ...], geometry: Geometry) -> ShardDocuments:
    """The plan of sequences without documents under ``geometry``, kept across calls (every
    layer of one kind asks the same, and its memoised block calls with it)."""
    return ShardDocuments.plain(lengths, geometry)


def block_calls(docs: ShardDocuments | None, q_shard: int, q_rows: slice, kv_shard: int,
                kv_rows: slice, causal: bool) -> list[Call]:
    """The kernel calls of a block (``causal``: a diagonal block), whole without documents."""
    if docs is None:
        return whole_block(causal)
    return docs.calls(q_shard, q_rows, kv_shard, kv_rows, causal)


def group_buffer_choice(group_bytes, q: Tensor, k: Tensor, kernel: Kernel,
                        rows: tuple[int, int]) -> int:
    """KV heads per group for blocks like q, k under the device's buffer budget: the
    method's buffers for the group (``group_bytes(g)``) plus ``kernel``'s backward workspace
    for a call on ``rows`` = (query rows, key rows) with the group's heads (the planner counts
    the same: Method.kv_heads_per_group)."""
    workspace = block_workspace(kernel, q)
    per_kv = q.size(2) // k.size(2)
    return kv_heads_per_group(lambda g: group_bytes(g) + workspace(*rows, g * per_kv, g),
                              k.size(2), buffer_budget(q.device))
