"""USP (Fang & Zhao 2024): Ulysses inside groups of neighbours, zigzag ring attention across.

The N ranks form a ``ring_degree x ulysses_degree`` grid, ``ulysses_degree = N // ring_degree``:
global rank r is ring rank ``r // ulysses_degree`` and Ulysses rank ``r % ulysses_degree``.
A Ulysses group is a run of neighbouring ranks (one node, where all-to-all is cheap); a ring
group is the ranks with the same Ulysses rank (one per node, talking point to point).

The "usp" layout (easy_context.layouts) cuts the sequence zigzag over the ring ranks, then
contiguously over the Ulysses ranks of each ring rank. So the Ulysses all-to-all inside a
group hands every member its ring rank's *whole* zigzag shard for H/U heads, and zigzag ring
attention over the ring group, on those heads, finishes the job; the reverse all-to-all
returns each rank its own tokens. Ulysses limits the heads (H % U == 0), the ring does not,
so the ring degree lets Ulysses-style speed reach world sizes beyond the head count.

ring_degree = 1 is pure Ulysses and ring_degree = N pure zigzag ring attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.variants import Variant
from ..mesh import SPGroup, usp_groups
from .method import AttentionDims, Method, check_ring_degree
from .ring import ring_buffers, ring_comm
from .ulysses import (head_shard, kv_replication, ulysses_apply, ulysses_attn, ulysses_buffers,
                      ulysses_comm, ulysses_saved_per_token)
from .zigzag import zigzag_ring_attn

Tensor = torch.Tensor


def usp_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
             softmax_scale: float | None = None, document_ids: Tensor | None = None,
             ring_degree: int | None = None, variant: Variant | None = None,
             sinks: Tensor | None = None) -> Tensor:
    """USP over usp-layout shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``group``: an SPGroup (easy_context.mesh: its ring and Ulysses groups are used), or a
    process group / None (the world), split here with ``ring_degree``.
    """
    world = group.size if isinstance(group, SPGroup) else dist.get_world_size(group)
    if isinstance(group, SPGroup) and ring_degree is None:
        ring_degree = group.ring_degree
    ring_degree = check_ring_degree("usp_attn", world, ring_degree)
    if ring_degree == 1:  # the usp layout is then the contiguous one
        return ulysses_attn(q, k, v, group, causal, softmax_scale, document_ids,
                            variant=variant, sinks=sinks)
    if ring_degree == world:  # ... and here the zigzag one
        return zigzag_ring_attn(q, k, v, group, causal, softmax_scale, document_ids,
                                variant=variant, sinks=sinks)
    # Fail on the heads before creating groups: every rank sees the same shapes, so every
    # rank raises and none is left waiting in a collective.
    check_usp(q.size(2), k.size(2), world, ring_degree)
    groups = usp_groups(group, ring_degree)
    return ulysses_apply(
        q, k, v, groups.ulysses,
        lambda qh, kh, vh, docs, sk: zigzag_ring_attn(qh, kh, vh, groups.ring, causal,
                                                      softmax_scale, docs, variant=variant,
                                                      sinks=sk),
        document_ids, method="usp_attn", sinks=sinks)


def check_usp(heads: int | None, kv_heads: int | None, world: int,
              ring_degree: int | None) -> None:
    ring_degree = check_ring_degree("usp_attn", world, ring_degree)
    uly = world // ring_degree
    if heads is None or kv_heads is None or uly == 1:
        return
    try:
        kv_replication(heads, kv_heads, uly, "usp_attn")
    except ValueError as e:
        raise ValueError(f"{e} (here ulysses_degree = {world} // ring_degree {ring_degree} "
                         f"= {uly}; a larger ring_degree lowers it)") from None


def usp_ring_degrees(heads: int, kv_heads: int, world: int) -> list[int]:
    """Ring degrees whose Ulysses degree U (1 < U < N) the heads allow, largest U first:
    Ulysses is the faster half, the ring takes what it cannot."""
    out = []
    for u in sorted((d for d in range(2, world) if world % d == 0), reverse=True):
        if heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0):
            out.append(world // u)
    return out


def usp_unsuitable(heads: int, kv_heads: int, world: int) -> str | None:
    if not usp_ring_degrees(heads, kv_heads, world):
        return f"no Ulysses degree 1 < U < {world} divides both N and the {heads} heads"
    return None


def _degrees(world: int, ring_degree: int | None) -> tuple[int, int]:
    r = ring_degree or world
    return r, world // r


def usp_saved_per_token(dims: AttentionDims, a: int, world: int, ring_degree: int | None) -> int:
    return ulysses_saved_per_token(dims, a, _degrees(world, ring_degree)[1])


def _ring_dims(dims: AttentionDims, u: int) -> AttentionDims:
    """The heads the ring sees after the Ulysses all-to-all over u ranks."""
    return head_shard(dims, u)


def usp_kernel_call(dims: AttentionDims, s: int, world: int, ring_degree: int | None):
    """The ring's (or, at ring degree 1, one rank's) calls on the U x s tokens and the heads
    each rank holds after the all-to-all."""
    u = _degrees(world, ring_degree)[1]
    return u * s, u * s, _ring_dims(dims, u)


def usp_buffers(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None,
                kv_heads: int = 1) -> int:
    """The Ulysses buffers over U = N / ring_degree ranks, plus the ring's for a group of
    ``kv_heads`` of the KV heads it holds, over the U x s tokens each ring rank holds after
    the all-to-all."""
    r, u = _degrees(world, ring_degree)
    ring = ring_buffers(_ring_dims(dims, u), u * s, a, r, None, kv_heads) if r > 1 else 0
    return ulysses_buffers(dims, s, a, u) + ring


def usp_comm(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None) -> int:
    """Ulysses over U ranks, then the ring over R on U x s tokens of Hkv x rep / U KV heads."""
    r, u = _degrees(world, ring_degree)
    return ulysses_comm(dims, s, a, u) + (ring_comm(_ring_dims(dims, u), u * s, a, r, None)
                                          if r > 1 else 0)


METHOD = Method(
    name="usp_attn", attention=usp_attn, layout="usp", short="USP", speed_rank=2,
    summary="Ulysses inside groups of neighbouring ranks, zigzag ring across them (ring_degree)",
    use_when="more ranks than heads: Ulysses speed beyond the head count",
    aliases=("usp",), needs_ring_degree=True, check_fn=check_usp, unsuitable=usp_unsuitable,
    ring_degrees=usp_ring_degrees, saved_per_token=usp_saved_per_token,
    group_buffers=usp_buffers, kernel_call=usp_kernel_call,
    comm_bytes=usp_comm)
