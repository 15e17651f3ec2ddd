"""Ring attention: K/V blocks travel around the ring while each rank keeps its queries.

At step s, rank r holds the K/V shard of rank (r - s) mod N. It computes attention of its
queries against that shard (only the parts the mask allows, as told by a *schedule*), folds
the (out, lse) into its running result, and meanwhile passes the shard on to rank r + 1.
When a plan leaves rows of the shards unread (a sliding window, chunks, packed documents),
only the rows later steps read travel, relayed, or sent by their owner straight to the rank
that reads them where that moves less (traffic.py: the zigzag layout at N >= 4).

Backward replays the ring with the final out and lse: each block's gradient is then exactly
its share of the full gradient. dQ stays home; each block's dK/dV partial goes straight back to
the owner of its K/V shard, which sums them (in its output buffer when no element gets more
than two partials, as at N = 2: bitwise the float32 sum; see accumulate.py).

The engine here serves every ring-shaped method; a method is a layout plus a schedule.
``ring_attn`` uses the contiguous layout, where rank r's queries see shards 0..r: simple, but
rank N-1 does N times the work of rank 0 under a causal mask (see zigzag.py for the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..attention.documents import ShardDocuments, schedule_causal
from ..attention.contract import Kernel, default_scale
from ..attention.selection import select_kernel
from ..attention.variants import Variant, with_softcap
from .. import layouts
from ..mesh import process_group
from .accumulate import GradSum, max_cover, span
from .blocks import (backward_block, block_calls, forward_block, group_buffer_choice,
                     shard_documents)
from .comm import Exchange, group_rank_size
from .function import GroupAlgorithm, check_inputs, run_attention
from .method import AttentionDims, Method
from .traffic import Ranges, RingPlan, ring_plan

Tensor = torch.Tensor
ALL = slice(None)


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows ``q`` against held key rows ``kv``."""

    q: slice
    kv: slice
    causal: bool


# schedule(src, rank, local_len, causal) -> the blocks rank computes against src's K/V shard.
Schedule = Callable[[int, int, int, bool], list[Block]]


def contiguous_schedule(src: int, rank: int, local_len: int, causal: bool) -> list[Block]:
    if not causal or src < rank:
        return [Block(ALL, ALL, False)]
    if src == rank:
        return [Block(ALL, ALL, True)]
    return []  # a later shard: masked out entirely


