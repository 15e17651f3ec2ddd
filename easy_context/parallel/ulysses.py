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
than all_to_all_single: a rank's own 1/N never travels, and each tensor is copied about once
per direction, where DeepSpeed's DistributedAttention copies 1 + 1/N of it (it packs or
unpacks the whole tensor, and the collective copies the own chunk once more). Everything is
laid out heads first: the received heads as (B, h, N*s, D) in memory, each head's whole
sequence one block (the CPU flash kernel reads that 5-7% faster than rows strided by the
heads, which is what the all_to_all_single layout gives it), and the messages as
(B, h, s, D). Towards heads, the chunks for the other ranks are packed (one copy per
distinct head slice: a replicated KV head is packed once for its N/Hkv ranks) and the own
chunk is copied straight into the output while they travel; for batch 1 and one head a stage
each peer's tokens are received in place, more heads are received into a buffer and copied
once. Back towards the sequence, a kernel's heads-first result of one head is sent as it lies
(batch 1), the own chunk is copied into the output while the others travel, and each received
chunk is copied into its heads once. Side by side on this project's CPU (benchmarks/attention.py)
this beat DeepSpeed's DistributedAttention, inside the same kernel; the exchanges alone
(benchmarks/all_to_all.py) beat it too, by less than before the heads-first layout, which
costs them a transposing copy. Fusing q, k, v into one buffer saved no time but forced either
an unpacking copy or head-strided inputs, and the list form of all_to_all was slower still.

The exchange runs in stages of heads (:data:`STAGES`, :func:`pipeline_stages`): every
stage's q, k and v are posted at once, and stage c is attended as soon as its own have
arrived, while the later stages' travel and stage c - 1's output travels back; backward
posts every stage's output gradient, and each stage's dq, dk, dv leave as soon as its
backward is done, while the next stage's runs. Only the first stage's inputs and the last
stage's output (and, in backward, the reverse) wait without compute beside them. Heads are
independent, so the stages change no value. A single KV head per rank (Hkv <= N) is not cut:
it travels with the first stage, every stage attends to it, and its gradient, summed over
the stages by autograd, returns after the last.

Every device type runs this same exchange. On CUDA, ``batch_isend_irecv`` hands NCCL the
sends and receives of one tensor as one group call, which NCCL schedules as it schedules an
all-to-all, on its own stream: a stage's transfers run beside the attention kernels of
another, and the copies it saves are device-memory copies there; whether a fused
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


