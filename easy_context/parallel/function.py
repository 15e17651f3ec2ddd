"""The one autograd function every attention algorithm runs through, and its input check.

An algorithm is an object with

    forward(q, k, v) -> (out, lse)                           # one group of KV heads
    backward(dout, q, k, v, out, lse, dq, dk, dv) -> None    # fills the views dq, dk, dv
    kv_heads_per_group: int

where out is in q's dtype and lse (B, H, S) float32. Backward gets the *final* out and lse,
so each block's kernel backward returns exactly its share of the gradients. An algorithm
carries everything else it needs: its process group, its kernel, and the document runs of
the shards it pairs (easy_context.attention.documents.ShardDocuments, built once per call
before it runs, so neither forward nor backward touches the ids again); :class:`GroupAlgorithm`
builds one from a method's forward and backward functions. The function runs
the algorithm a group of KV heads at a time (head_groups.py), saves what backward needs,
and lets attention-saving checkpointing hand back a stored (out, lse) on recompute
(easy_context.attention.saving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..attention.saving import run_saved
from ..attention.sinks import check_sinks, fold_sinks, sink_grad
from .head_groups import backward_into_heads, forward_by_heads

Tensor = torch.Tensor


@dataclass(frozen=True)
class GroupAlgorithm:
    """An algorithm over one process group from a method's two functions, called as

        forward_fn(q, k, v, group=, causal=, scale=, kernel=, docs=, **options) -> (out, lse)
        backward_fn(dout, q, k, v, out, lse, group=, ..., grads=(dq, dk, dv), **options)

    ``options``: (name, value) pairs of the method's own arguments (a ring's schedule)."""

    forward_fn: Callable
    backward_fn: Callable
    group: Any
    causal: bool
    scale: float
    kernel: Any
    docs: Any = None  # easy_context.attention.documents.ShardDocuments
    kv_heads_per_group: int = 1
    options: tuple = ()

    def _kwargs(self) -> dict:
        return dict(group=self.group, causal=self.causal, scale=self.scale, kernel=self.kernel,
                    docs=self.docs, **dict(self.options))

    def forward(self, q, k, v):
        return self.forward_fn(q, k, v, **self._kwargs())

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv):
        self.backward_fn(dout, q, k, v, out, lse, grads=(dq, dk, dv), **self._kwargs())


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, algo):
        def compute():
            out, lse = forward_by_heads(algo.forward, q, k, v, algo.kv_heads_per_group)
            # the sinks join the softmax once, after every block is merged (sinks.py)
            return (out, lse) if sinks is None else fold_sinks(out, lse, sinks)

        out, lse = run_saved(compute)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.algo = algo
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = backward_into_heads(ctx.algo.backward, dout, q, k, v, out, lse,
                                         ctx.algo.kv_heads_per_group)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None


def run_attention(algo, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Attention of local shards by ``algo``; autograd-aware. The caller has checked the
    inputs (check_inputs) before any collective. ``sinks`` (Hq,): attention sinks (sinks.py)
    for these query heads; their gradient is this rank's rows' share."""
    return _Attention.apply(q, k, v, sinks, algo)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None,
                 sinks: Tensor | None = None) -> None:
    """What every method needs: (B, S_local, H, D) shards of one floating dtype on one device,
    query heads a multiple of the KV heads, document ids (B, S_local) of integers. v may have
    its own head dim (multi-head latent attention); sinks are one logit per query head."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seq_local, heads, head_dim); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.size(3) != k.size(3):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         "agree in batch and sequence, q and k in head_dim, and k and v in "
                         "heads")
    if q.size(2) % k.size(2) != 0:
        raise ValueError(f"query heads ({q.size(2)}) must be a multiple of key/value heads "
                         f"({k.size(2)}) for grouped-query attention")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if sinks is not None:
        check_sinks(sinks, q.size(2), q.device)
    if document_ids is not None:
        if tuple(document_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"document_ids must be (batch, seq_local) = {tuple(q.shape[:2])}, "
                             f"got {tuple(document_ids.shape)}")
        if document_ids.is_floating_point() or document_ids.device != q.device:
            raise ValueError(f"document_ids must be integers on {q.device}; got "
                             f"{document_ids.dtype} on {document_ids.device}")
