"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, ...) all-gathering the latent, not K/V.

MLA makes each token's K and V from a small latent: the normalised compressed KV c (r values,
512 in DeepSeek-V3) up-projected per head (``kv_b_proj``: H x (nope + v) outputs), and one
RoPE'd key part k_rope (64) shared by every head. Expanded, a token's K/V is H (nope + rope +
v) values (40,960 in DeepSeek-V3, H = 128); its latent r + rope (576): 71x less to move.

A method can send the latent only if it can apply the up-projection itself, after the
transfer, and send the up-projection's gradient back through it. All-gather attention can:
every rank gathers the latents once (forward), expands the *whole* sequence's K/V locally
with the layer's own differentiable ``expand`` (autograd carries the weight's gradient), and
attends its zigzag queries to them (allgather.gathered_forward); backward reduce-scatters the
latents' float32 gradients. Each rank runs the up-projection for the whole sequence (N times
the projection FLOPs of sending K/V: 2 r H (nope + v) per token, about S x 34 MFLOP per layer
in DeepSeek-V3) and holds the whole expanded K/V as all-gather attention does anyway
(here for all heads at once, and kept for the layer's backward).

The ring methods cannot without that cost growing with every step: a relayed latent would be
expanded on each step by each rank (N times the projection, as here, but inside every
step's critical path), and the dK/dV partials they return would have to be taken back through
the projection on the computing rank (so its weight gradient is a sum over ranks, needing an
all-reduce or a gradient hook on the weight). Ulysses moves heads, and the latent has none.

Hugging Face models call their attention function with K/V already expanded (transformers'
MLA modules run ``expand_kv`` before the attention interface); integrations/hf_latent.py
makes their ``expand_kv`` gather the latent first (:func:`gather_latent`) under all-gather
attention, and the attention function then attends to the whole sequence's K/V
(:func:`attend_gathered`). The other methods run on the expanded K/V (exact in every method,
a v head dim of its own: tests/dist/test_attention_variants.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .. import layouts
from ..attention.contract import default_scale
from ..attention.documents import schedule_causal
from ..attention.selection import select_kernel
from ..attention.variants import Variant, with_softcap
from ..mesh import process_group
from .allgather import gather_documents, gathered_backward, gathered_forward
from .comm import all_gather_into, reduce_scatter_into
from .function import GroupAlgorithm, run_attention
from .zigzag import check_two_chunks

Tensor = torch.Tensor


class _GatherSequence(torch.autograd.Function):
    """(B, s, R) zigzag shards -> (B, N s, R) in sequence order; backward: each rank's
    whole-sequence gradient cut into zigzag shards and summed at their owners (float32)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        gathered = x.new_empty(world * x.size(0), *x.shape[1:])
        all_gather_into(gathered, x.contiguous(), group=group)
        gathered = gathered.unflatten(0, (world, x.size(0)))  # (N, B, s, R)
        return layouts.unshard(gathered.movedim(0, 1).flatten(1, 2), "zigzag", world, dim=1)

    @staticmethod
    def backward(ctx, grad):
        world = ctx.world
        send = torch.stack([layouts.shard(grad.float(), "zigzag", r, world, dim=1)
                            for r in range(world)])
        own = torch.empty_like(send[0])
        reduce_scatter_into(own, send.flatten(0, 1), group=ctx.group)
        return own.to(grad.dtype), None, None


def _forward(q, k_all, v_all, group, causal, scale, kernel, docs=None):
    return gathered_forward(q, k_all, v_all, dist.get_rank(group), dist.get_world_size(group),
                            causal, scale, kernel, docs)


def _backward(dout, q, k_all, v_all, out, lse, group, causal, scale, kernel, docs, *, grads):
    dq, dk, dv = grads
    dk_all = torch.zeros_like(k_all, dtype=torch.float32)
    dv_all = torch.zeros_like(v_all, dtype=torch.float32)
    dq.copy_(gathered_backward(dout, q, k_all, v_all, out, lse, dist.get_rank(group),
                               dist.get_world_size(group), causal, scale, kernel, docs,
                               dk_all, dv_all))
    dk.copy_(dk_all)
    dv.copy_(dv_all)


def gather_latent(latent: Tensor, group=None) -> Tensor:
    """Every rank's latent in sequence order: (B, S/N, R) zigzag shards -> (B, S, R), one
    all-gather; backward reduce-scatters its float32 gradient to the owners. The latent must
    be a function of its own token alone (MLA: the normalised compressed KV and the RoPE'd
    key part, whose rotation depends only on the token's global position)."""
    pg = process_group(group)
    world = dist.get_world_size(pg)
    return _GatherSequence.apply(latent, pg, world) if world > 1 else latent


def attend_gathered(q: Tensor, k_all: Tensor, v_all: Tensor, group=None, causal: bool = True,
                    softmax_scale: float | None = None, document_ids: Tensor | None = None,
                    variant: Variant | None = None, sinks: Tensor | None = None) -> Tensor:
    """This rank's zigzag queries q (B, S/N, Hq, Dq) against the whole sequence's K/V in
    sequence order, k_all (B, S, Hkv, Dq), v_all (B, S, Hkv, Dv), made on this rank (from
    :func:`gather_latent`'s output); no communication but the document ids'. Returns
    (B, S/N, Hq, Dv); gradients reach q, k_all and v_all (this rank's share of them)."""
    check_two_chunks(q)
    pg = process_group(group)
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    s = q.size(1)
    if (k_all.dim() != 4 or k_all.shape[:2] != (q.size(0), world * s)
            or k_all.size(-1) != q.size(-1) or q.size(2) % k_all.size(2)
            or v_all.shape[:3] != k_all.shape[:3]):
        raise ValueError(f"the gathered K/V must be k (batch, {world * s}, kv_heads, "
                         f"{q.size(-1)}) and v of the same length and heads, with kv_heads "
                         f"dividing {q.size(2)}; got {tuple(k_all.shape)} and "
                         f"{tuple(v_all.shape)}")
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    kernel = with_softcap(select_kernel(q), variant and variant.softcap)
    geometry = None if variant is None else variant.geometry(
        (layouts.segments("zigzag", rank, world, s), ((0, world * s, 0),)), causal, world * s)
    algo = GroupAlgorithm(_forward, _backward, pg, schedule_causal(bool(causal), geometry),
                          scale, kernel,
                          gather_documents(document_ids, pg, world, geometry, s),
                          k_all.size(2))
    return run_attention(algo, q, k_all, v_all, sinks)


def latent_allgather_attn(q: Tensor, latent: Tensor,
                          expand: Callable[[Tensor], tuple[Tensor, Tensor]], group=None,
                          causal: bool = True, softmax_scale: float | None = None,
                          document_ids: Tensor | None = None, variant: Variant | None = None,
                          sinks: Tensor | None = None) -> Tensor:
    """All-gather attention that moves each token's latent instead of its K/V.

    q: (B, S/N, Hq, Dq), this rank's zigzag shard (RoPE applied); latent: (B, S/N, R), what
    K/V are made of, per token (MLA: the normalised compressed KV and the RoPE'd shared key
    part, concatenated); ``expand(latent (B, L, R)) -> (k (B, L, Hkv, Dq), v (B, L, Hkv, Dv))``,
    differentiable (the layer's up-projection), run once on the whole sequence. Returns
    (B, S/N, Hq, Dv); gradients reach q, the latent and whatever ``expand`` uses.
    """
    if q.dim() != 4 or latent.dim() != 3 or latent.shape[:2] != q.shape[:2]:
        raise ValueError(f"q must be (batch, seq_local, heads, head_dim) and latent (batch, "
                         f"seq_local, rank) with the same batch and length; got "
                         f"{tuple(q.shape)} and {tuple(latent.shape)}")
    check_two_chunks(q)
    k_all, v_all = expand(gather_latent(latent, group))
    return attend_gathered(q, k_all, v_all, group, causal, softmax_scale, document_ids,
                           variant, sinks)


def latent_bytes_per_token(kv_lora_rank: int, rope_dim: int, heads: int, nope_dim: int,
                           v_dim: int, a: int = 2) -> tuple[int, int]:
    """(bytes of a token's latent, of its expanded K/V) at ``a`` bytes per element: what one
    all-gather moves per token each way."""
    return (kv_lora_rank + rope_dim) * a, heads * (nope_dim + rope_dim + v_dim) * a
