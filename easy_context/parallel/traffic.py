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
from .method import AttentionDims

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


def window_traffic(method: str, dims: AttentionDims, seq_len: int, world: int,
                   window: int | None, a: int = 2, ring_degree: int | None = None,
                   lse_bytes: int = 4) -> dict:
    """What one layer of ``method`` sends, on the busiest rank, under a sliding ``window``
    (None: a global layer) over ``world`` ranks for a ``seq_len``-token sequence with
    attention shape ``dims`` and ``a`` bytes per element (v's head dim taken as q's).

    Returns {"steps": ring steps run (dist_flash: schedule steps), "of": those of a global
    layer, "forward_bytes", "backward_bytes", "global_forward_bytes",
    "global_backward_bytes"}. Ring-shaped methods (ring, zigzag, usp's ring part) move only
    the K/V rows the window reads and dist_flash only the keys each task reads (their queries
    and results still travel whole); allgather, ulysses and usp's Ulysses part send for a
    window layer what they send for a global one (method.comm_bytes, forward + backward,
    reported as backward_bytes with forward_bytes None)."""
    from . import get_method

    m = get_method(method)
    if m.name in ("ring_attn", "zigzag_ring_attn") or (
            m.name == "usp_attn" and ring_degree is not None and ring_degree > 1):
        return _ring_traffic(m, dims, seq_len, world, window, a, ring_degree)
    if m.name == "dist_flash_attn":
        return _dist_flash_traffic(dims, seq_len, world, window, a, lse_bytes)
    total = m.comm_bytes(dims, seq_len // world, a, world, ring_degree)
    return {"steps": None, "of": None, "forward_bytes": None, "backward_bytes": total,
            "global_forward_bytes": None, "global_backward_bytes": total}


def _plain(layout: str, world: int, s: int, window: int | None) -> ShardDocuments | None:
    from .. import layouts
    from ..attention.variants import Variant

    geo = None if window is None else Variant(window).geometry(
        tuple(layouts.segments(layout, r, world, s) for r in range(world)), True, world * s)
    return None if geo is None else ShardDocuments.plain((s,) * world, geo)


def _ring_traffic(m, dims, seq_len, world, window, a, ring_degree) -> dict:
    from .ring import contiguous_schedule, ring_steps
    from .zigzag import zigzag_schedule

    hq, hkv, hd = dims
    ring, kv_heads = world, hkv
    if m.name == "usp_attn":  # the ring runs over ring ranks on 1/U of the heads
        ring, kv_heads = ring_degree, max(1, hkv // (world // ring_degree))
    schedule = contiguous_schedule if m.name == "ring_attn" else zigzag_schedule
    s = seq_len // ring
    row = 2 * kv_heads * hd * a
    docs = _plain("contiguous" if m.name == "ring_attn" else "zigzag", ring, s, window)
    steps = ring_steps(schedule, docs, ring, s, True)
    plan = ring_plan(schedule, docs, ring, s, True, steps)
    # a global layer relays whole shards and returns each block's whole dK/dV
    whole = [((ring - 1) * s,
              sum(rows_in(((span(blk.kv, s)),)) for t in range(1, ring)
                  for blk in schedule((r - t) % ring, r, s, True)))
             for r in range(ring)]
    sent = whole if plan is None else [plan.sent_rows(r) for r in range(ring)]
    return {"steps": steps, "of": ring,
            "forward_bytes": max(kv for kv, _ in sent) * row,
            "backward_bytes": max(kv + p for kv, p in sent) * row,
            "global_forward_bytes": max(kv for kv, _ in whole) * row,
            "global_backward_bytes": max(kv + p for kv, p in whole) * row}


def _dist_flash_traffic(dims, seq_len, world, window, a, lse_bytes) -> dict:
    from .dist_flash import _kv_rows, _rows, _steps

    hq, hkv, hd = dims
    s = seq_len // world
    q_row, kv_row, lse_row = hq * hd * a, 2 * hkv * hd * a, hq * lse_bytes

    def sends(docs):
        fwd, bwd = [0] * world, [0] * world
        for step in _steps(world, True, s, docs):
            for t in step:
                q_rows = _rows(t.rows, s)
                nq = q_rows.stop - q_rows.start
                kv = _kv_rows(t, docs, True, s)
                nkv = kv.stop - kv.start
                if t.q_owner != t.rank:  # q to the helper, (out, lse) / dq back
                    fwd[t.q_owner] += nq * q_row
                    fwd[t.rank] += nq * (q_row + lse_row)
                    bwd[t.q_owner] += nq * (3 * q_row + lse_row)
                    bwd[t.rank] += nq * q_row
                if t.kv_owner != t.rank:  # K/V to the computer, dK/dV back
                    fwd[t.kv_owner] += nkv * kv_row
                    bwd[t.kv_owner] += nkv * kv_row
                    bwd[t.rank] += nkv * kv_row
        return max(fwd), max(bwd), len(_steps(world, True, s, docs))

    f, b, steps = sends(_plain("contiguous", world, s, window))
    gf, gb, global_steps = sends(None)
    return {"steps": steps, "of": global_steps, "forward_bytes": f, "backward_bytes": b,
            "global_forward_bytes": gf, "global_backward_bytes": gb}
