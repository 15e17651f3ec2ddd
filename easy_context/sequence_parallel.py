"""The public sequence-parallel API: shard, unshard, and attention by method name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import layouts
from .attention.local import local_attention
from .parallel import METHODS, get_method

Tensor = torch.Tensor


def _layout_args(method: str, world_size: int, ring_degree: int | None) -> tuple[str, int | None]:
    # usp needs ring_degree (layouts says so when it is missing); the others ignore it.
    layout = get_method(method).layout
    return layout, ring_degree if layout == "usp" else None


def required_multiple(method: str, world_size: int, ring_degree: int | None = None) -> int:
    """What the sequence length must be divisible by for ``method`` over ``world_size`` ranks."""
    layout, ring_degree = _layout_args(method, world_size, ring_degree)
    return layouts.required_multiple(layout, world_size, ring_degree)


def shard_sequence(x: Tensor, method: str, rank: int, world_size: int, dim: int = 1,
                   ring_degree: int | None = None) -> Tensor:
    """This rank's shard of ``x`` along ``dim``, in the layout that ``method`` expects."""
    layout, ring_degree = _layout_args(method, world_size, ring_degree)
    return layouts.shard(x, layout, rank, world_size, dim, ring_degree)


def unshard_sequence(x_all: Tensor, method: str, world_size: int, dim: int = 1,
                     ring_degree: int | None = None) -> Tensor:
    """The full sequence back from ``torch.cat`` of every rank's shard in rank order."""
    layout, ring_degree = _layout_args(method, world_size, ring_degree)
    return layouts.unshard(x_all, layout, world_size, dim, ring_degree)


def pad_for_sequence_parallel(input_ids: Tensor, target_ids: Tensor | None, method: str,
                              world_size: int, pad_id: int, position_ids: Tensor | None = None,
                              ring_degree: int | None = None, dim: int = 1):
    """Right-pad a batch to the next length ``method`` can shard: input ids with ``pad_id``,
    targets with -100, position ids counting on. Returns (input_ids, target_ids, position_ids)."""
    multiple = required_multiple(method, world_size, ring_degree)
    return layouts.pad_to_multiple(input_ids, target_ids, multiple, pad_id, position_ids, dim)


def sequence_parallel_attention(q: Tensor, k: Tensor, v: Tensor, method: str,
                                group: dist.ProcessGroup | None = None, causal: bool = True,
                                softmax_scale: float | None = None,
                                ring_degree: int | None = None,
                                document_ids: Tensor | None = None) -> Tensor:
    """Exact attention over a sequence sharded across ``group`` (None: the world).

    q: (B, S_local, Hq, D), k, v: (B, S_local, Hkv, D), each rank's shard cut by
    :func:`shard_sequence` with the same method. Returns this rank's (B, S_local, Hq, D).
    ``document_ids`` (B, S_local), this rank's shard of per-token document ids, keeps packed
    documents apart (methods with ``METHODS[name].documents``).
    """
    m = get_method(method)
    extra = {}
    if document_ids is not None:
        if not m.documents:
            supported = sorted(n for n, x in METHODS.items() if x.documents)
            raise ValueError(f"{method} does not support packed documents (document_ids); use "
                             f"one of {supported}, or pack one document per sequence")
        extra["document_ids"] = document_ids
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        # One rank holds the whole sequence: plain attention (no ring, no all-to-all).
        return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **extra)
    if m.layout == "usp":
        extra["ring_degree"] = ring_degree
    elif ring_degree is not None:
        raise ValueError(f"ring_degree applies to usp_attn only, not {method}; drop it")
    return m.fn(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, **extra)
