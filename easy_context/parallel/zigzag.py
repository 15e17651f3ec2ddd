"""Zigzag ring attention: ring attention over the zigzag layout, balanced under a causal mask.

Rank r holds chunks r and 2N-1-r of 2N. Against the K/V shard of rank ``src``:
- src == r: both local chunks attend causally to both held chunks (the mask of the local
  sequence [chunk r, chunk 2N-1-r] is exactly the causal one);
- src < r: both query chunks see the earlier held chunk src, and neither sees 2N-1-src;
- src > r: only the later query chunk 2N-1-r sees anything, and it sees both held chunks.
Every off-diagonal step is therefore half a block on every rank: the ranks stay in step.
"""

from __future__ import annotations

import torch

from ..attention.variants import Variant
from .method import Method
from .ring import ALL, Block, ring_buffers, ring_comm, run_ring

Tensor = torch.Tensor


def zigzag_schedule(src: int, rank: int, local_len: int, causal: bool) -> list[Block]:
    if not causal:
        return [Block(ALL, ALL, False)]
    half = local_len // 2
    if src == rank:
        return [Block(ALL, ALL, True)]
    if src < rank:
        return [Block(ALL, slice(0, half), False)]
    return [Block(slice(half, None), ALL, False)]


def zigzag_ring_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
                     softmax_scale: float | None = None, document_ids: Tensor | None = None,
                     ring_degree: int | None = None, variant: Variant | None = None,
                     sinks: Tensor | None = None) -> Tensor:
    """Ring attention over zigzag shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``document_ids`` (B, S/N), optional: packed documents; no token attends across them.
    """
    check_two_chunks(q)
    return run_ring(q, k, v, group, causal, softmax_scale, zigzag_schedule, document_ids,
                    variant, sinks, "zigzag")


def check_two_chunks(q: Tensor) -> None:
    if q.size(1) % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks; its length {q.size(1)} is odd. "
                         "Shard the sequence with the zigzag layout (length divisible by 2N)")


METHOD = Method(
    name="zigzag_ring_attn", attention=zigzag_ring_attn, layout="zigzag", short="Z",
    speed_rank=4, summary="ring over zigzag shards (chunks r and 2N-1-r): every rank does "
    "half a block per step", use_when="the default: balanced under the causal mask, any head count",
    aliases=("zigzag",), group_buffers=ring_buffers, comm_bytes=ring_comm)
