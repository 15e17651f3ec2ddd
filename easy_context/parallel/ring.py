"""Ring attention: K/V blocks travel around the ring while each rank keeps its queries.

At step s, rank r holds the K/V shard of rank (r - s) mod N. It computes attention of its
queries against that shard (only the parts the mask allows, as told by a *schedule*), folds
the (out, lse) into its running result, and meanwhile passes the shard on to rank r + 1.

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

from ..attention.kernels import Kernel, default_scale, select_kernel
from ..attention.documents import document_mask
from ..attention.merge import merge_into
from ..attention.saving import run_saved
from .accumulate import GradSum, max_cover, span
from .comm import Exchange, group_rank_size, ring_pass
from .head_groups import backward_into_heads, forward_by_heads

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


def _rows(doc: Tensor | None, rows: slice) -> Tensor | None:
    return None if doc is None else doc[:, rows]


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group, causal: bool, scale: float,
                 schedule: Schedule, kernel: Kernel, doc: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Returns out (q's dtype) and lse (B, H, S) float32 for the local queries.

    ``doc`` (B, S_local): document ids for packed sequences; they travel with K/V.
    """
    rank, world = group_rank_size(group)
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    held = [k, v] if doc is None else [k, v, doc]  # what travels: K, V (and their doc ids)
    for step in range(world):
        if step + 1 < world:  # post the next transfer before computing on this block
            exchange, arriving = ring_pass(held, group)
        k_cur, v_cur, kv_doc = held[0], held[1], held[2] if doc is not None else None
        for blk in schedule((rank - step) % world, rank, s, causal):
            skip, blk_causal, mask = document_mask(_rows(doc, blk.q), _rows(kv_doc, blk.kv), blk.causal)
            if skip:
                continue
            block_out, block_lse = kernel.forward(q[:, blk.q], k_cur[:, blk.kv], v_cur[:, blk.kv],
                                                  causal=blk_causal, scale=scale, attn_mask=mask)
            merge_into(out[:, blk.q], lse[:, :, blk.q], block_out, block_lse)
        if step + 1 < world:
            exchange.wait()
            held = arriving
    return out.to(q.dtype), lse


