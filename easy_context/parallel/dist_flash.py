"""DistFlashAttn (LightSeq, Li et al. 2023): contiguous shards, balanced under a causal mask.

Rank r holds tokens [r*L/N, (r+1)*L/N). Under a causal mask the pair (q_a, kv_b) is needed iff
a >= b, so with a plain ring (ring.py) rank N-1 computes N blocks while rank 0 computes one.
The naive schedule is "step t: every rank a >= t computes (a, a - t)", which leaves ranks
0..t-1 idle at step t; LightSeq puts them to work on the pairs that would otherwise need a
step of their own:

- step 0: every rank a computes its diagonal (a, a) causally;
- step t = 1 .. floor(N/2):
  * rank a >= t computes (a, a - t) itself, receiving kv_{a-t} from rank a - t;
  * if N - t != t, the idle rank b < t computes (b + N - t, b): it receives q of rank
    a = b + N - t (which is (b - t) mod N) and sends the block's (out, lse) back to a;
  * if 2t == N, the N/2 pairs (a, a - N/2) would leave half the ranks idle, so each is split
    by query rows: rank a computes its first half, the kv owner a - N/2 the second half.
Every difference a - b in 1..N-1 is covered once (t, or N - t), every rank does one block (or
two half blocks' worth: the diagonal and the 2t == N step) per step, and at step t each rank
receives one tensor set from (i - t) mod N and sends one to (i + t) mod N.

Packed documents: the ids of every shard are gathered once per call (one integer per token),
and every task runs as one kernel call per document its block holds (blocks.py): a helper
sends back its block's (out, lse) with lse = -inf on rows that saw no key there.

Without a mask all N^2 pairs are needed and every rank already has equal work: step t = 1..N-1
has rank a compute (a, (a - t) mod N), kv coming straight from its owner (a ring without relays).

Backward replays the schedule with the final out and lse. A block computed by the query owner
sends its dK/dV partial to the kv owner; a block computed by a helper needs q, out, lse and
dout rows from the query owner and sends dQ back. Partials are summed as a float32
accumulator would (accumulate.py), in the output buffer where that is exact.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..attention.documents import Call, ShardDocuments, schedule_causal
from ..attention.contract import Kernel, default_scale
from ..attention.selection import select_kernel
from ..attention.variants import Variant, with_softcap
from .. import layouts
from ..attention.merge import merge_into
from ..mesh import process_group
from .accumulate import GradSum, max_cover, span
from .blocks import (backward_block, block_calls, block_result, forward_block,
                     group_buffer_choice, shard_documents)
from .comm import Exchange, group_rank_size
from .function import GroupAlgorithm, check_inputs, run_attention
from .method import AttentionDims, Method
from .ring import ring_buffers

Tensor = torch.Tensor

ALL_ROWS, FIRST_HALF, SECOND_HALF = "all", "first", "second"


class Task(NamedTuple):
    """One kernel call: ``rank`` computes q_owner's ``rows`` against kv_owner's whole shard."""

    rank: int
    q_owner: int
    kv_owner: int
    rows: str  # ALL_ROWS, FIRST_HALF or SECOND_HALF of the query owner's shard


def balanced_schedule(world_size: int, causal: bool = True) -> list[list[Task]]:
    """The tasks of every step; step 0 holds the diagonal blocks (the only causal ones)."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    steps = [[Task(r, r, r, ALL_ROWS) for r in range(n)]]
    if not causal:
        steps += [[Task(a, a, (a - t) % n, ALL_ROWS) for a in range(n)] for t in range(1, n)]
        return steps
    for t in range(1, n // 2 + 1):
        if 2 * t == n:  # split (a, a - t) by rows between its two owners
            tasks = [task for a in range(t, n)
                     for task in (Task(a, a, a - t, FIRST_HALF), Task(a - t, a, a - t, SECOND_HALF))]
        else:
            tasks = [Task(a, a, a - t, ALL_ROWS) for a in range(t, n)]
            tasks += [Task(b, b + n - t, b, ALL_ROWS) for b in range(t)]  # idle ranks help
        steps.append(tasks)
    return steps


def _rows(part: str, length: int) -> slice:
    # An odd shard gives the second half one row more: exact, very slightly unbalanced.
    half = length // 2
    return {ALL_ROWS: slice(0, length), FIRST_HALF: slice(0, half), SECOND_HALF: slice(half, length)}[part]


def _calls(task: Task, docs: ShardDocuments | None, causal: bool, length: int) -> list[Call]:
    """The kernel calls of a task's block (its diagonal is the only causal block), on the
    kv owner's rows :func:`_kv_rows`."""
    return block_calls(docs, task.q_owner, _rows(task.rows, length), task.kv_owner,
                       _kv_rows(task, docs, causal, length),
                       causal and task.q_owner == task.kv_owner)


def _kv_rows(task: Task, docs: ShardDocuments | None, causal: bool, length: int) -> slice:
    """The kv owner's rows a task reads: under a window, chunks or documents the span of the
    keys its calls see (traffic.py's reasoning; only these travel, and only their dK/dV come
    back), else the whole shard. Every rank derives the same from the same plan."""
    if docs is None or task.q_owner == task.kv_owner:
        return slice(0, length)
    key = ("dist_flash_kv", task, causal, length)
    if key not in docs._memo:
        calls = block_calls(docs, task.q_owner, _rows(task.rows, length), task.kv_owner,
                            slice(None), False)
        spans = [span(c.kv, length) for c in calls]
        docs._memo[key] = (slice(min(a for a, _ in spans), max(b for _, b in spans))
                           if spans else slice(0, 0))
    return docs._memo[key]


def _steps(world: int, causal: bool, length: int,
           docs: ShardDocuments | None = None) -> list[list[Task]]:
    # A shard of one row has an empty first half, and under a sliding window, chunks or
    # packed documents a block may hold no visible key: drop such tasks, and steps left
    # empty, with their transfers (every rank holds the same plan, so alike on all).
    steps = [[t for t in step if _rows(t.rows, length).stop > _rows(t.rows, length).start
              and (docs is None or _calls(t, docs, causal, length))]
             for step in balanced_schedule(world, causal)]
    return [step for step in steps if step] or [[]]


def _route(group, rank: int, tasks: list[Task], payload: Callable[[Task, str], list[Tensor]],
           to_computer: bool) -> tuple[Exchange, dict]:
    """Post one step's transfers between each task's owners and its computing rank.

    side "q" moves between q_owner and the computing rank, side "kv" between kv_owner and it:
    owner -> computer for inputs (``to_computer``), computer -> owner for results. On the
    sender ``payload(task, side)`` is the data, on the receiver tensors shaped like it. Every
    rank walks the same task list in the same order, so sends and receives between two ranks
    pair up one to one. Returns the started exchange and {(task, side): received buffers}.
    """
    ex, received = Exchange(group), {}
    for task in tasks:
        for side, owner in (("q", task.q_owner), ("kv", task.kv_owner)):
            if owner == task.rank:
                continue
            src, dst = (owner, task.rank) if to_computer else (task.rank, owner)
            if src == rank:
                for t in payload(task, side):
                    ex.send(t, dst)
            elif dst == rank and (like := payload(task, side)):
                received[(task, side)] = [ex.recv(t, src) for t in like]
    return ex.start(), received


def dist_flash_forward(q: Tensor, k: Tensor, v: Tensor, group, causal: bool, scale: float,
                       kernel: Kernel, docs: ShardDocuments | None = None) -> tuple[Tensor, Tensor]:
    """Returns out (q's dtype) and lse (B, H, S) float32 for the local queries."""
    rank, world = group_rank_size(group)
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, v.size(-1), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    steps = _steps(world, causal, s, docs)

    def inputs(task, side):  # data on the owner, a template of the same shape elsewhere
        if side == "q":
            return [q[:, _rows(task.rows, s)]]
        kv = _kv_rows(task, docs, causal, s)
        return [k[:, kv], v[:, kv]]

    def merge_results(received):
        for (task, _), (block_out, block_lse) in received.items():
            rows = _rows(task.rows, s)
            merge_into(out[:, rows], lse[:, :, rows], block_out, block_lse)

    nxt = _route(group, rank, steps[0], inputs, to_computer=True)
    pending = None
    for i, tasks in enumerate(steps):
        exchange, got = nxt
        if i + 1 < len(steps):  # post the next step's inputs before computing this one
            nxt = _route(group, rank, steps[i + 1], inputs, to_computer=True)
        exchange.wait()
        done = {}  # helper results to send back: {(task, "q"): [out, lse]}
        for task in tasks:
            if task.rank != rank:
                continue
            rows = _rows(task.rows, s)
            q_blk = q[:, rows] if task.q_owner == rank else got[(task, "q")][0]
            kv = _kv_rows(task, docs, causal, s)
            k_blk, v_blk = (k[:, kv], v[:, kv]) if task.kv_owner == rank else got[(task, "kv")]
            calls = _calls(task, docs, causal, s)
            if task.q_owner == rank:
                forward_block(kernel, calls, q_blk, k_blk, v_blk, scale, out[:, rows],
                              lse[:, :, rows])
            else:
                blk_out, blk_lse = block_result(kernel, calls, q_blk, k_blk, v_blk, scale,
                                                docs is not None and docs.repeated)
                done[(task, "q")] = [blk_out.to(q.dtype), blk_lse.float()]

        def results(task, side):
            if side == "kv":
                return []  # forward results only go back to the query owner
            if task.rank == rank:
                return done[(task, side)]
            rows = _rows(task.rows, s)
            # what arrives: the block's out (v's head dim) in q's dtype, and its lse
            return [q.new_empty(b, rows.stop - rows.start, h, v.size(-1)), lse[:, :, rows]]

        returned = _route(group, rank, tasks, results, to_computer=False)
        if pending is not None:  # the previous step's results arrived while we computed
            pending[0].wait()
            merge_results(pending[1])
        pending = returned
    pending[0].wait()
    merge_results(pending[1])
    return out.to(q.dtype), lse


def dist_flash_terms(steps: list[list[Task]], rank: int, length: int,
                     kv_rows: Callable[[Task], slice] | None = None) -> tuple[int, int]:
    """The most block partials any element of ``rank``'s dQ, and of its dK/dV, receives;
    ``kv_rows(task)``: the kv owner's rows a task reads (default: all)."""
    tasks = [t for step in steps for t in step]
    dq = [span(_rows(t.rows, length), length) for t in tasks if t.q_owner == rank]
    dkv = [(0, length) if kv_rows is None else span(kv_rows(t), length)
           for t in tasks if t.kv_owner == rank]
    return max_cover(dq), max_cover(dkv)


def dist_flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        group, causal: bool, scale: float, kernel: Kernel,
                        docs: ShardDocuments | None = None,
                        grads: tuple[Tensor, Tensor, Tensor] | None = None,
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes, written into ``grads`` (views to fill) when given.

    Partials are summed by accumulate.GradSum (in the output buffer when no element gets more
    than two, else in float32). A step's inputs are fetched after the previous step's kernel
    calls, together with that step's results, not before them (a trade-off, measured): a
    kernel call is where memory peaks, and every input here is a view of its owner's k/v or
    q/out/dout rows for one KV-head group, so posting it early holds a send copy as well as
    the receive buffer through the call (unlike ring.py's relayed shards, which are sent as
    they arrived). Posting step 1's inputs before the diagonal call raised the per-rank peak
    over the memory target to hide under 1% of the backward (benchmarks/attention.py,
    benchmarks/results/attention.json).
    """
    rank, world = group_rank_size(group)
    s = q.size(1)
    if grads is None:
        grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    steps = _steps(world, causal, s, docs)
    kv_rows = lambda task: _kv_rows(task, docs, causal, s)  # noqa: E731
    dq_terms, dkv_terms = dist_flash_terms(steps, rank, s, kv_rows)
    dq, dk, dv = GradSum(grads[0], dq_terms), GradSum(grads[1], dkv_terms), GradSum(grads[2], dkv_terms)

    def inputs(task, side):
        if side == "kv":
            return [k[:, kv_rows(task)], v[:, kv_rows(task)]]
        rows = _rows(task.rows, s)
        return [q[:, rows], out[:, rows], dout[:, rows], lse[:, :, rows]]

    def add_results(received):
        for (task, side), parts in received.items():
            if side == "q":
                dq.add(parts[0], _rows(task.rows, s))
            else:
                dk.add(parts[0], kv_rows(task))
                dv.add(parts[1], kv_rows(task))

    exchange, got = _route(group, rank, steps[0], inputs, to_computer=True)
    for i, tasks in enumerate(steps):
        exchange.wait()
        done = {}  # partial gradients owed to other ranks: {(task, side): tensors}
        for task in tasks:
            if task.rank == rank:
                done.update(_task_backward(task, rank, got, inputs, kernel, causal, scale,
                                           q.dtype, s, docs, dq, dk, dv))
        got = {}  # the received inputs are no longer needed

        def results(task, side):
            if task.rank == rank:
                return done[(task, side)]
            return [q[:, _rows(task.rows, s)]] if side == "q" else inputs(task, "kv")[:2]

        returned = _route(group, rank, tasks, results, to_computer=False)
        if i + 1 < len(steps):  # the next step's inputs travel with this step's results
            exchange, got = _route(group, rank, steps[i + 1], inputs, to_computer=True)
        returned[0].wait()
        done.clear()
        add_results(returned[1])
        returned = None
    for acc in (dq, dk, dv):
        acc.finish()
    return grads


def _task_backward(task: Task, rank: int, got: dict, inputs, kernel: Kernel, causal: bool,
                   scale: float, dtype, s: int, docs: ShardDocuments | None, dq: GradSum,
                   dk: GradSum, dv: GradSum) -> dict:
    """One task's block; adds the partials this rank owns, returns those owed to others
    (zeros for a block no query sees: the transfers are fixed by the schedule)."""
    rows = _rows(task.rows, s)
    q_blk, o_blk, do_blk, lse_blk = (inputs(task, "q") if task.q_owner == rank
                                     else got[(task, "q")])
    kv = _kv_rows(task, docs, causal, s)
    k_blk, v_blk = inputs(task, "kv") if task.kv_owner == rank else got[(task, "kv")]
    dq_b, dk_b, dv_b = backward_block(kernel, _calls(task, docs, causal, s), do_blk, q_blk,
                                      k_blk, v_blk, o_blk, lse_blk, scale,
                                      sum_float32=docs is not None and docs.repeated)
    owed = {}
    if task.q_owner == rank:
        dq.add(dq_b, rows)
    else:
        owed[(task, "q")] = [dq_b.to(dtype)]
    del dq_b
    if task.kv_owner == rank:
        dk.add(dk_b, kv)
        dv.add(dv_b, kv)
    else:
        owed[(task, "kv")] = [dk_b.to(dtype), dv_b.to(dtype)]
    return owed


def dist_flash_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
                    softmax_scale: float | None = None, document_ids: Tensor | None = None,
                    ring_degree: int | None = None, variant: Variant | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """DistFlashAttn over contiguous shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    Every rank of ``group`` (None: the world) must hold a shard of the same length.
    ``document_ids`` (B, S/N), optional: packed documents; no token attends across them.
    """
    check_inputs(q, k, v, document_ids, sinks)
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    pg = process_group(group)
    world = dist.get_world_size(pg)
    s = q.size(1)
    dims = AttentionDims(q.size(2), k.size(2), q.size(3))
    kernel = with_softcap(select_kernel(q), variant and variant.softcap)
    per_group = group_buffer_choice(
        lambda g: dist_flash_buffers(dims, s, q.element_size(), world, None, g), q, k,
        kernel, (s, k.size(1)))
    geometry = None if variant is None else variant.geometry(
        tuple(layouts.segments("contiguous", r, world, s) for r in range(world)), causal,
        world * s)
    # image spans: every pair is asked, and the plan keeps the ones a span crosses
    algo = GroupAlgorithm(dist_flash_forward, dist_flash_backward, pg,
                          schedule_causal(bool(causal), geometry), scale,
                          kernel, shard_documents(document_ids, pg, geometry, s), per_group)
    return run_attention(algo, q, k, v, sinks)


def dist_flash_buffers(dims: AttentionDims, s: int, a: int, world: int,
                       ring_degree: int | None, kv_heads: int = 1) -> int:
    """As the ring's (ring_buffers), plus the relayed q, out and dout rows of each KV head's
    query heads (3 x g D x a per token and KV head of the group)."""
    hq, hkv, hd = dims
    return (ring_buffers(dims, s, a, world, ring_degree, kv_heads)
            + kv_heads * s * 3 * (hq // hkv) * hd * a)


def dist_flash_comm(dims: AttentionDims, s: int, a: int, world: int,
                    ring_degree: int | None) -> int:
    """Bytes the busiest rank sends per layer: at each of the ~N/2 off-diagonal steps either
    its K/V shard, or (as a helper's query owner) q rows, then the block's (out, lse) back;
    in backward K/V or q, out, dout and lse, and the partial gradients back."""
    hq, hkv, hd = dims
    steps = world // 2
    kv, q = s * 2 * hkv * hd * a, s * hq * hd * a
    lse = s * hq * 4
    return steps * (max(kv, 2 * q + lse) + max(2 * kv, 4 * q + lse))


METHOD = Method(
    name="dist_flash_attn", attention=dist_flash_attn, layout="contiguous", short="DF",
    speed_rank=5, aliases=("dist_flash",),
    summary="LightSeq's schedule: idle ranks compute blocks for busy ones and send back (out, lse)",
    use_when="balanced without reordering tokens; more, smaller messages than zigzag",
    group_buffers=dist_flash_buffers, comm_bytes=dist_flash_comm)
