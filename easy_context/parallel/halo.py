"""All-gather attention's halo: the K/V rows of other ranks a rank's queries read, when a
layer's plan leaves some unread (a sliding window, chunks, image spans; with packed
documents on top).

All-gather attention (allgather.py) gives every rank the whole sequence's K/V. Under a
window W, rank r's zigzag queries (chunks r and 2N-1-r, c rows each) read only the keys in
[jc - W + 1, (j+1)c) of each of their chunks j: the W - 1 rows before each chunk, a *halo*,
on the ranks holding chunks r - 1 and 2N-2-r (or further back when W > c). So under such a
plan each rank sends each other rank exactly the rows of its shard that the other's kernel
calls read (point-to-point, all posted at once), and in backward receives back, from each
rank it sent rows to, the float32 dK/dV of those rows, which it adds to its own share.

:class:`Halo` is built from the very kernel calls every rank runs
(allgather._block_calls on each rank's plan), so a row travels iff some call reads it; every
rank builds the same plan from the same geometry and ids (no collective). It is used only
where it moves less than the all-gather (the busiest rank sends fewer rows than its whole
shard to each of N - 1 ranks); window_cost.window_traffic counts the same rows for the
planner.

Example (N = 4, 32-row shards, window 4): each rank sends 3 rows to each of at most two
ranks (6 rows) in forward instead of 3 x 32 = 96; backward the same again, and 6 rows of
float32 dK/dV partials instead of 96.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .. import layouts
from ..attention.documents import Geometry
from .accumulate import span
from .comm import Exchange
from .traffic import Ranges, merge_ranges, rows_in

Tensor = torch.Tensor


@dataclass(frozen=True)
class Halo:
    """``need[dst][src]``: the rows of src's zigzag shard that dst's kernel calls read, in
    shard rows, cut at the chunk boundary (each piece is one stretch of the sequence);
    ``need[r][r]`` is () (a rank's own rows never travel)."""

    world: int
    local_len: int
    need: tuple[tuple[Ranges, ...], ...]

    def sent_rows(self, rank: int) -> tuple[int, int]:
        """(K/V rows ``rank`` sends once, float32 dK/dV rows it sends back) in one call:
        forward sends the first, backward both."""
        kv = sum(rows_in(self.need[dst][rank]) for dst in range(self.world))
        return kv, sum(rows_in(r) for r in self.need[rank])

    def useful(self) -> bool:
        """Whether it moves less than the all-gather on the busiest rank."""
        whole = (self.world - 1) * self.local_len
        return max(self.sent_rows(r)[0] for r in range(self.world)) < whole


def rank_geometry(geometry: Geometry, rank: int, world: int, local_len: int) -> Geometry:
    """All-gather attention's geometry for ``rank``: its zigzag queries (shard 0) against the
    whole sequence (shard 1), the rest as ``geometry`` (any rank's)."""
    return dataclasses.replace(geometry, segments=(
        layouts.segments("zigzag", rank, world, local_len), ((0, world * local_len, 0),)))


def halo_plan(world: int, local_len: int, block_calls_of: Callable[[int], list]) -> Halo:
    """The halo from each rank's kernel calls: ``block_calls_of(rank)`` lists (query rows,
    key rows of the whole sequence, calls) of that rank (allgather._block_calls)."""
    need, n = [], world * local_len
    for dst in range(world):
        read = merge_ranges((k0 + a, k0 + b)
                            for _, keys, calls in block_calls_of(dst)
                            for k0, k1 in [span(keys, n)]
                            for c in calls
                            for a, b in [span(c.kv, k1 - k0)])
        need.append(tuple(() if src == dst else _shard_rows(read, src, world, local_len)
                          for src in range(world)))
    return Halo(world, local_len, tuple(need))


def _shard_rows(read: Ranges, src: int, world: int, local_len: int) -> Ranges:
    """The pieces of sequence ranges ``read`` that src's shard holds, in its shard rows, one
    per stretch of the sequence (not merged across the chunk boundary)."""
    out = []
    for r0, r1, seq0 in layouts.segments("zigzag", src, world, local_len):
        for a, b in read:
            lo, hi = max(a, seq0), min(b, seq0 + r1 - r0)
            if lo < hi:
                out.append((r0 + lo - seq0, r0 + hi - seq0))
    return tuple(out)


def _sequence_rows(rows: tuple[int, int], src: int, world: int, local_len: int) -> slice:
    """The sequence rows of one piece of src's shard (within one chunk)."""
    for r0, r1, seq0 in layouts.segments("zigzag", src, world, local_len):
        if r0 <= rows[0] and rows[1] <= r1:
            return slice(seq0 + rows[0] - r0, seq0 + rows[1] - r0)
    raise AssertionError(f"rows {rows} cross a chunk boundary of shard {src}")


def exchange_kv(packed: Tensor, halo: Halo, rank: int, group) -> Tensor:
    """The whole sequence's K/V buffer (P, B, N s, ...) in sequence order holding this rank's
    rows and the halo rows its calls read; ``packed`` (P, B, s, ...) its own. Rows no call
    reads are left unset (never read)."""
    world, s = halo.world, halo.local_len
    kv_all = packed.new_empty(*packed.shape[:2], world * s, *packed.shape[3:])
    for r0, r1, seq0 in layouts.segments("zigzag", rank, world, s):
        kv_all[:, :, seq0:seq0 + r1 - r0] = packed[:, :, r0:r1]
    ex, landing = Exchange(group), []
    for dst in range(world):
        for a, b in halo.need[dst][rank]:
            ex.send(packed[:, :, a:b], dst)
    for src in range(world):
        for piece in halo.need[rank][src]:
            part = kv_all[:, :, _sequence_rows(piece, src, world, s)]
            landing.append((part, ex.recv(part, src)))
    ex.start().wait()
    for dst, got in landing:
        dst.copy_(got)
    return kv_all


def return_partials(dkv_all: Tensor, halo: Halo, rank: int, group) -> Tensor:
    """This rank's float32 dK/dV (P, B, s, ...): its own share of ``dkv_all`` (P, B, N s, ...,
    float32, sequence order) plus what every rank that read its rows sends back; sends our
    share of the rows we read to their owners."""
    world, s = halo.world, halo.local_len
    own = layouts.shard(dkv_all, "zigzag", rank, world, dim=2).contiguous()
    ex, arriving = Exchange(group), []
    for src in range(world):
        for piece in halo.need[rank][src]:
            ex.send(dkv_all[:, :, _sequence_rows(piece, src, world, s)], src)
    for dst in range(world):
        for a, b in halo.need[dst][rank]:
            arriving.append(((a, b), ex.recv(own[:, :, a:b], dst)))
    ex.start().wait()
    for (a, b), got in arriving:  # in rank order: every rank sums alike
        own[:, :, a:b] += got
    return own
