"""The public sequence-parallel API: shard, unshard, pad, and attention by method name.

Everything here asks the method's description (easy_context.parallel.METHODS) for its
layout and its rules; names may be aliases (``data_parallel`` for ``local``, the original
EasyContext's ``dist_flash``...).
"""

from __future__ import annotations

import torch

from . import layouts
from .mesh import SPGroup, group_size
from .parallel import get_method
from .parallel.function import check_inputs
from .parallel.local import local_attention
from .attention.variants import variant_of

Tensor = torch.Tensor


def _layout(method: str, ring_degree: int | None) -> tuple[str, int | None]:
    # usp needs ring_degree (layouts says so when it is missing); the others ignore it.
    layout = get_method(method).layout
    return layout, ring_degree if layout == "usp" else None


def required_multiple(method: str, world_size: int, ring_degree: int | None = None) -> int:
    """What the sequence length must be divisible by for ``method`` over ``world_size`` ranks."""
    return get_method(method).required_multiple(world_size, ring_degree)


def shard_sequence(x: Tensor, method: str, rank: int, world_size: int, dim: int = 1,
                   ring_degree: int | None = None) -> Tensor:
    """This rank's shard of ``x`` along ``dim``, in the layout that ``method`` expects."""
    layout, ring_degree = _layout(method, ring_degree)
    return layouts.shard(x, layout, rank, world_size, dim, ring_degree)


def unshard_sequence(x_all: Tensor, method: str, world_size: int, dim: int = 1,
                     ring_degree: int | None = None) -> Tensor:
    """The full sequence back from ``torch.cat`` of every rank's shard in rank order."""
    layout, ring_degree = _layout(method, ring_degree)
    return layouts.unshard(x_all, layout, world_size, dim, ring_degree)


def shard_batch(batch: dict[str, Tensor | None], method: str, rank: int, world_size: int,
                ring_degree: int | None = None, dim: int = 1) -> dict[str, Tensor | None]:
    """This rank's shard of every (batch, seq) tensor of ``batch`` (None values stay None)."""
    return {key: None if t is None else shard_sequence(t, method, rank, world_size, dim,
                                                       ring_degree)
            for key, t in batch.items()}


def pad_for_sequence_parallel(input_ids: Tensor, target_ids: Tensor | None, method: str,
                              world_size: int, pad_id: int, position_ids: Tensor | None = None,
                              ring_degree: int | None = None, dim: int = 1):
    """Right-pad a batch to the next length ``method`` can shard: input ids with ``pad_id``,
    targets with -100, position ids counting on. Returns (input_ids, target_ids, position_ids)."""
    multiple = required_multiple(method, world_size, ring_degree)
    return layouts.pad_to_multiple(input_ids, target_ids, multiple, pad_id, position_ids, dim)


def sequence_parallel_attention(q: Tensor, k: Tensor, v: Tensor, method: str,
                                group=None, causal: bool = True,
                                softmax_scale: float | None = None,
                                ring_degree: int | None = None,
                                document_ids: Tensor | None = None,
                                sliding_window: int | None = None,
                                chunk_size: int | None = None, softcap: float | None = None,
                                sinks: Tensor | None = None, image_spans=None) -> Tensor:
    """Exact attention over a sequence sharded across ``group`` (None: the world; or an
    easy_context.mesh.SPGroup).

    q: (B, S_local, Hq, D), k, v: (B, S_local, Hkv, D), each rank's shard cut by
    :func:`shard_sequence` with the same method. Returns this rank's (B, S_local, Hq, D).
    ``document_ids`` (B, S_local), this rank's shard of per-token integer ids (cut with the same
    layout), keeps packed documents apart: token i sees token j iff their ids are equal (and
    j <= i when causal). Every method supports it, with no mask (attention/documents.py);
    ids that increase along the sequence (document_ids_from_positions) need the fewest
    kernel calls.

    What a model's layer adds, exactly, in every method (forward and backward):
    ``sliding_window`` (transformers' meaning: token i sees j iff i - j < sliding_window),
    ``chunk_size`` (Llama 4's chunked attention: iff i // chunk_size == j // chunk_size),
    ``softcap`` (scores -> softcap * tanh(scores / softcap)), ``sinks`` (Hq,) learned logits
    that join every softmax (GPT-OSS). v may have its own head dim (multi-head latent
    attention); the output then has v's. ``image_spans``: per batch row, (first, one past
    the last) *whole-sequence* indices of each image whose tokens attend to each other both
    ways (Gemma 3: query i also sees keys i < j < last of its span, within its document);
    the same on every rank (integrations/vision.py computes them before the sequence is cut).
    """
    m = get_method(method)
    variant = variant_of(sliding_window, chunk_size, softcap, image_spans)
    if variant is not None and variant.spans and len(variant.spans) != q.size(0):
        raise ValueError(f"image_spans must hold one tuple of spans per batch row ({q.size(0)}); "
                         f"got {len(variant.spans)}")
    if document_ids is not None and not m.documents:
        raise ValueError(f"{m.name} does not support packed documents (document_ids) yet; use "
                         "another method, or pack one document per sequence")
    world = group_size(group)
    if world == 1:
        # One rank holds the whole sequence: plain attention (no ring, no all-to-all).
        return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               document_ids=document_ids, variant=variant, sinks=sinks)
    check_inputs(q, k, v, document_ids, sinks)
    if ring_degree is None and m.needs_ring_degree and isinstance(group, SPGroup):
        ring_degree = group.ring_degree
    m.check(q.size(2), k.size(2), world, ring_degree)
    extra = {} if variant is None and sinks is None else {"variant": variant, "sinks": sinks}
    return m.attention(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                       document_ids=document_ids, ring_degree=ring_degree, **extra)
