"""The causal depthwise convolution before a recurrent mixer (gated DeltaNet, Mamba, LFM2's
short convolutions) over sequence shards.

Output t reads inputs t-K+1 .. t, so each piece (pieces.py) needs the K-1 inputs before it
in sequence order: its *halo*. When pieces are shorter than K-1 the halo spans several
preceding pieces, on several ranks. One all-gather hands every rank every piece's last
min(K-1, length) inputs (left-padded to K-1); each rank builds each of its pieces' halos from
the pieces before it, zeros before the sequence start. The all-gather's backward
reduce-scatters the halos' gradients back to the pieces they came from.

Packed documents: an output reads only the inputs of its own document (a kernel given
``seq_idx`` / ``cu_seqlens`` does the same): the document ids of the halos travel with them
(forward only) and the window is masked where a document starts inside it.

``kernel``: a function with the signature of causal-conv1d's ``causal_conv1d_fn`` (and
transformers' torch fallback of it): ``kernel(x, weight, bias, activation=) -> out``, x (B, C,
L), weight (C, K). Each piece's halo-extended input goes through it whole and the first K-1
outputs (which read zeros before the halo) are dropped: no initial_states (whose channel-last
layout causal-conv1d requires) needed. Packed documents take the masked torch path (the
kernel's ``seq_idx`` wants a channel-last input, C a multiple of 8).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..mesh import process_group
from ..parallel.comm import gather_shards
from .pieces import Piece, piece_table, sequence_order
from .scan import gather_pieces, tie

Tensor = torch.Tensor
ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def _tails(x: Tensor, pieces: list[Piece], slots: int, halo: int) -> Tensor:
    """(slots, B, C, halo): each piece's last inputs, left-padded with zeros."""
    out = []
    for p in pieces:
        take = x[..., max(p.start, p.stop - halo):p.stop]
        out.append(F.pad(take, (halo - take.size(-1), 0)))
    out += [torch.zeros_like(out[0])] * (slots - len(out))
    return torch.stack(out)


def _halo(order: list[Piece], index: int, tails: Tensor, halo: int) -> Tensor:
    """(B, C, halo): the inputs before ``order[index]`` in sequence order (zeros before the
    start); ``tails`` (N, slots, B, C, halo), or ids (N, slots, B, halo) likewise."""
    parts, need = [], halo
    for p in reversed(order[:index]):
        if need == 0:
            break
        take = min(need, p.length, halo)
        parts.append(tails[p.rank, p.slot][..., halo - take:])
        need -= take
    parts.reverse()
    out = torch.cat(parts, -1) if parts else tails[0, 0][..., :0]
    return F.pad(out, (need, 0))


def _masked_conv(ext: Tensor, ids: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """ext (B, C, K-1+L) with ids (B, K-1+L) -> (B, C, L); a window reads only its last
    position's document: the run (stretch between id changes) it lies in."""
    k = weight.size(-1)
    run = torch.zeros_like(ids)
    run[:, 1:] = (ids[:, 1:] != ids[:, :-1]).cumsum(1)
    runs = run.unfold(1, k, 1)  # (B, L, K)
    mask = (runs == runs[..., -1:]).to(ext.dtype)
    windows = ext.unfold(2, k, 1)  # (B, C, L, K)
    out = torch.einsum("bclk,blk,ck->bcl", windows, mask, weight)
    return out if bias is None else out + bias[:, None]


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                  activation: str | None = None, *, group=None, layout: str = "contiguous",
                  ring_degree: int | None = None,
                  document_ids: Tensor | None = None,
                  kernel: Callable | None = None) -> Tensor:
    """The causal depthwise convolution of this rank's shard, exact as on the whole sequence.

    x (B, C, S_local) (transformers' layout), weight (C, K), bias (C,) or None; ``activation``
    None or "silu"; ``kernel`` None (torch's conv1d) or a ``causal_conv1d_fn`` (module
    docstring). Returns (B, C, S_local)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported; use one of "
                         f"{sorted(a for a in ACTIVATIONS if a)} or None")
    pg = process_group(group)
    world = dist.get_world_size(pg) if dist.is_initialized() and layout != "whole" else 1
    rank = dist.get_rank(pg) if world > 1 else 0
    halo = weight.size(-1) - 1
    table = piece_table(layout, world, x.size(-1), ring_degree)
    mine, slots = table[rank], max(len(p) for p in table)
    order = sequence_order(table)
    index = {p: i for i, p in enumerate(order)}
    tails = gather_pieces(_tails(x, mine, slots, halo), pg, world) if halo else None
    id_tails = None
    if document_ids is not None and halo:
        ids = _tails(document_ids[:, None], mine, slots, halo)[:, :, 0]  # (slots, B, halo)
        id_tails = gather_shards(ids, pg) if world > 1 else ids.unsqueeze(0)

    fused = kernel is not None and document_ids is None
    outs = []
    for p in mine:
        ext = x[..., p.start:p.stop]
        if halo:
            ext = torch.cat([_halo(order, index[p], tails, halo).to(x.dtype), ext], -1)
        if fused:  # the activation inside, as the kernel does it
            y = kernel(ext, weight, bias, activation=activation)[..., ext.size(-1) - p.length:]
        elif document_ids is None:
            y = F.conv1d(ext, weight.unsqueeze(1), bias, groups=weight.size(0))
        else:
            ids = document_ids[:, p.start:p.stop]
            if halo:
                before = _halo(order, index[p], id_tails, halo)
                # before the sequence start: zeros, whatever their "document"
                ids = torch.cat([before, ids], -1)
            y = _masked_conv(ext, ids, weight, bias)
        outs.append(y)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    if world > 1 and tails is not None:
        out = tie(out, tails)
    act = None if fused else ACTIVATIONS[activation]
    return out if act is None else act(out)