def _source_heads(j: int, h: int, rep: int, c: int = 0, n: int = 1) -> slice:
    """The source heads rank j receives in stage c of n: its h heads cut in n, or (rep > 1,
    h == 1, n == 1) its KV head's replica."""
    if rep > 1:
        return slice(j // rep, j // rep + 1)
    hc = h // n
    return slice(j * h + c * hc, j * h + (c + 1) * hc)


class _Pending:
    """Transfers posted and not yet waited on, with the copies that follow their arrival."""

    def __init__(self, exchange: Exchange, unpack: list[tuple[Tensor, Tensor]]):
        self.exchange, self.unpack = exchange, unpack

    def wait(self) -> None:
        self.exchange.wait()
        for dst, buf in self.unpack:
            dst.copy_(buf)
        self.unpack = []


def _post_to_heads(x: Tensor, r: int, group, world: int, c: int = 0, n: int = 1
                   ) -> tuple[Tensor, _Pending]:
    """Start moving stage c of n of the heads: (B, s, H, D) sequence shard -> (B, N*s, h/n, D)
    head shard (h = H*r/N, this rank's heads), valid once the returned transfers are waited
    on. It is laid out heads first, (B, h/n, N*s, D) in memory: each head's sequence is one
    block, which the CPU flash kernel reads 5-7% faster than rows strided by the heads."""
    rank = dist.get_rank(group)
    b, s, hx, d = x.shape
    h = hx * r // world
    out = x.new_empty(b, h // n, world, s, d)
    ex, packed, unpack = Exchange(group), {}, []
    peers = [(rank + i) % world for i in range(1, world)]
    for j in peers:  # one packing copy per distinct head slice (a KV head goes to rep ranks)
        heads = _source_heads(j, h, r, c, n)
        if heads.start not in packed:  # messages are heads first too: (B, h/n, s, D)
            packed[heads.start] = x[:, :, heads].transpose(1, 2).contiguous()
        ex.send(packed[heads.start], j)  # the exchange holds the send buffers until its wait
    for j in peers:  # for B == 1 and one head a stage, peer j's tokens land in place
        if out[:, :, j].is_contiguous():
            ex.recv_into(out[:, :, j], j)
        else:
            unpack.append((out[:, :, j], ex.recv(out[:, :, j], j)))
    ex.start()
    out[:, :, rank].copy_(x[:, :, _source_heads(rank, h, r, c, n)].transpose(1, 2))  # meanwhile
    return out.view(b, h // n, world * s, d).transpose(1, 2), _Pending(ex, unpack)


def _post_to_seq(x: Tensor, y: Tensor, group, world: int, c: int = 0, n: int = 1) -> _Pending:
    """Start moving stage c of n back: x (B, N*s, h/n, D), this rank's stage-c heads of the
    whole sequence, into y (B, s, N, h, D), every rank's heads of our tokens. Messages are
    heads first, (B, h/n, s, D): as the attention kernels lay out their results from heads-first
    inputs, so that a stage of one head (B == 1) is sent without a copy."""
    rank = dist.get_rank(group)
    b, full, hc, d = x.shape
    chunks = x.transpose(1, 2).unflatten(2, (world, full // world))  # (B, h/n, N, s, D)
    into = y.unflatten(3, (n, hc))[:, :, :, c]  # (B, s, N, h/n, D): stage c of each rank's heads
    ex, unpack = Exchange(group), []
    peers = [(rank + i) % world for i in range(1, world)]
    for j in peers:
        ex.send(chunks[:, :, j], j)  # a copy only where that is not one block
    for j in peers:
        unpack.append((into[:, :, j], ex.recv(chunks[:, :, j], j).transpose(1, 2)))
    ex.start()
    into[:, :, rank].copy_(chunks[:, :, rank].transpose(1, 2))  # while the exchange runs
    return _Pending(ex, unpack)


def _seq_target(x: Tensor, world: int, stages: int = 1) -> Tensor:
    """The (B, s, N, h, D) tensor that :func:`_post_to_seq` fills from head shards like x
    (x one of ``stages`` stages of the heads)."""
    b, full, h, d = x.shape
    return x.new_empty(b, full // world, world, h * stages, d)


def _seq_result(y: Tensor, r: int) -> Tensor:
    """(B, s, N, h, D) -> (B, s, N*h / r, D): replicated heads (r > 1) summed in float32."""
    b, s, world, h, d = y.shape
    y = y.view(b, s, world * h, d)
    if r > 1:
        y = y.unflatten(2, (y.size(2) // r, r)).sum(3, dtype=torch.float32).to(y.dtype)
    return y


def _seq_to_heads(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """(B, s, H_i, D) sequence shards -> (B, N*s, H_i*rep_i/N, D) head shards, all transfers
    posted before any is waited on."""
    posted = [_post_to_heads(x, r, group, world) for x, r in zip(xs, reps)]
    for _, pending in posted:
        pending.wait()
    return [out for out, _ in posted]


def _heads_to_seq(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """Inverse of :func:`_seq_to_heads`; replicated heads (rep > 1) are summed in float32."""
    ys = [_seq_target(x, world) for x in xs]
    posted = [_post_to_seq(x, y, group, world) for x, y in zip(xs, ys)]
    for pending in posted:
        pending.wait()
    return [_seq_result(y, r) for y, r in zip(ys, reps)]


# --------------------------------------------------------------------------- the pipeline
# The heads are independent, so the exchange runs in stages of heads: stage c + 1's q, k, v
# travel while stage c is attended, and stage c's output travels back while stage c + 1 is;
# backward likewise, in reverse. Five autograd nodes share one _Pipeline (the transfers in
# flight): _ToHeads posts every stage's q, k, v; _Arrived(c) waits for stage c's; the inner
# attention runs; _Leaving(c) posts stage c's output; _Gathered waits for all of them. In
# backward _Gathered posts every stage's output gradient, _Leaving(c) waits for stage c's,
# the inner backward runs, _Arrived(c) posts stage c's q, k, v gradients, and _ToHeads waits
# for all. Autograd reaches the stages in reverse order of their creation, the same on every
# rank, so the transfers pair up in order as the ring's do. A node that passes a tensor on
# before its transfer is waited on hands it only to the node that waits on it.

# At most this many stages of heads, by device kind. CPU: up to one KV head a stage (the
# head-group budget runs one KV head per kernel call there anyway, from a few thousand tokens
# up): every stage's exchange but the first hides behind attention, and a stage of one head
# (batch 1) is received in place, where a stage of several needs receive buffers and a copy
# (at 16K, 85 MB a rank against 104 in one stage). CUDA: two, unmeasured (no GPU pair here):
# a stage is one kernel launch per head group, and a stage of few heads over a short
# sequence would leave SMs idle.
STAGES = {"cpu": 16, "cuda": 2}
# ... and no more than one stage per this many bytes of the rank's query heads (the whole
# sequence's): a stage's transfers have fixed costs (about 1 ms a message on gloo here) that
# a short sequence's attention cannot hide. At 4K tokens and 4 heads a rank on this CPU, four
# stages took 1.03x DeepSpeed's time and one 0.98x; from 8K on both are below it.
STAGE_MIN_BYTES = 2 * 2**20


def stage_limit(device: torch.device | str) -> int:
    return STAGES.get(torch.device(device).type, STAGES["cuda"])


def pipeline_stages(local_heads: int, local_kv_heads: int, most: int) -> int:
    """Stages of a rank's heads: the most, up to ``most``, that divide its query heads and
    either divide its KV heads (each stage its own) or leave one KV head (every stage uses
    it: it travels with the first and its gradient returns after the last)."""
    return next(n for n in range(max(1, min(most, local_heads)), 0, -1)
                if local_heads % n == 0 and (local_kv_heads % n == 0 or local_kv_heads == 1))


class _Pipeline:
    """One Ulysses call's transfers between its autograd nodes (see the comment above)."""

    def __init__(self, group, world: int, reps: list[int], stages: int, splits: list[bool]):
        self.group, self.world, self.reps, self.stages, self.splits = (group, world, reps,
                                                                       stages, splits)
        self.arriving: list = [None] * stages  # per stage: its inputs' transfers to heads
        self.leaving: list = [None] * stages  # per stage: its output's transfers to the sequence
        self.out: Tensor | None = None  # the output's (B, s, N, h, Dv)
        self.dout: list = [None] * stages  # per stage: (its output gradient, its transfers)
        self.grads: list = [None] * stages  # per stage: its inputs' gradients' transfers
        self.grad_targets: list[Tensor] | None = None  # (B, s, N, h_i, D) per input

    def members(self, c: int) -> list[int]:
        """The inputs (0 q, 1 k, 2 v) that travel in stage c: split ones in every stage,
        whole ones in the first."""
        return [i for i, split in enumerate(self.splits) if split or c == 0]

    def cut(self, i: int, c: int) -> tuple[int, int]:
        return (c, self.stages) if self.splits[i] else (0, 1)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipe: _Pipeline, *xs):
        ctx.pipe = pipe
        parts = []
        for c in range(pipe.stages):
            posted = [_post_to_heads(xs[i], pipe.reps[i], pipe.group, pipe.world, *pipe.cut(i, c))
                      for i in pipe.members(c)]
            pipe.arriving[c] = [p for _, p in posted]
            parts.extend(out for out, _ in posted)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *_placeholders):
        pipe = ctx.pipe  # the gradients came through the transfers _Arrived posted
        for c in range(pipe.stages):
            for pending in pipe.grads[c]:
                pending.wait()
        grads = [_seq_result(y, r) for y, r in zip(pipe.grad_targets, pipe.reps)]
        pipe.grads, pipe.grad_targets = [None] * pipe.stages, None
        return (None, *grads)


class _Arrived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipe: _Pipeline, c: int, *parts):
        ctx.pipe, ctx.c = pipe, c
        for pending in pipe.arriving[c]:
            pending.wait()
        pipe.arriving[c] = None
        return parts

    @staticmethod
    def backward(ctx, *grads):
        pipe, c = ctx.pipe, ctx.c
        if pipe.grad_targets is None:  # the first stage backward reaches: the last
            pipe.grad_targets = [None] * 3
        posted = []
        for i, g in zip(pipe.members(c), grads):
            if pipe.grad_targets[i] is None:
                pipe.grad_targets[i] = _seq_target(g, pipe.world, pipe.cut(i, c)[1])
            posted.append(_post_to_seq(g, pipe.grad_targets[i], pipe.group,
                                       pipe.world, *pipe.cut(i, c)))
        pipe.grads[c] = posted
        return (None, None, *grads)  # placeholders: _ToHeads reads the transfers


class _Leaving(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipe: _Pipeline, c: int, out):
        ctx.pipe, ctx.c = pipe, c
        if pipe.out is None:
            pipe.out = _seq_target(out, pipe.world, pipe.stages)
        pipe.leaving[c] = _post_to_seq(out, pipe.out, pipe.group, pipe.world, c, pipe.stages)
        return out

    @staticmethod
    def backward(ctx, _placeholder):
        grad, pending = ctx.pipe.dout[ctx.c]
        pending.wait()
        ctx.pipe.dout[ctx.c] = None
        return None, None, grad


class _Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipe: _Pipeline, *outs):
        ctx.pipe = pipe
        for pending in pipe.leaving:
            pending.wait()
        y, pipe.out, pipe.leaving = pipe.out, None, [None] * pipe.stages
        return _seq_result(y, 1)

    @staticmethod
    def backward(ctx, grad):
        pipe = ctx.pipe
        grad = grad.contiguous()
        for c in reversed(range(pipe.stages)):  # autograd reaches the last stage first
            pipe.dout[c] = _post_to_heads(grad, 1, pipe.group, pipe.world, c, pipe.stages)
        if torch.is_anomaly_enabled():  # it reads what we return: no placeholders then
            for _, pending in pipe.dout:
                pending.wait()
        return (None, *(buf for buf, _ in pipe.dout))


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
                  sinks: Tensor | None = None, stages: int | None = None) -> Tensor:
    """All-to-all to head shards, ``inner(q, k, v, document_ids, sinks)`` on the whole
    sequence of the group (``sinks``: those of the call's query heads), all-to-all back; in
    up to ``stages`` stages of heads, each stage's exchange overlapping another's attention
    (default: the device's :data:`STAGES`, one per :data:`STAGE_MIN_BYTES` of query heads)."""
    check_inputs(q, k, v, document_ids, sinks)
    world = dist.get_world_size(group)
    rep = kv_replication(q.size(2), k.size(2), world, method)
    if world == 1:
        return inner(q, k, v, document_ids, sinks)
    docs = gather_documents(document_ids, group, world)
    h, h_kv = q.size(2) // world, k.size(2) * rep // world
    if stages is None:
        stages = min(stage_limit(q.device), max(1, q.numel() * q.element_size() // STAGE_MIN_BYTES))
    n = pipeline_stages(h, h_kv, stages)
    kv_split = h_kv % n == 0 and n > 1
    pipe = _Pipeline(group, world, [1, rep, rep], n, [True, kv_split, kv_split])
    parts = list(_ToHeads.apply(pipe, q, k, v))
    rank, hc = dist.get_rank(group), h // n
    outs = []
    for c in range(n):
        mine = _Arrived.apply(pipe, c, *parts[:len(pipe.members(c))])
        del parts[:len(pipe.members(c))]
        if c == 0:
            qh, kh, vh = mine
            kv = (kh, vh)
        else:
            qh, kh, vh = mine if kv_split else (mine[0], *kv)
        # rank j holds query heads [j h, (j + 1) h), stage c the c-th h / n of them
        first = rank * h + c * hc
        sk = None if sinks is None else sinks[first:first + hc]
        outs.append(_Leaving.apply(pipe, c, inner(qh, kh, vh, docs, sk)))
    return _Gathered.apply(pipe, *outs)


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
