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

The all-to-all is the hot path, so it is written here rather than taken from comm.py (which
copies three times: chunk, stack, cat). Per tensor: one packing copy into (rank, batch,
token, head) order (KV replicas made by broadcasting inside that copy, not by an extra
repeat_interleave), one all_to_all_single, and for batch 1 no unpacking copy at all. On CPU
fresh large buffers cost page faults, so copies are what count. Measured on gloo: fusing q,
k, v into one all-to-all saved no time but forced either an unpacking copy or head-strided
inputs (~10% slower kernel); the list form of all_to_all was 2x slower.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..attention.local import local_attention
from .ring import check_qkv

Tensor = torch.Tensor


def _seq_to_heads(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """(B, s, H_i, D) sequence shards -> (B, N*s, H_i*rep_i/N, D) head shards."""
    outs = []
    for x, r in zip(xs, reps):
        b, s, hx, d = x.shape
        h = hx * r // world
        # (rank, batch, token, head): for B == 1 what arrives is already (B, S, h, D)
        send = x.new_empty(world, b, s, h, d)
        if r == 1:
            send.copy_(x.unflatten(2, (world, h)).permute(2, 0, 1, 3, 4))
        else:  # h == 1: replica i of KV head g goes to rank g*r + i (broadcast in the copy)
            send.unflatten(0, (hx, r)).copy_(x.permute(2, 0, 1, 3)[:, None, :, :, None])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        outs.append(recv.transpose(0, 1).reshape(b, world * s, h, d))
    return outs


def _heads_to_seq(xs: list[Tensor], reps: list[int], group, world: int) -> list[Tensor]:
    """Inverse of :func:`_seq_to_heads`; replicated heads (rep > 1) are summed in float32."""
    outs = []
    for x, r in zip(xs, reps):
        b, full, h, d = x.shape
        s = full // world
        send = x.unflatten(1, (world, s)).transpose(0, 1).contiguous()  # no copy for B == 1
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        y = recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * h, d)
        if r > 1:
            y = y.unflatten(2, (world * h // r, r)).sum(3, dtype=torch.float32).to(y.dtype)
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
            f"{method}: {hq} query heads cannot be split over {world} ranks (Ulysses needs "
            f"heads % ranks == 0); use a world size that divides {hq}, or usp_attn with a "
            f"ring_degree so that {hq} is divisible by world_size // ring_degree")
    if hkv % world == 0:
        return 1
    if world % hkv == 0:
        return world // hkv
    raise ValueError(
        f"{method}: {hkv} key/value heads over {world} ranks: the KV heads must be divisible "
        f"by the ranks, or the ranks by the KV heads (then each KV head is replicated); "
        f"use a world size that divides or is a multiple of {hkv}, or usp_attn with a ring_degree")


def ulysses_apply(q: Tensor, k: Tensor, v: Tensor, group, inner: Callable[..., Tensor],
                  method: str = "ulysses_attn") -> Tensor:
    """All-to-all to head shards, ``inner(q, k, v)`` on the full sequence, all-to-all back."""
    check_qkv(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    world = dist.get_world_size(group)
    rep = kv_replication(q.size(2), k.size(2), world, method)
    if world == 1:
        return inner(q, k, v)
    qh, kh, vh = _SeqToHeads.apply(group, world, [1, rep, rep], q, k, v)
    return _HeadsToSeq.apply(group, world, inner(qh, kh, vh))


def ulysses_attn(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
                 causal: bool = True, softmax_scale: float | None = None) -> Tensor:
    """Ulysses over contiguous shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D)."""
    return ulysses_apply(q, k, v, group,
                         lambda qh, kh, vh: local_attention(qh, kh, vh, causal, softmax_scale))
