"""Where every rank's tokens sit in the sequence: the *pieces* a recurrent layer chains.

A piece is a stretch of consecutive sequence positions that one rank holds contiguously in
its shard. A recurrence (or a causal convolution) needs each piece's predecessor in sequence
order, wherever it lives, so every rank computes the whole table, for every rank, from the
layout alone (no communication): ``contiguous`` gives each rank one piece, ``zigzag`` two
(chunks r and 2N-1-r of 2N), ``usp`` one or two (the zigzag shard of its ring rank, cut
contiguously over the Ulysses ranks: a cut can straddle the two chunks).

Packed documents: a document starts where the id differs from the previous token's id in
sequence order (as a kernel given ``cu_seqlens`` resets its state there). That is stricter
than the attention methods' rule (a token sees every earlier token with its id, also across
a stretch of other ids): a recurrence cannot skip over tokens, so ids that return to an
earlier value start a new document here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import layouts

Tensor = torch.Tensor


class Piece(NamedTuple):
    """One stretch of a rank's shard: local rows [start, stop) are sequence positions
    [position, position + stop - start)."""

    rank: int
    slot: int  # its index among the rank's pieces, in local order
    start: int
    stop: int
    position: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def _usp_pieces(rank: int, world: int, local: int, ring_degree: int) -> list[tuple[int, int, int]]:
    uly = world // ring_degree
    ring_rank, uly_rank = divmod(rank, uly)
    chunk = local * uly // 2  # one of the ring rank's two zigzag chunks
    firsts = (ring_rank * chunk, (2 * ring_degree - 1 - ring_rank) * chunk)
    lo, hi = uly_rank * local, (uly_rank + 1) * local  # rows of the ring rank's shard
    out = []
    for half, first in enumerate(firsts):
        a, b = max(lo, half * chunk), min(hi, (half + 1) * chunk)
        if a < b:
            out.append((a - lo, b - lo, first + a - half * chunk))
    return out


def rank_pieces(layout: str, rank: int, world: int, local: int,
                ring_degree: int | None = None) -> list[Piece]:
    """Rank ``rank``'s pieces in local order, for shards of ``local`` rows."""
    if layout == "whole" or world == 1:
        return [Piece(rank, 0, 0, local, 0)]
    if layout == "usp":
        if ring_degree is None:
            raise ValueError("the usp layout needs ring_degree")
        spans = _usp_pieces(rank, world, local, ring_degree)
    else:
        spans = layouts.segments(layout, rank, world, local)
    return [Piece(rank, j, a, b, p) for j, (a, b, p) in enumerate(spans)]


def piece_table(layout: str, world: int, local: int,
                ring_degree: int | None = None) -> list[list[Piece]]:
    """Every rank's pieces (``table[r]``), for shards of ``local`` rows each."""
    if layout == "whole":
        world = 1
    return [rank_pieces(layout, r, world, local, ring_degree) for r in range(world)]


def sequence_order(table: list[list[Piece]]) -> list[Piece]:
    """Every piece of every rank, in sequence order."""
    return sorted((p for pieces in table for p in pieces), key=lambda p: p.position)


def starts(ids: Tensor) -> Tensor:
    """(B, L) document ids of consecutive positions -> (B, L) bool: where a document starts
    inside them (never at row 0: that depends on the token before, elsewhere)."""
    out = torch.zeros_like(ids, dtype=torch.bool)
    out[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return out
