"""What a sliding-window layer sends, per method, for the planner (easy_context/plan).

:func:`window_traffic` walks the same plans the methods run (traffic.py for the ring
engine, dist_flash's tasks) on plain shards of the sequence, so its figures are what the
transfers move: tests/dist/test_attention_variants.py counts the elements handed to the
point-to-point sends and finds them equal.
"""

from __future__ import annotations

from ..attention.documents import ShardDocuments, schedule_causal
from .accumulate import span
from .method import AttentionDims
from .traffic import ring_plan, rows_in


def window_traffic(method: str, dims: AttentionDims, seq_len: int, world: int,
                   window: int | None, a: int = 2, ring_degree: int | None = None,
                   lse_bytes: int = 4, float32_bytes: int = 4,
                   spans: tuple[tuple[int, int], ...] = ()) -> dict:
    """What one layer of ``method`` sends, on the busiest rank, under a sliding ``window``
    (None: a global layer) over ``world`` ranks for a ``seq_len``-token sequence with
    attention shape ``dims`` and ``a`` bytes per element (v's head dim taken as q's).

    Returns {"steps": ring steps run (dist_flash: schedule steps), "of": those of a global
    layer, "forward_bytes", "backward_bytes", "global_forward_bytes",
    "global_backward_bytes"}. Ring-shaped methods (ring, zigzag, usp's ring part) move only
    the K/V rows the window reads and dist_flash only the keys each task reads (their queries
    and results still travel whole); allgather sends each rank the rows its calls read (its
    halo, halo.py: K/V in forward and again in backward, and their dK/dV partials in
    ``float32_bytes`` a value back) where that moves less than the all-gather; ulysses and
    usp's Ulysses part send for a window layer what they send for a global one
    (method.comm_bytes, forward + backward, reported as backward_bytes with forward_bytes
    None). For usp with ring_degree > 1 the
    figures are its ring's only: its Ulysses all-to-all (ulysses.py) moves the same for a
    window layer as for a global one, on top. ``spans``: image spans (first, one past the
    last sequence index; Gemma 3/4) whose tokens also see the later ones of their span: a
    window layer then also reads a span's later keys, on another rank where the span
    straddles a shard boundary (the methods' plans under spans: attention/documents.py)."""
    from . import get_method

    m = get_method(method)
    if m.name in ("ring_attn", "zigzag_ring_attn") or (
            m.name == "usp_attn" and ring_degree is not None and ring_degree > 1):
        return _ring_traffic(m, dims, seq_len, world, window, a, ring_degree, spans)
    if m.name == "dist_flash_attn":
        return _dist_flash_traffic(dims, seq_len, world, window, a, lse_bytes, spans)
    if m.name == "allgather_attn":
        return _allgather_traffic(dims, seq_len, world, window, a, float32_bytes, spans)
    total = m.comm_bytes(dims, seq_len // world, a, world, ring_degree)
    return {"steps": None, "of": None, "forward_bytes": None, "backward_bytes": total,
            "global_forward_bytes": None, "global_backward_bytes": total}


def _plain(layout: str, world: int, s: int, window: int | None,
           spans: tuple[tuple[int, int], ...] = ()) -> ShardDocuments | None:
    from .. import layouts
    from ..attention.variants import Variant

    geo = None if window is None else Variant(window, spans=(tuple(spans),) if spans else ()
                                              ).geometry(
        tuple(layouts.segments(layout, r, world, s) for r in range(world)), True, world * s)
    return None if geo is None else ShardDocuments.plain((s,) * world, geo)


def _causal(docs: ShardDocuments | None) -> bool:
    """The methods' schedule: causal, unless image spans ask for every block (the plan
    leaves those no span crosses empty)."""
    return schedule_causal(True, None if docs is None else docs.geometry)


def _ring_traffic(m, dims, seq_len, world, window, a, ring_degree, spans=()) -> dict:
    from .ring import contiguous_schedule, ring_steps
    from .zigzag import zigzag_schedule

    hq, hkv, hd = dims
    ring, kv_heads = world, hkv
    if m.name == "usp_attn":  # the ring runs over ring ranks on 1/U of the heads
        ring, kv_heads = ring_degree, max(1, hkv // (world // ring_degree))
    schedule = contiguous_schedule if m.name == "ring_attn" else zigzag_schedule
    s = seq_len // ring
    row = 2 * kv_heads * hd * a
    docs = _plain("contiguous" if m.name == "ring_attn" else "zigzag", ring, s, window, spans)
    steps = ring_steps(schedule, docs, ring, s, _causal(docs))
    plan = ring_plan(schedule, docs, ring, s, _causal(docs), steps)
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


def _dist_flash_traffic(dims, seq_len, world, window, a, lse_bytes, spans=()) -> dict:
    from .dist_flash import _kv_rows, _rows, _steps

    hq, hkv, hd = dims
    s = seq_len // world
    q_row, kv_row, lse_row = hq * hd * a, 2 * hkv * hd * a, hq * lse_bytes

    def sends(docs):
        fwd, bwd = [0] * world, [0] * world
        causal = _causal(docs)
        for step in _steps(world, causal, s, docs):
            for t in step:
                q_rows = _rows(t.rows, s)
                nq = q_rows.stop - q_rows.start
                kv = _kv_rows(t, docs, causal, s)
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
        return max(fwd), max(bwd), len(_steps(world, causal, s, docs))

    f, b, steps = sends(_plain("contiguous", world, s, window, spans))
    gf, gb, global_steps = sends(None)
    return {"steps": steps, "of": global_steps, "forward_bytes": f, "backward_bytes": b,
            "global_forward_bytes": gf, "global_backward_bytes": gb}


def _allgather_traffic(dims, seq_len, world, window, a, float32_bytes, spans=()) -> dict:
    """All-gather attention: its whole shard to N - 1 ranks (forward, and backward again,
    with the float32 dK/dV reduce-scattered), or under a halo worth it only the rows read."""
    from .. import layouts
    from ..attention.variants import Variant
    from .allgather import plain_halo

    hq, hkv, hd = dims
    s = seq_len // world
    row = 2 * hkv * hd
    whole = (world - 1) * s
    gf, gb = whole * row * a, whole * row * (a + float32_bytes)
    geo = None if window is None or world == 1 else Variant(
        window, spans=(tuple(spans),) if spans else ()).geometry(
        (layouts.segments("zigzag", 0, world, s), ((0, seq_len, 0),)), True, seq_len)
    halo = None if geo is None else plain_halo(world, s, schedule_causal(True, geo), geo)
    if halo is None or not halo.useful():
        f, b = gf, gb
    else:
        sent = [halo.sent_rows(r) for r in range(world)]
        f = max(kv for kv, _ in sent) * row * a
        b = max(kv * a + p * float32_bytes for kv, p in sent) * row
    return {"steps": None, "of": None, "forward_bytes": f, "backward_bytes": b,
            "global_forward_bytes": gf, "global_backward_bytes": gb}
