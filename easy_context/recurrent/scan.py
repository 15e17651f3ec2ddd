"""A linear recurrence over sequence shards, exact, with one collective per layer.

A linear recurrence maps the state entering a piece of the sequence affinely to the state
leaving it, ``S_out = A(S_in) + B``, and its outputs are ``o = o0 + read(basis, S_in)``:
``o0`` and ``B`` are what the piece gives from a zero state, ``A`` and ``basis`` what it
does to whatever state comes in. A kernel that takes an initial state and returns the final
one gives all four in *one* call: append to the value (or input) dims a block of zeros and
start that block's state from the identity. Every value column evolves independently (the
kernels only ever multiply values and states from the left or by scalars), so the appended
columns come out as the transition applied to the identity (``A``) and as each token's read
of it (``basis``), the original columns as ``o0`` and ``B``. See :class:`Recurrence`.

Then, instead of passing the state from rank to rank in series (which would serialise the
layer over the ranks):

1. each rank computes (A, B) for each of its pieces (pieces.py), in parallel;
2. one all-gather hands every rank every piece's (A, B);
3. each rank chains them in sequence order up to its own pieces (small matrix products per
   head, no tokens involved): ``S_in(p+1) = A_p(S_in(p)) + B_p``, a zero state at the start
   and at every piece that begins a new document;
4. each rank finishes its outputs, ``o = o0 + read(basis, S_in)``.

The backward is autograd through the same steps; the all-gather's backward reduce-scatters
the gradients of (A, B), so each piece's owner receives every rank's gradient for its map.

Packed documents (``document_ids``, pieces.py): within a piece, every document after the
first runs from a zero state; if the piece holds a document start, its map forgets the
incoming state (A = 0) and its B is the last document's final state, and only the rows
before the first start read the incoming state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..mesh import process_group
from ..parallel.comm import gather_shards, reduce_scatter_into
from .pieces import Piece, piece_table, sequence_order, starts

Tensor = torch.Tensor
Tokens = dict[str, Tensor]  # per-token inputs, each (B, L, ...): sliced along dims 0 and 1


@dataclass(frozen=True)
class Recurrence:
    """What the scan needs to know about one kind of linear recurrence."""

    name: str
    run: Callable[[Tokens], tuple[Tensor, Tensor]]
    """tokens -> (out (B, L, ...), final state): the kernel from a zero state."""
    extended: Callable[[Tokens], tuple[Tensor, Tensor, Tensor, Tensor]]
    """tokens -> (o0, basis, B, A): the kernel once, with the identity block appended."""
    carry: Callable[[Tensor, Tensor], Tensor]
    """(A, S) -> the state A maps S to (without B)."""
    read: Callable[[Tensor, Tensor], Tensor]
    """(basis, S) -> (B, L, ...) what the rows read of an incoming state S."""


class _GatherPieces(torch.autograd.Function):
    """(n, ...) on every rank -> (N, n, ...) in group-rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return gather_shards(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        reduce_scatter_into(out, grad.flatten(0, 1), group=ctx.group)
        return out, None


def gather_pieces(x: Tensor, group, world: int) -> Tensor:
    """Every rank's ``x`` stacked: (N, *x.shape), autograd-aware (gradients go to owners)."""
    return x.unsqueeze(0) if world == 1 else _GatherPieces.apply(x, group)


class _Tie(torch.autograd.Function):
    """``out`` unchanged, but backward also gives ``anchor`` a (zero) gradient: every rank
    must run the all-gather's backward (a collective), also a rank whose outputs read no
    incoming state (the first piece of the sequence)."""

    @staticmethod
    def forward(ctx, out: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def tie(out: Tensor, anchor: Tensor) -> Tensor:
    """``out``, with ``anchor`` (an all-gather's result) in its backward graph."""
    return _Tie.apply(out, anchor) if anchor.requires_grad else out


def _slice(tokens: Tokens, rows: slice, batch: slice = slice(None)) -> Tokens:
    return {k: t[batch, rows] for k, t in tokens.items()}


def piece_map(rec: Recurrence, tokens: Tokens, ids: Tensor | None):
    """One piece's (o0, basis, B, A); ``ids`` (B, L) its document ids or None."""
    if ids is None or not bool(starts(ids).any()):
        return rec.extended(tokens)
    rows = []
    for b in range(ids.size(0)):  # each batch row has its own document starts
        cuts = [0] + starts(ids[b:b + 1])[0].nonzero().flatten().tolist() + [ids.size(1)]
        row = slice(b, b + 1)
        o0, basis, state, a = rec.extended(_slice(tokens, slice(cuts[0], cuts[1]), row))
        outs, bases = [o0], [basis]
        for lo, hi in zip(cuts[1:-1], cuts[2:]):  # later documents: from a zero state
            out, state = rec.run(_slice(tokens, slice(lo, hi), row))
            outs.append(out)
            bases.append(basis.new_zeros(1, hi - lo, *basis.shape[2:]))
        if len(cuts) > 2:
            a = torch.zeros_like(a)  # a document starts here: the incoming state is forgotten
        rows.append((torch.cat(outs, 1), torch.cat(bases, 1), state, a))
    return tuple(torch.cat(parts, 0) for parts in zip(*rows))


def _edges(ids: Tensor, pieces: list[Piece], slots: int) -> Tensor:
    """(slots, 2, B): each piece's first and last document id (-1 for an empty slot)."""
    out = ids.new_full((slots, 2, ids.size(0)), -1)
    for p in pieces:
        out[p.slot, 0], out[p.slot, 1] = ids[:, p.start], ids[:, p.stop - 1]
    return out


def scan(rec: Recurrence, tokens: Tokens, group=None, layout: str = "contiguous",
         ring_degree: int | None = None, document_ids: Tensor | None = None,
         output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """The recurrence over this rank's shard, exact as on the whole sequence.

    ``tokens``: this rank's per-token inputs, (B, S_local, ...), cut with ``layout``
    (easy_context.layouts) over ``group`` (a process group, an SPGroup or None: the world);
    ``document_ids`` (B, S_local) or None. Returns (out (B, S_local, ...), the state after
    the whole sequence (the same on every rank) or None)."""
    pg = process_group(group)
    # "whole": every rank holds the whole sequence, nothing to exchange
    world = dist.get_world_size(pg) if dist.is_initialized() and layout != "whole" else 1
    rank = dist.get_rank(pg) if world > 1 else 0
    local = next(iter(tokens.values())).size(1)
    table = piece_table(layout, world, local, ring_degree)
    mine = table[rank]
    slots = max(len(p) for p in table)

    maps = [piece_map(rec, _slice(tokens, slice(p.start, p.stop)),
                      None if document_ids is None else document_ids[:, p.start:p.stop])
            for p in mine]
    # every piece's (A, B) in one collective (one backward collective: no order to agree on),
    # flattened per batch row and packed per slot; empty slots are zeros that nobody reads
    a_like, b_like = maps[0][3], maps[0][2]
    packed = _stack([torch.cat([m[3].flatten(1), m[2].flatten(1)], 1) for m in maps], slots)
    gathered = gather_pieces(packed, pg, world)  # (N, slots, B, |A| + |B|)
    split = a_like[0].numel()
    a_all = gathered[..., :split].unflatten(-1, a_like.shape[1:])  # (N, slots, B, H, ...)
    b_all = gathered[..., split:].unflatten(-1, b_like.shape[1:])
    edges = None
    if document_ids is not None:  # (N, slots, 2, B)
        edges = _edges(document_ids, mine, slots)
        edges = gather_shards(edges, pg) if world > 1 else edges.unsqueeze(0)

    order = sequence_order(table)
    if not output_final_state:  # nothing after this rank's last piece matters here
        order = order[:1 + max(i for i, p in enumerate(order) if p.rank == rank)]
    states = chain(rec, order, lambda p: (a_all[p.rank, p.slot], b_all[p.rank, p.slot]),
                   None if edges is None else lambda p: edges[p.rank, p.slot])
    incoming = {p.slot: states[i] for i, p in enumerate(order) if p.rank == rank}
    state = states[-1] if output_final_state else None

    outs = []
    for p, (o0, basis, _, _) in zip(mine, maps):
        s_in = incoming[p.slot]
        outs.append(o0 if s_in is None else o0 + rec.read(basis, s_in).to(o0.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if world > 1:
        out = tie(out, gathered)
    return out, state


def chain(rec: Recurrence, order: list[Piece], map_of: Callable[[Piece], tuple[Tensor, Tensor]],
          edges_of: Callable[[Piece], Tensor] | None = None) -> list[Tensor | None]:
    """The state entering each piece of ``order`` (sequence order), then the state after the
    last: ``len(order) + 1`` states, None for a zero state. ``map_of(p)`` is the piece's
    (A, B); ``edges_of(p)`` (2, B) its first and last document ids, or None: no documents."""
    states, state = [], None
    for i, p in enumerate(order):
        if state is not None and edges_of is not None:  # a document starts at the piece
            fresh = edges_of(p)[0] != edges_of(order[i - 1])[1]  # (B,)
            keep = (~fresh).view(-1, *[1] * (state.dim() - 1))
            state = torch.where(keep, state, torch.zeros_like(state))
        states.append(state)
        a, b = map_of(p)
        state = b if state is None else rec.carry(a, state) + b
    return states + [state]


def _stack(states: list[Tensor], slots: int) -> Tensor:
    """(slots, ...) of a rank's per-piece states, zeros in unused slots."""
    if len(states) < slots:
        states = states + [torch.zeros_like(states[0])] * (slots - len(states))
    return torch.stack(states).contiguous()
