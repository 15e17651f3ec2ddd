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
in DeepSeek-V3) and holds the whole expanded K/V as all-gather attention does anyway.

The ring methods cannot without that cost growing with every step: a relayed latent would be
expanded on each step by each rank (N times the projection, as here, but inside every
step's critical path), and the dK/dV partials they return would have to be taken back through
the projection on the computing rank (so its weight gradient is a sum over ranks, needing an
all-reduce or a gradient hook on the weight). Ulysses moves heads, and the latent has none.

Hugging Face models call their attention function with K/V already expanded (transformers'
DeepseekV3Attention runs kv_b_proj before the attention interface), so this path needs the
layer's forward to hand the latent and ``expand`` instead; integrations/hf.py does not do that
yet, and training MLA models runs on the expanded K/V (exact in every method, a v head dim of
its own: tests/dist/test_attention_variants.py).
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
    pg = process_group(group)
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    s = q.size(1)
    whole = _GatherSequence.apply(latent, pg, world) if world > 1 else latent
    k_all, v_all = expand(whole)
    if k_all.shape[:2] != whole.shape[:2] or k_all.size(-1) != q.size(-1) or q.size(2) % k_all.size(2):
        raise ValueError(f"expand must give k (batch, {whole.size(1)}, kv_heads, {q.size(-1)}) "
                         f"with kv_heads dividing {q.size(2)}; got {tuple(k_all.shape)}")
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    kernel = with_softcap(select_kernel(q), variant and variant.softcap)
    geometry = None if variant is None else variant.geometry(
        (layouts.segments("zigzag", rank, world, s), ((0, world * s, 0),)), causal, world * s)
    algo = GroupAlgorithm(_forward, _backward, pg, schedule_causal(bool(causal), geometry),
                          scale, kernel,
                          gather_documents(document_ids, pg, world, geometry, s),
                          k_all.size(2))
    return run_attention(algo, q, k_all, v_all, sinks)


def latent_bytes_per_token(kv_lora_rank: int, rope_dim: int, heads: int, nope_dim: int,
                           v_dim: int, a: int = 2) -> tuple[int, int]:
    """(bytes of a token's latent, of its expanded K/V) at ``a`` bytes per element: what one
    all-gather moves per token each way."""
    return (kv_lora_rank + rope_dim) * a, heads * (nope_dim + rope_dim + v_dim) * a
