"""Which rows of each K/V shard a ring has to move, when a layer's plan leaves some unread.

Under a sliding window (or chunks, or packed documents) a rank's calls read only some rows
of another rank's K/V shard: the keys within reach of its queries (documents.py trims every
call to them). A ring relays shards, so what rank r passes on at step t is the rows of the
shard it holds (src = r - t) that *some later step* reads, on whichever rank runs it: the
``carry`` of (src, t + 1), the union of what ranks src + t + 1 ... read of it. It shrinks
along the ring, and once no later rank reads anything of src, nothing of it travels. The
dK/dV partial a rank sends back to src covers only the rows it read. Every rank builds the
same plan from the same geometry and ids (no collective), so both ends of each transfer
agree on its rows.

Under a window W at zigzag N = 2, each rank sends W - 1 rows of K/V instead of its whole
shard, and in backward W - 1 rows of dK/dV partials: communication falls with the window.
:func:`window_traffic` gives the planner those figures for a method, layout and window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..attention.documents import ShardDocuments
from .accumulate import span
from .blocks import block_calls

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-empty [start, stop) row ranges


def merge_ranges(spans: Iterable[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def rows_in(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


@dataclass(frozen=True)
class RingPlan:
    """The rows each transfer of one ring attention call moves (see the module doc)."""

    world: int
    local_len: int
    steps: int
    block_reads: dict
    """(src, dst) -> the rows of src's shard each block of schedule(src, dst) reads, one
    Ranges per block, in shard rows."""

    def reads(self, src: int, dst: int) -> Ranges:
        return merge_ranges(r for block in self.block_reads[(src, dst)] for r in block)

    def carry(self, src: int, step: int) -> Ranges:
        """Rows of src's shard read at ring steps ``step`` .. steps - 1 (by rank src + t)."""
        return merge_ranges(r for t in range(step, self.steps)
                            for r in self.reads(src, (src + t) % self.world))

    def whole(self, ranges: Ranges) -> bool:
        return ranges == ((0, self.local_len),)

    def sent_rows(self, rank: int) -> tuple[int, int]:
        """(K/V rows ``rank`` passes on over the ring once, dK/dV partial rows it sends back)
        in one call: forward sends the first, backward both."""
        kv = sum(rows_in(self.carry((rank - t) % self.world, t + 1))
                 for t in range(self.steps - 1))
        partials = sum(rows_in(self.reads((rank - t) % self.world, rank))
                       for t in range(1, self.steps))
        return kv, partials


Schedule = Callable[[int, int, int, bool], list]


def ring_plan(schedule: Schedule, docs: ShardDocuments | None, world: int, local_len: int,
              causal: bool, steps: int) -> RingPlan | None:
    """The plan of a ring call, kept with the documents' other plans (every layer and every
    KV-head group asks the same); None without documents or a geometry: whole shards."""
    if docs is None:
        return None
    key = ("ring_plan", schedule, world, local_len, causal, steps)
    if key not in docs._memo:
        reads = {}
        for src in range(world):
            for dst in range(world):
                reads[(src, dst)] = tuple(
                    _block_rows(docs, dst, blk, src, local_len)
                    for blk in schedule(src, dst, local_len, causal))
        docs._memo[key] = RingPlan(world, local_len, steps, reads)
    return docs._memo[key]


def _block_rows(docs: ShardDocuments, q_shard: int, blk, kv_shard: int, local_len: int) -> Ranges:
    k0, k1 = span(blk.kv, local_len)
    calls = block_calls(docs, q_shard, blk.q, kv_shard, blk.kv, blk.causal)
    return merge_ranges((k0 + a, k0 + b) for c in calls for a, b in [span(c.kv, k1 - k0)])


def window_traffic(method: str, world: int, seq_len: int, window: int | None,
                   kv_bytes_per_row: int, ring_degree: int | None = None) -> dict:
    """What one layer of ``method`` sends under a sliding ``window`` (None: a global layer)
    on ``world`` ranks for a ``seq_len``-token sequence, for the planner.

    ``kv_bytes_per_row``: bytes of one token's K and V of the heads the ring carries (2 x
    kv_heads x head_dim x element size; with usp, of the heads one ring rank holds).
    Returns {"steps": ring steps run, "of": steps of a global layer, "forward_bytes",
    "backward_bytes": the busiest rank's sends (dK/dV partials are K/V-sized), "global_bytes":
    the same layer without a window, forward + backward}. Ring-shaped methods (ring,
    zigzag, usp's ring part) move only what the window reads (this module); the others
    send what they send for a global layer (allgather, ulysses: every token; dist_flash:
    whole shards, on fewer steps)."""
    from . import get_method
    from .. import layouts
    from ..attention.variants import Variant
    from .ring import contiguous_schedule, ring_steps
    from .zigzag import zigzag_schedule

    m = get_method(method)
    if m.name == "usp_attn":
        ring = ring_degree if ring_degree is not None else world
        ring_world, layout, schedule = ring, "zigzag", zigzag_schedule
    elif m.name in ("ring_attn", "zigzag_ring_attn"):
        ring_world, layout = world, m.layout
        schedule = contiguous_schedule if m.name == "ring_attn" else zigzag_schedule
    else:
        steps = world
        if m.name == "dist_flash_attn" and window is not None:
            from .dist_flash import _steps

            s = seq_len // world
            geo = Variant(window).geometry(
                tuple(layouts.segments("contiguous", r, world, s) for r in range(world)),
                True, seq_len)
            docs = None if geo is None else ShardDocuments.plain((s,) * world, geo)
            steps = len(_steps(world, True, s, docs))
        full = m.comm_bytes_rows(world, seq_len) if hasattr(m, "comm_bytes_rows") else None
        return {"steps": steps, "of": world, "whole_shards": True, "rows_model": full}
    s = seq_len // ring_world
    geo = None if window is None else Variant(window).geometry(
        tuple(layouts.segments(layout, r, ring_world, s) for r in range(ring_world)),
        True, seq_len)
    docs = None if geo is None else ShardDocuments.plain((s,) * ring_world, geo)
    steps = ring_steps(schedule, docs, ring_world, s, True)
    plan = ring_plan(schedule, docs, ring_world, s, True, steps)
    whole = (ring_world - 1) * s
    sent = ([(whole, whole)] if plan is None
            else [plan.sent_rows(r) for r in range(ring_world)])
    return {"steps": steps, "of": ring_world,
            "forward_bytes": max(kv for kv, _ in sent) * kv_bytes_per_row,
            "backward_bytes": max(kv + p for kv, p in sent) * kv_bytes_per_row,
            "global_bytes": 3 * whole * kv_bytes_per_row}