def ring_steps(schedule: Schedule, docs: ShardDocuments | None, world: int, local_len: int,
               causal: bool) -> int:
    """How many ring steps any rank needs: all of them, unless a sliding window or chunks
    (the plan's geometry) leave every block of the last steps empty on every rank; those
    steps, their kernels and their transfers, are not run. Every rank computes the same
    number from the same plan (no collective)."""
    if docs is None or docs.geometry is None:
        return world
    for step in range(world - 1, 0, -1):
        for rank in range(world):
            src = (rank - step) % world
            if any(block_calls(docs, rank, blk.q, src, blk.kv, blk.causal)
                   for blk in schedule(src, rank, local_len, causal)):
                return step + 1
    return 1


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group, causal: bool, scale: float,
                 schedule: Schedule, kernel: Kernel,
                 docs: ShardDocuments | None = None, steps: int | None = None,
                 ) -> tuple[Tensor, Tensor]:
    """Returns out (q's dtype) and lse (B, H, S) float32 for the local queries.

    ``docs``: the document runs of every rank's shard (packed sequences): each block runs
    as one kernel call per document it holds (blocks.py), no ids travel with K/V.
    ``steps``: the ring steps to run (ring_steps; default all). With ``docs``, only the rows
    of K/V that later steps read travel (traffic.py).
    """
    rank, world = group_rank_size(group)
    steps = world if steps is None else steps
    b, s, h, d = q.shape
    plan = ring_plan(schedule, docs, world, s, bool(causal), steps)
    out = torch.zeros(b, s, h, v.size(-1), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    held = [k, v]  # the shard computed on
    for step in range(steps):
        if step + 1 < steps:  # post the next transfer before computing on this block
            exchange = Exchange(group)
            arriving, landing = _pass_on(exchange, held, [k, v], None,
                                         *_travel(plan, rank, world, step))
            exchange.start()
        k_cur, v_cur = held
        src = (rank - step) % world
        for blk in schedule(src, rank, s, causal):
            calls = block_calls(docs, rank, blk.q, src, blk.kv, blk.causal)
            forward_block(kernel, calls, q[:, blk.q], k_cur[:, blk.kv], v_cur[:, blk.kv], scale,
                          out[:, blk.q], lse[:, :, blk.q])
        if step + 1 < steps:
            exchange.wait()
            _land(landing)
            held = arriving
    return out.to(q.dtype), lse


def _travel(plan: RingPlan | None, rank: int, world: int, step: int):
    """The step's K/V transfer (traffic.RingPlan.travel): (whether our own shard's rows go,
    not the held one's, the peer sent to, its rows, the peer received from, their rows);
    without a plan the held shard goes whole to the next rank (rows None: whole shards)."""
    if plan is None:
        return False, (rank + 1) % world, None, (rank - 1) % world, None
    return plan.travel(rank, step)


def ring_terms(schedule: Schedule, rank: int, world: int, local_len: int,
               causal: bool, steps: int | None = None) -> tuple[int, int]:
    """The most block partials any element of ``rank``'s dQ, and of its dK/dV, receives
    over the first ``steps`` ring steps (default all)."""
    steps = world if steps is None else steps
    dq = [span(blk.q, local_len) for step in range(steps)
          for blk in schedule((rank - step) % world, rank, local_len, causal)]
    dkv = [span(blk.kv, local_len) for step in range(steps)
           for blk in schedule(rank, (rank + step) % world, local_len, causal)]
    return max_cover(dq), max_cover(dkv)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  group, causal: bool, scale: float, schedule: Schedule,
                  kernel: Kernel, docs: ShardDocuments | None = None,
                  grads: tuple[Tensor, Tensor, Tensor] | None = None,
                  steps: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes, written into ``grads`` (views to fill) when given.

    K/V travel as in forward. Each block's dK/dV partial goes straight back to the shard's
    owner, which sums its partials (accumulate.GradSum: in the output buffer when an element
    gets at most two, else in float32).

    When transfers are posted is memory against overlap: a kernel call is where a step's
    memory peaks (its dq/dk/dv blocks and its own float32 working buffers), so every buffer
    in flight during one adds to the peak.
    - Steps 1 .. N-2 (N >= 3): the shard held came in from the previous rank, contiguous, so
      it is passed on as it is before the kernel runs, and the next shard lands in a reused
      double buffer (the receive buffers of the shard passed on a step earlier): two shards'
      worth more during the call, the price of hiding the transfer, and a rank need not wait
      for its predecessor's kernel to end before starting the next step.
    - Step 0: our own shard is a view of one KV head of k, v, not contiguous: posting it
      before the diagonal call would hold a send copy and a receive buffer through it, which
      cost more memory (it broke the per-rank memory target at N = 2) than the transfer it
      hides (under 1% of the backward). So step 0's shard is posted after the call, with the
      first partials; at N = 2 that is the only shard that travels.
    The figures behind these choices: benchmarks/attention.py, results in
    benchmarks/results/attention.json.
    - The dK/dV partials exist only after the kernel: posted after it.
    """
    rank, world = group_rank_size(group)
    steps = world if steps is None else steps
    s = q.size(1)
    plan = ring_plan(schedule, docs, world, s, bool(causal), steps)
    if grads is None:
        grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dq_terms, dkv_terms = ring_terms(schedule, rank, world, s, causal, steps)
    dq, dk, dv = GradSum(grads[0], dq_terms), GradSum(grads[1], dkv_terms), GradSum(grads[2], dkv_terms)
    held = [k, v]  # the shard computed on
    spare = None  # receive buffers whose shard has been passed on: the next one lands there
    for step in range(steps):
        src = (rank - step) % world
        more = step + 1 < steps
        early = more and step > 0
        rows = _travel(plan, rank, world, step)
        if early:  # pass the received shard on and fetch the next while the kernel runs
            kv_ex = Exchange(group)
            arriving, landing = _pass_on(kv_ex, held, [k, v], spare, *rows)
            kv_ex.start()
        owed = _ring_step_backward(dout, q, out, lse, held, docs, src, rank, causal, scale,
                                   schedule, kernel, dq, dk, dv, plan)
        if steps == 1:  # one rank, or a window inside the shard: nothing travels
            break
        ex = Exchange(group)
        if more and not early:  # step 0: our own shard, after the kernel (see above)
            arriving, landing = _pass_on(ex, held, [k, v], None, *rows)
        if not more:
            held = None  # the last shard: done with
        if step > 0:  # partials owed to src; ours from the rank that now holds our shard
            for t in owed:
                ex.send(t, src)
            computer = (rank + step) % world
            parts = _partial_rows(plan, schedule, rank, computer, s, causal)
            mine = [ex.recv(t[:, a:b], computer) for a, b in parts for t in (k, v)]
        ex.start().wait()
        if early:
            kv_ex.wait()
        if more:
            _land(landing)
        del owed
        if more:
            spare, held, arriving = (held if step > 0 else None), arriving, None
        if step > 0:
            for (a, b), dk_b, dv_b in zip(parts, mine[0::2], mine[1::2]):
                dk.add(dk_b, slice(a, b))
                dv.add(dv_b, slice(a, b))
            del mine
    for acc in (dq, dk, dv):
        acc.finish()
    return grads


def _partial_rows(plan: RingPlan | None, schedule: Schedule, owner: int, computer: int,
                  s: int, causal: bool) -> list[tuple[int, int]]:
    """The rows of ``owner``'s shard of each dK/dV partial ``computer`` sends back to it, in
    the order it sends them: per block, the rows the block read (whole blocks without a plan)."""
    if plan is None:
        return [span(blk.kv, s) for blk in schedule(owner, computer, s, causal)]
    return [r for block in plan.block_reads[(owner, computer)] for r in block]


def _pass_on(ex: Exchange, held: list[Tensor], own: list[Tensor],
             spare: list[Tensor] | None, direct: bool, nxt: int, out_rows: Ranges | None,
             prv: int, in_rows: Ranges | None,
             ) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
    """Add to ``ex`` sending ``held`` (``own``, our shard, when ``direct``; its ``out_rows``,
    None: whole) to ``nxt`` and receiving ``prv``'s shard (its ``in_rows``) into ``spare``
    when given, else into new shard-sized buffers; rows that do not travel are never read
    there (traffic.py). Returns the receive buffers and the (destination, received) copies
    to make after the wait (row ranges of a batch of several rows are not contiguous views)."""
    for t in (own if direct else held):
        if out_rows is None:
            ex.send(t, nxt)
        else:
            for a, b in out_rows:
                ex.send(t[:, a:b], nxt)
    if spare is None and in_rows is None:
        return [ex.recv(t, prv) for t in held], []
    bufs = spare if spare is not None else [
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in held]
    if in_rows is None:
        return [ex.recv_into(buf, prv) for buf in bufs], []
    landing = []
    for buf in bufs:
        for a, b in in_rows:
            part = buf[:, a:b]
            if part.is_contiguous():
                ex.recv_into(part, prv)
            else:
                landing.append((part, ex.recv(part, prv)))
    return bufs, landing


def _land(landing: list[tuple[Tensor, Tensor]]) -> None:
    for dst, got in landing:
        dst.copy_(got)


def _ring_step_backward(dout, q, out, lse, held, docs, src, rank, causal, scale, schedule,
                        kernel, dq: GradSum, dk: GradSum, dv: GradSum,
                        plan: RingPlan | None = None) -> list[Tensor]:
    """One step's blocks against src's shard (``held``); adds what stays home, returns the
    dK/dV partials owed to src, in the order of :func:`_partial_rows`: the rows each block
    read (with a plan), or one whole pair per block (zeros for a block no query sees)."""
    s = q.size(1)
    k_cur, v_cur = held
    owed = []
    reads = None if plan is None or src == rank else plan.block_reads[(src, rank)]
    for i, blk in enumerate(schedule(src, rank, s, causal)):
        calls = block_calls(docs, rank, blk.q, src, blk.kv, blk.causal)
        if not calls:
            if src != rank and reads is None:
                owed += [torch.zeros_like(t[:, blk.kv], memory_format=torch.contiguous_format)
                         for t in (k_cur, v_cur)]
            continue
        dq_b, dk_b, dv_b = backward_block(
            kernel, calls, dout[:, blk.q], q[:, blk.q], k_cur[:, blk.kv], v_cur[:, blk.kv],
            out[:, blk.q], lse[:, :, blk.q], scale, sum_float32=docs is not None and docs.repeated)
        dq.add(dq_b, blk.q)
        del dq_b
        if src == rank:
            dk.add(dk_b, blk.kv)
            dv.add(dv_b, blk.kv)
        elif reads is None:
            owed += [dk_b, dv_b]
        else:
            k0 = span(blk.kv, s)[0]
            for a, b in reads[i]:
                owed += [dk_b[:, a - k0:b - k0], dv_b[:, a - k0:b - k0]]
        del dk_b, dv_b
    return owed


def run_ring(q, k, v, group, causal, softmax_scale, schedule: Schedule,
             document_ids: Tensor | None = None, variant: Variant | None = None,
             sinks: Tensor | None = None, layout: str = "contiguous") -> Tensor:
    """A ring method on local shards: ``schedule`` says which blocks each step computes,
    ``layout`` how the shards were cut (where a sliding window or chunks fall)."""
    check_inputs(q, k, v, document_ids, sinks)
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    pg = process_group(group)
    world = dist.get_world_size(pg)
    s = q.size(1)
    dims = AttentionDims(q.size(2), k.size(2), q.size(3))
    kernel = with_softcap(select_kernel(q), variant and variant.softcap)
    per_group = group_buffer_choice(
        lambda g: ring_buffers(dims, s, q.element_size(), world, None, g), q, k, kernel,
        (s, k.size(1)))
    geometry = None if variant is None else variant.geometry(
        tuple(layouts.segments(layout, r, world, s) for r in range(world)), causal, world * s)
    docs = shard_documents(document_ids, pg, geometry, s)
    causal = schedule_causal(bool(causal), geometry)  # image spans: every block is asked
    steps = ring_steps(schedule, docs, world, s, bool(causal))
    algo = GroupAlgorithm(ring_forward, ring_backward, pg, bool(causal), scale, kernel,
                          docs, per_group, (("schedule", schedule), ("steps", steps)))
    return run_attention(algo, q, k, v, sinks)


def ring_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
              softmax_scale: float | None = None, document_ids: Tensor | None = None,
              ring_degree: int | None = None, variant: Variant | None = None,
              sinks: Tensor | None = None) -> Tensor:
    """Ring attention over contiguous shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``document_ids`` (B, S/N), optional: packed documents; no token attends across them.
    """
    return run_ring(q, k, v, group, causal, softmax_scale, contiguous_schedule, document_ids,
                    variant, sinks, "contiguous")


# --------------------------------------------------------------------------- planner costs
def ring_buffers(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None,
                 kv_heads: int = 1) -> int:
    """One layer's backward for a group of ``kv_heads`` KV heads: the K/V shard being sent
    (a contiguous copy) and received (2 x 2D x a per token and KV head), the dK/dV partials
    sent back to their owner and arriving, in the input dtype (2 x 2D x a; summed in the
    output buffers, accumulate.py), and the group's float32 dq sum, which exists from N = 3
    up (g D x 4 for the g query heads of a KV head; counted always)."""
    hq, hkv, hd = dims
    return kv_heads * s * (2 * 2 * hd * a + 2 * 2 * hd * a + hq // hkv * hd * 4)


def ring_comm(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None) -> int:
    """Bytes the busiest rank sends per layer: its K/V shard passed on N-1 times in forward
    and again in backward, and N-1 dK/dV partials of up to a whole shard."""
    hq, hkv, hd = dims
    return 3 * (world - 1) * s * 2 * hkv * hd * a


METHOD = Method(
    name="ring_attn", attention=ring_attn, layout="contiguous", short="R", speed_rank=6,
    summary="K/V blocks passed around a ring, overlapped with compute",
    use_when="reference; unbalanced under a causal mask (the last rank does N times the first's work)",
    aliases=("ring",), group_buffers=ring_buffers, comm_bytes=ring_comm)
