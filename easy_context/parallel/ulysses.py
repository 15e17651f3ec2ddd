"""DeepSpeed-Ulysses: trade the sequence split for a head split, attend locally, trade back.

Each of the N ranks holds a contiguous 1/N of the sequence for all heads. One all-to-all
gives every rank the whole sequence for H/N heads (rank j gets heads [j*H/N, (j+1)*H/N));
attention is then an ordinary single-device call, and a second all-to-all returns each rank
its own tokens for all heads. Backward is the same in reverse. Communication per rank is
O(S*H*D/N), independent of N's ring length, but N must divide the number of query heads.

GQA: with Hkv % N == 0 the KV heads are split like the query heads. With Hkv < N and
N % Hkv == 0 each KV head is replicated N/Hkv times while it is packed for sending, so rank
j receives exactly the KV head its query heads use (q head h uses KV head h // (Hq/Hkv));
the replicas' gradients are summed on the way back.

Packed documents: the document ids of the group's whole sequence are all-gathered once (one
integer per token), and the local attention keeps the documents apart.

The all-to-all is the hot path, so it is written here with point-to-point transfers rather
than all_to_all_single: a rank's own 1/N never travels, and each tensor is copied once per
direction in all, where DeepSpeed's DistributedAttention copies 1 + 1/N of it (it packs or
unpacks the whole tensor, and the collective copies the own chunk once more). Towards
heads, the chunks for the other ranks are packed (one copy per distinct head slice: a
replicated KV head is packed once for its N/Hkv ranks) and the own chunk is copied straight
into the output while they travel; for batch 1 each peer's tokens are received in place
(the output is (B, N, s, h, D)), so nothing is unpacked. Back towards the sequence, chunks
are sent as they lie (no copy for batch 1), the own one is copied into the output while the
others travel, and each received chunk is copied into its heads once. The transfers of q, k
and v (or of their gradients) are all posted before any is waited on. On gloo this beat
all_to_all_single and DeepSpeed's DistributedAttention side by side (benchmarks/attention.py,
benchmarks/all_to_all.py for the exchanges alone); fusing q, k, v into one buffer saved no
time but forced either an unpacking copy or head-strided inputs (a slower kernel), and the
list form of all_to_all was slower still.

Every device type runs this same exchange. On CUDA, ``batch_isend_irecv`` hands NCCL the
sends and receives of one tensor as one group call, which NCCL schedules as it schedules an
all-to-all, and the copies it saves are device-memory copies there; whether a fused
``all_to_all_single`` beats it on NCCL has not been measured (no multi-GPU machine here).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..mesh import process_group
from ..attention.documents import group_key, once_per_ids
from .comm import Exchange, gather_shards
from ..attention.variants import Variant
from .function import check_inputs
from .local import local_attention
from .method import AttentionDims, Method, standard_saved_per_token

Tensor = torch.Tensor


def _heads_for(j: int, h: int, rep: int) -> slice:
    """The source heads rank j receives: its h heads, or (rep > 1, h == 1) its KV head's replica."""
    return slice(j * h, (j + 1) * h) if rep == 1 else slice(j // rep, j // rep + 1)


def _seq_to_heads(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """(B, s, H_i, D) sequence shards -> (B, N*s, H_i*rep_i/N, D) head shards."""
    rank = dist.get_rank(group)
    peers = [(rank + i) % world for i in range(1, world)]
    outs, posted, unpack = [], [], []
    for x, r in zip(xs, reps):
        b, s, hx, d = x.shape
        h = hx * r // world
        out = x.new_empty(b, world, s, h, d)  # (B, N*s, h, D) once flattened
        ex, packed = Exchange(group), {}
        for j in peers:  # one packing copy per distinct head slice (a KV head goes to rep ranks)
            heads = _heads_for(j, h, r)
            if heads.start not in packed:
                packed[heads.start] = x[:, :, heads].contiguous()
            ex.send(packed[heads.start], j)
        for j in peers:  # for B == 1 peer j's tokens land in place
            if out[:, j].is_contiguous():
                ex.recv_into(out[:, j], j)
            else:
                unpack.append((out[:, j], ex.recv(out[:, j], j)))
        posted.append(ex.start())
        del packed  # the exchange holds the send buffers until its wait
        out[:, rank].copy_(x[:, :, _heads_for(rank, h, r)])  # our own tokens, while it runs
        outs.append(out.view(b, world * s, h, d))
    for ex in posted:
        ex.wait()
    for dst, buf in unpack:
        dst.copy_(buf)
    return outs


def _heads_to_seq(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """Inverse of :func:`_seq_to_heads`; replicated heads (rep > 1) are summed in float32."""
    rank = dist.get_rank(group)
    peers = [(rank + i) % world for i in range(1, world)]
    ys, posted, unpack = [], [], []
    for x, r in zip(xs, reps):
        b, full, h, d = x.shape
        s = full // world
        chunks = x.unflatten(1, (world, s))  # chunk j: rank j's tokens, our heads
        y = x.new_empty(b, s, world, h, d)  # (B, s, N*h, D): rank j's heads at [:, :, j]
        ex = Exchange(group)
        for j in peers:
            ex.send(chunks[:, j], j)  # no copy for B == 1
        for j in peers:
            unpack.append((y[:, :, j], ex.recv(y[:, :, j], j)))
        posted.append(ex.start())
        y[:, :, rank].copy_(chunks[:, rank])  # while the exchange runs
        ys.append((y.view(b, s, world * h, d), r))
    for ex in posted:
        ex.wait()
    for dst, buf in unpack:
        dst.copy_(buf)
    del unpack
    outs = []
    for y, r in ys:
        if r > 1:
            y = y.unflatten(2, (y.size(2) // r, r)).sum(3, dtype=torch.float32).to(y.dtype)
        outs.append(y)
    return outs


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, reps, *xs):
        ctx.group, ctx.world, ctx.reps = group, world, reps
        return tuple(_seq_to_heads(list(xs), reps, group, world))

    @staticmethod
    def backward(ctx, *grads):
        # (autograd materializes the gradient of an unused output as zeros)
        return (None, None, None, *_heads_to_seq(grads, ctx.reps, ctx.group, ctx.world))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, x):
        ctx.group, ctx.world = group, world
        return _heads_to_seq([x], [1], group, world)[0]

    @staticmethod
    def backward(ctx, grad):
        return None, None, _seq_to_heads([grad], [1], ctx.group, ctx.world)[0]


def kv_replication(hq: int, hkv: int, world: int, method: str = "ulysses_attn") -> int:
    """How many times each KV head is sent (1: split them); a ValueError when heads don't fit."""
    if hq % world != 0:
        raise ValueError(
            f"{method}: {hq} query heads cannot be split over {world} ranks (Ulysses needs the "
            f"heads divisible by the ranks); use a world size that divides {hq}, or usp_attn with a "
            f"ring_degree so that {hq} is divisible by world_size // ring_degree")
    if hkv % world == 0:
        return 1
    if world % hkv == 0:
        return world // hkv
    raise ValueError(
        f"{method}: {hkv} key/value heads over {world} ranks: the KV heads must be divisible "
        f"by the ranks, or the ranks by the KV heads (then each KV head is replicated); "
        f"use a world size that divides or is a multiple of {hkv}, or usp_attn with a ring_degree")


def gather_documents(doc: Tensor | None, group, world: int) -> Tensor | None:
    """(B, s) document ids of this rank's contiguous shard -> (B, N*s) of the group's whole
    sequence (what each rank holds after the all-to-all towards heads)."""
    if doc is None or world == 1:
        return doc
    # one gathered tensor per micro-batch, so that what runs on it (local attention, usp's
    # ring) finds its runs computed once too (documents.once_per_ids)
    return once_per_ids(doc, ("ulysses", group_key(group), world),
                        lambda: gather_shards(doc, group).movedim(0, 1).flatten(1, 2))


def ulysses_apply(q: Tensor, k: Tensor, v: Tensor, group, inner: Callable[..., Tensor],
                  document_ids: Tensor | None = None, method: str = "ulysses_attn",
                  sinks: Tensor | None = None) -> Tensor:
    """All-to-all to head shards, ``inner(q, k, v, document_ids, sinks)`` on the whole
    sequence of the group (``sinks``: those of the rank's query heads), all-to-all back."""
    check_inputs(q, k, v, document_ids, sinks)
    world = dist.get_world_size(group)
    rep = kv_replication(q.size(2), k.size(2), world, method)
    if world == 1:
        return inner(q, k, v, document_ids, sinks)
    docs = gather_documents(document_ids, group, world)
    qh, kh, vh = _SeqToHeads.apply(group, world, [1, rep, rep], q, k, v)
    if sinks is not None:  # rank j holds query heads [j h, (j + 1) h)
        h = q.size(2) // world
        rank = dist.get_rank(group)
        sinks = sinks[rank * h:(rank + 1) * h]
    return _HeadsToSeq.apply(group, world, inner(qh, kh, vh, docs, sinks))


def ulysses_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
                 softmax_scale: float | None = None, document_ids: Tensor | None = None,
                 ring_degree: int | None = None, variant: Variant | None = None,
                 sinks: Tensor | None = None) -> Tensor:
    """Ulysses over contiguous shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``document_ids`` (B, S/N), optional: packed documents; gathered once (they are small) so
    that local attention on the whole sequence keeps them apart.
    """
    return ulysses_apply(
        q, k, v, process_group(group),
        lambda qh, kh, vh, docs, sk: local_attention(qh, kh, vh, causal, softmax_scale,
                                                     document_ids=docs, variant=variant,
                                                     sinks=sk),
        document_ids, sinks=sinks)


# --------------------------------------------------------------------------- description
def check_heads(method: str, heads: int | None, kv_heads: int | None, ranks: int) -> None:
    if heads is not None and kv_heads is not None:
        kv_replication(heads, kv_heads, ranks, method)


def replicas(kv_heads: int, ranks: int) -> int:
    """Copies of each KV head after the all-to-all (1 when the KV heads split evenly)."""
    return 1 if kv_heads % ranks == 0 else max(1, ranks // kv_heads)


def head_shard(dims: AttentionDims, ranks: int) -> AttentionDims:
    """The heads each rank holds after the all-to-all over ``ranks``."""
    hq, hkv, hd = dims
    return AttentionDims(hq // ranks, max(1, hkv * replicas(hkv, ranks) // ranks), hd)


def ulysses_kernel_call(dims: AttentionDims, s: int, world: int, ring_degree: int | None):
    """Local attention on the whole sequence for the rank's share of the heads."""
    return s * world, s * world, head_shard(dims, world)


def ulysses_saved_per_token(dims: AttentionDims, a: int, ranks: int) -> int:
    """Saved per local token over ``ranks`` Ulysses ranks: the received head-sharded q, k, v
    (KV heads replicated when fewer than the ranks), the output in both layouts, the lse."""
    hq, hkv, hd = dims
    if ranks == 1:
        return standard_saved_per_token(dims, a, 1, None)
    return (hq + 2 * hkv * replicas(hkv, ranks)) * hd * a + 2 * hq * hd * a + hq * 4


def ulysses_buffers(dims: AttentionDims, s: int, a: int, ranks: int) -> int:
    """All-to-all send and receive buffers of q, k, v (KV replicated if Hkv < N) in backward,
    for their gradients."""
    hq, hkv, hd = dims
    return 0 if ranks == 1 else 2 * s * (hq + 2 * hkv * replicas(hkv, ranks)) * hd * a


def ulysses_comm(dims: AttentionDims, s: int, a: int, ranks: int) -> int:
    """q, k, v towards heads and the output back in forward, their gradients in backward:
    each rank keeps its own 1/N of every tensor."""
    hq, hkv, hd = dims
    return 4 * (ranks - 1) * s * hd * a * (hq + hkv * replicas(hkv, ranks)) // ranks


METHOD = Method(
    name="ulysses_attn", attention=ulysses_attn, layout="contiguous", short="U", speed_rank=1,
    summary="all-to-all from sequence shards to head shards, local attention, all-to-all back",
    use_when="DeepSpeed-Ulysses: two all-to-alls per layer, no ring steps, balanced; needs "
    "heads divisible by N",
    aliases=("ulysses",),
    check_fn=lambda heads, kv, world, rd: check_heads("ulysses_attn", heads, kv, world),
    saved_per_token=lambda dims, a, world, rd: ulysses_saved_per_token(dims, a, world),
    group_buffers=lambda dims, s, a, world, rd, kv_heads=1: ulysses_buffers(dims, s, a, world),
    kernel_call=ulysses_kernel_call,
    comm_bytes=lambda dims, s, a, world, rd: ulysses_comm(dims, s, a, world))
