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

Relaying is not always the cheapest way there. In the zigzag layout a rank's second chunk
(2N-1-r) is read under a window by the rank holding chunk 2N-r, i.e. rank r - 1: N - 1 steps
round the ring, so a relay passes those rows through N - 2 ranks that read none of them
(N = 4, window 4, 32-row shards: each rank passes 9 rows on where its 3 + 3 read rows would
do). So when a plan leaves rows unread, each rank may instead send its *own* rows straight
to the rank that reads them at that step (``direct``: at step t, rank r sends r + t + 1 the
rows of its shard r + t + 1 reads, and receives from r - t - 1): the compute order and the
overlap are the same, only the peers change. The plan picks direct sends when the busiest
rank sends no more that way and all ranks together send less (ties keep the neighbour ring,
whose peers are fixed); every rank computes the same choice.

Under a window W at zigzag N = 2, each rank sends W - 1 rows of K/V instead of its whole
shard, and in backward W - 1 rows of dK/dV partials: communication falls with the window.
:func:`easy_context.parallel.window_cost.window_traffic` gives the planner those figures
for a method, world size and window.
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
    direct: bool = False
    """K/V go from their owner straight to the rank reading them (module doc), not relayed."""

    def reads(self, src: int, dst: int) -> Ranges:
        return merge_ranges(r for block in self.block_reads[(src, dst)] for r in block)

    def carry(self, src: int, step: int) -> Ranges:
        """Rows of src's shard read at ring steps ``step`` .. steps - 1 (by rank src + t)."""
        return merge_ranges(r for t in range(step, self.steps)
                            for r in self.reads(src, (src + t) % self.world))

    def whole(self, ranges: Ranges) -> bool:
        return ranges == ((0, self.local_len),)

    def travel(self, rank: int, step: int) -> tuple[bool, int, Ranges, int, Ranges]:
        """The K/V transfer ``rank`` posts at ``step`` for step + 1: (whether it sends rows of
        its own shard (direct) or of the one it holds (relay), the peer it sends to, those
        rows, the peer it receives from, the rows that arrive)."""
        w = self.world
        if self.direct:
            to, frm = (rank + step + 1) % w, (rank - step - 1) % w
            return True, to, self.reads(rank, to), frm, self.reads(frm, rank)
        return (False, (rank + 1) % w, self.carry((rank - step) % w, step + 1),
                (rank - 1) % w, self.carry((rank - 1 - step) % w, step + 1))

    def sent_rows(self, rank: int) -> tuple[int, int]:
        """(K/V rows ``rank`` sends once over the steps, dK/dV partial rows it sends back)
        in one call: forward sends the first, backward both."""
        kv = sum(rows_in(self.travel(rank, t)[2]) for t in range(self.steps - 1))
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
        relay = RingPlan(world, local_len, steps, reads)
        direct = RingPlan(world, local_len, steps, reads, direct=True)
        kv = [[p.sent_rows(r)[0] for r in range(world)] for p in (relay, direct)]
        better = max(kv[1]) <= max(kv[0]) and sum(kv[1]) < sum(kv[0])
        docs._memo[key] = direct if better else relay
    return docs._memo[key]


def _block_rows(docs: ShardDocuments, q_shard: int, blk, kv_shard: int, local_len: int) -> Ranges:
    k0, k1 = span(blk.kv, local_len)
    calls = block_calls(docs, q_shard, blk.q, kv_shard, blk.kv, blk.causal)
    return merge_ranges((k0 + a, k0 + b) for c in calls for a, b in [span(c.kv, k1 - k0)])