def ring_terms(schedule: Schedule, rank: int, world: int, local_len: int,
               causal: bool) -> tuple[int, int]:
    """The most block partials any element of ``rank``'s dQ, and of its dK/dV, receives."""
    dq = [span(blk.q, local_len) for src in range(world)
          for blk in schedule(src, rank, local_len, causal)]
    dkv = [span(blk.kv, local_len) for computer in range(world)
           for blk in schedule(rank, computer, local_len, causal)]
    return max_cover(dq), max_cover(dkv)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  group, causal: bool, scale: float, schedule: Schedule,
                  kernel: Kernel, doc: Tensor | None = None,
                  grads: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes, written into ``grads`` (views to fill) when given.

    K/V travel as in forward. Each block's dK/dV partial goes straight back to the shard's
    owner, which sums its partials (accumulate.GradSum: in the output buffer when an element
    gets at most two, else in float32).

    When transfers are posted (memory against overlap; per-rank figures at L=16K, N=2, bf16,
    8 KV heads, in units U of one KV head's K for the local rows, 1 MB there): a kernel call
    is where a step's memory peaks (its dq/dk/dv blocks and its own float32 working buffers,
    ~5.6U above the outputs on the diagonal), so every buffer in flight during one adds to
    the peak.
    - Steps 1 .. N-2 (N >= 3): the shard held came in from the previous rank, contiguous, so
      it is passed on as it is before the kernel runs, and the next shard lands in a reused
      double buffer (the receive buffers of the shard passed on a step earlier): +2U during
      the call, the price of hiding the transfer, and a rank need not wait for its
      predecessor's kernel to end before starting the next step (zigzag at N = 4, L = 16K:
      per-rank peak 24.5 -> 25.4 MB, 0.36 -> 0.37 of single-process attention).
    - Step 0: our own shard is a view of one KV head of k, v, not contiguous: posting it
      before the diagonal call would hold a 2U send copy and a 2U receive buffer through it
      (measured with zigzag at N = 2: peak 39.1 -> 42.3 MB per rank, 0.57 -> 0.62 of
      single-process attention, over the 0.6 target) to hide a transfer of ~2-3 ms per head
      group, under 1% of the backward. So step 0's shard is posted after the call, with the
      first partials; at N = 2 that is the only shard that travels.
    - The dK/dV partials exist only after the kernel: posted after it.
    """
    rank, world = group_rank_size(group)
    s = q.size(1)
    if grads is None:
        grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dq_terms, dkv_terms = ring_terms(schedule, rank, world, s, causal)
    dq, dk, dv = GradSum(grads[0], dq_terms), GradSum(grads[1], dkv_terms), GradSum(grads[2], dkv_terms)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    held = [k, v] if doc is None else [k, v, doc]  # what travels: K, V (and their doc ids)
    spare = None  # receive buffers whose shard has been passed on: the next one lands there
    for step in range(world):
        src = (rank - step) % world
        more = step + 1 < world
        early = more and step > 0
        if early:  # pass the received shard on and fetch the next while the kernel runs
            kv_ex = Exchange(group)
            arriving = _pass_on(kv_ex, held, spare, nxt, prv)
            kv_ex.start()
        owed = _ring_step_backward(dout, q, k, v, out, lse, held, doc, src, rank, causal, scale,
                                   schedule, kernel, dq, dk, dv)
        if world == 1:
            break
        ex = Exchange(group)
        if more and not early:  # step 0: our own shard, after the kernel (see above)
            arriving = _pass_on(ex, held, None, nxt, prv)
        if not more:
            held = None  # the last shard: done with
        if step > 0:  # partials owed to src; ours from the rank that now holds our shard
            for t in owed:
                ex.send(t, src)
            computer = (rank + step) % world
            mine = [ex.recv(t[:, blk.kv], computer)
                    for blk in schedule(rank, computer, s, causal) for t in (k, v)]
        ex.start().wait()
        if early:
            kv_ex.wait()
        del owed
        if more:
            spare, held, arriving = (held if step > 0 else None), arriving, None
        if step > 0:
            blocks = schedule(rank, computer, s, causal)
            for blk, dk_b, dv_b in zip(blocks, mine[0::2], mine[1::2]):
                dk.add(dk_b, blk.kv)
                dv.add(dv_b, blk.kv)
            del mine
    for acc in (dq, dk, dv):
        acc.finish()
    return grads


def _pass_on(ex: Exchange, held: list[Tensor], spare: list[Tensor] | None, nxt: int,
             prv: int) -> list[Tensor]:
    """Add to ``ex`` sending ``held`` to the next rank and receiving the previous rank's shard
    (into ``spare`` when given); returns the receive buffers."""
    for t in held:
        ex.send(t, nxt)
    if spare is None:
        return [ex.recv(t, prv) for t in held]
    return [ex.recv_into(buf, prv) for buf in spare]


def _ring_step_backward(dout, q, k, v, out, lse, held, doc, src, rank, causal, scale, schedule,
                        kernel, dq: GradSum, dk: GradSum, dv: GradSum) -> list[Tensor]:
    """One step's blocks against src's shard (``held``); adds what stays home, returns the
    dK/dV partials owed to src (one pair per block, zeros for a block masked out)."""
    s = q.size(1)
    k_cur, v_cur, kv_doc = held[0], held[1], held[2] if doc is not None else None
    owed = []
    for blk in schedule(src, rank, s, causal):
        skip, blk_causal, mask = document_mask(_rows(doc, blk.q), _rows(kv_doc, blk.kv), blk.causal)
        if skip:
            if src != rank:
                owed += [torch.zeros_like(t[:, blk.kv], memory_format=torch.contiguous_format)
                         for t in (k_cur, v_cur)]
            continue
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, blk.q], q[:, blk.q], k_cur[:, blk.kv], v_cur[:, blk.kv], out[:, blk.q],
            lse[:, :, blk.q], causal=blk_causal, scale=scale, attn_mask=mask)
        dq.add(dq_b, blk.q)
        del dq_b
        if src == rank:
            dk.add(dk_b, blk.kv)
            dv.add(dv_b, blk.kv)
        else:
            owed += [dk_b, dv_b]
        del dk_b, dv_b
    return owed


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, schedule, kernel, doc):
        out, lse = run_saved(lambda: forward_by_heads(
            lambda qg, kg, vg: ring_forward(qg, kg, vg, group, causal, scale, schedule, kernel, doc),
            q, k, v))
        ctx.save_for_backward(q, k, v, out, lse, doc)
        ctx.args = (group, causal, scale, schedule, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc = ctx.saved_tensors
        dq, dk, dv = backward_into_heads(
            lambda *t: ring_backward(*t[:6], *ctx.args, doc=doc, grads=t[6:]), dout.contiguous(),
            q, k, v, out, lse)
        return dq, dk, dv, None, None, None, None, None, None


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shapes every method needs: (B, S_local, H, D), GQA heads that divide."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seq_local, heads, head_dim); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.size(3) != k.size(3):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         "agree in batch, sequence and head_dim, and k and v in heads")
    if q.size(2) % k.size(2) != 0:
        raise ValueError(f"query heads ({q.size(2)}) must be a multiple of key/value heads "
                         f"({k.size(2)}) for grouped-query attention")


def check_document_ids(q: Tensor, document_ids: Tensor | None) -> None:
    if document_ids is not None and tuple(document_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"document_ids must be (batch, seq_local) = {tuple(q.shape[:2])}, "
                         f"got {tuple(document_ids.shape)}")


def run_ring(q, k, v, group, causal, softmax_scale, schedule: Schedule,
             document_ids: Tensor | None = None) -> Tensor:
    check_qkv(q, k, v)
    check_document_ids(q, document_ids)
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    return RingAttention.apply(q, k, v, group, causal, scale, schedule, select_kernel(q),
                               document_ids)


def ring_attn(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
              causal: bool = True, softmax_scale: float | None = None,
              document_ids: Tensor | None = None) -> Tensor:
    """Ring attention over contiguous shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``document_ids`` (B, S/N), optional: packed documents; no token attends across them.
    """
    return run_ring(q, k, v, group, causal, softmax_scale, contiguous_schedule, document_ids)
