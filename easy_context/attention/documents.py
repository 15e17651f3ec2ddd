"""Packed documents: which keys each query may see when one sequence holds several documents.

Each token carries a document id. A query attends to the keys of its own document (and,
under the causal mask, not to later ones): token i sees token j iff id[i] == id[j] (and
j <= i). Ids come from position ids that restart at 0 at each document start
(:func:`document_ids_from_positions`: 0, 1, 2, ... along the sequence).

No mask is ever built. The ids of every shard are turned, on the host and once per
micro-batch (:func:`once_per_ids`: every layer and every recompute is handed the same ids
tensor), into *runs* (maximal stretches of rows with one id), and every block a method computes
is cut into one kernel call per pair of runs with the same id: a run of query rows against a
run of key rows is either entirely visible (full attention), or, on a causal diagonal block
where both are the same tokens, a causal square. Rows of a block whose document has no key
there are in no call: they keep lse = -inf for that block, which the merge ignores.
Methods keep every token of a shard in sequence order (layouts.py), so with ids that are
non-decreasing along the sequence, each id is one run per shard and a block needs at most one
call per document in it. Ids that return to an earlier value (the same id in two separate
stretches) are exact too: every pair of same-id runs gets its call (then a row can receive
partials from several calls of one block; they are summed in float32).

Sliding windows and chunked attention (:class:`Geometry`) are planned the same way, from
where each shard's rows sit in the sequence (its layout's segments): a pair of runs is cut
at every jump of the sequence index and at every chunk boundary, and each piece is trimmed
to the queries and keys that see something. A piece no query sees is no call (a block of
such pieces costs nothing: ring.py skips its step); one wholly inside the window is a full
call or a causal square; one the window cuts is one call with flash-attn's window
(``Call.window``), which kernels without a window tile (bands.py).

Image spans (Gemma 3: ``Geometry.spans``) widen a causal mask: inside a span [s, e) of the
sequence every token also sees the *later* tokens of the span, so query i's keys reach up to
hi(i) = e - 1 (transformers' Gemma 3 mask is ((causal OR same span) AND window), and always
same document: a span's later keys are never out of the window, its earlier ones are cut by
it as any causal key). The causal plan stays as it is; each span adds, per block it
crosses, the calls of its queries [s, e - 1) against its keys (i, e): a strictly upper
triangle, i.e. flash-attn's window (0, -1) on the square, or a full call where a block holds
only its later keys. A block of later keys that no span crosses still plans to no call, so
methods that ask for every block under spans (:func:`schedule_causal`) skip those as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

Tensor = torch.Tensor
ALL = slice(None)
Run = tuple[int, int, int]  # (document id, first row, one past the last row)
Segment = tuple[int, int, int]  # (first row, one past the last row, sequence index of the first)
Span = tuple[int, int]  # (first sequence index, one past the last) of an image's tokens


@dataclass(frozen=True)
class Geometry:
    """Which keys a layer lets a query see by position, and where the rows of each shard sit.

    ``segments[shard]``: the shard's rows as stretches of consecutive sequence positions
    (layouts.segments). ``window``: the sliding window (transformers' ``sliding_window``):
    query i sees key j iff i - j < window. ``chunk``: chunked attention (Llama 4's
    ``attention_chunk_size``): iff i // chunk == j // chunk. Both on top of ``causal``."""

    segments: tuple[tuple[Segment, ...], ...]
    causal: bool
    window: int | None = None
    chunk: int | None = None
    spans: tuple[tuple[Span, ...], ...] = ()
    """Per batch row, the image spans (first, one past the last) in sequence indices whose
    tokens see each other both ways (see the module doc); () for none."""


def schedule_causal(causal: bool, geometry: Geometry | None) -> bool:
    """Whether a method may skip the blocks of later keys (its causal schedule): not under
    image spans, whose queries see later keys of their span; then it asks for every block and
    the plan (which knows each row's sequence index) leaves the blocks no span crosses empty."""
    return causal and not (geometry is not None and any(geometry.spans))


def document_ids_from_positions(position_ids: Tensor) -> Tensor:
    """(B, S) position ids of the *whole* sequence -> (B, S) document ids (0, 1, 2, ...).

    A document starts where the position does not increase (a restart). Position ids with
    skips (PoSE) still increase, so they stay one document.
    """
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]).long()
    return starts.cumsum(dim=1) - 1


def is_packed(position_ids: Tensor) -> bool:
    """Whether any row of (B, S) *whole-sequence* position ids restarts (holds several
    documents). One host sync; decide it where every rank holds the whole batch."""
    return bool((position_ids[:, 1:] <= position_ids[:, :-1]).any())


def runs_of(ids: list[int]) -> tuple[Run, ...]:
    """The maximal stretches of equal ids in one row: ((id, start, stop), ...)."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.append((ids[start], start, i))
            start = i
    return tuple(runs)


@dataclass(frozen=True)
class Call:
    """One kernel call inside a block, in block-relative rows: batch rows, query rows, key
    rows, and whether it is a causal square."""

    batch: slice
    q: slice
    kv: slice
    causal: bool
    window: tuple[int, int] | None = None
    """flash-attn's (left, right), bottom-right aligned, on the call's rows (causal False)."""


def once_per_ids(ids: Tensor, key: tuple, build: Callable[[], object]):
    """``build()`` for these ``ids`` and ``key`` (the method's view: shards of a group, the
    gathered sequence, one rank; its runs, or the gathered ids), computed once and kept on
    the ids tensor itself.

    A model hands the same ``document_ids`` tensor to every layer's attention and to every
    recompute of a micro-batch, so the all-gather of the ids, their host copy and the scan for
    runs happen once per micro-batch instead of once per attention call (benchmarks/
    documents_per_call.py). The next micro-batch is a new tensor; an in-place change of this
    one (its version counter) builds again. Every rank of a group caches alike (the same calls
    on the same ids), so a collective in ``build`` runs on all of them or on none."""
    # inference tensors (the evals run under inference_mode) keep no version counter
    current = "inference" if ids.is_inference() else ids._version
    version, cache = getattr(ids, "_ec_document_runs", (None, None))
    if version != current:
        cache = {}
        ids._ec_document_runs = (current, cache)
    if key not in cache:
        cache[key] = build()
    return cache[key]


def group_key(group) -> object:
    """A process group's identity for :func:`once_per_ids` (None: the default group)."""
    return None if group is None else (getattr(group, "group_name", None) or id(group))


def whole_block(causal: bool) -> list[Call]:
    return [Call(ALL, ALL, ALL, causal)]


@dataclass
class ShardDocuments:
    """The document runs of every shard a method pairs blocks from, for every batch row.

    ``runs[shard][b]``: the runs of batch row b of that shard, in the shard's row order
    (shard = a rank of the group; all-gather attention and Ulysses use one shard: the whole
    sequence). Built once per attention call (one host copy of the ids); block calls are
    memoised, since every KV-head group and the backward ask for the same blocks.
    """

    runs: tuple[tuple[tuple[Run, ...], ...], ...]
    lengths: tuple[int, ...]
    repeated: bool = False
    """A query row may be in several calls of one block: some id forms two separate runs
    within one shard's row (ids not non-decreasing), or a geometry cuts rows into pieces."""
    geometry: Geometry | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_ids(cls, ids: Tensor | list[Tensor],
                 geometry: Geometry | None = None) -> "ShardDocuments":
        """``ids``: a (shards, B, S) integer tensor, or a list of (B, S_i) ones (shards of
        different lengths); any device, copied to the host once."""
        shards = list(ids.unbind(0)) if isinstance(ids, Tensor) else list(ids)
        if any(t.is_floating_point() for t in shards):
            raise ValueError(f"document ids must be integers, got {shards[0].dtype}")
        runs = tuple(tuple(runs_of(row) for row in t.detach().to("cpu").tolist())
                     for t in shards)
        repeated = any(len({r[0] for r in row}) < len(row) for shard in runs for row in shard)
        return cls(runs, tuple(t.size(1) for t in shards), repeated or geometry is not None,
                   geometry)

    @classmethod
    def plain(cls, lengths: tuple[int, ...], geometry: Geometry) -> "ShardDocuments":
        """One document per sequence: only ``geometry`` decides what is seen."""
        return cls(tuple(((( 0, 0, n),),) for n in lengths), tuple(lengths), True, geometry)

    def calls(self, q_shard: int, q_rows: slice, kv_shard: int, kv_rows: slice,
              causal: bool) -> list[Call]:
        """The kernel calls of the block (q_shard's ``q_rows``) x (kv_shard's ``kv_rows``);
        ``causal``: the block is a causal diagonal (both sides the same tokens). Empty: no
        query of the block sees any of its keys."""
        key = (q_shard, _bounds(q_rows, self.lengths[q_shard]), kv_shard,
               _bounds(kv_rows, self.lengths[kv_shard]), causal)
        if key not in self._memo:
            self._memo[key] = self._plan(*key)
        return self._memo[key]

    def _plan(self, q_shard, q_span, kv_shard, kv_span, causal) -> list[Call]:
        (q0, q1), (k0, k1) = q_span, kv_span
        if self.geometry is not None:
            return self._plan_geometry(q_shard, q_span, kv_shard, kv_span)
        per_row = [_pairs(_clip(qr, q0, q1), _clip(kr, k0, k1), causal)
                   for qr, kr in zip(self.runs[q_shard], self.runs[kv_shard])]
        if all(p == per_row[0] for p in per_row):  # every batch row alike: one batched call
            rows = [(ALL, per_row[0])]
        else:
            rows = [(slice(b, b + 1), p) for b, p in enumerate(per_row)]
        whole = ((0, q1 - q0), (0, k1 - k0), causal)
        return [Call(batch, ALL, ALL, c) if (qs, ks, c) == whole else
                Call(batch, slice(*qs), slice(*ks), c)
                for batch, pairs in rows for qs, ks, c in pairs]

    def _plan_geometry(self, q_shard, q_span, kv_shard, kv_span) -> list[Call]:
        g = self.geometry
        qs = [_units(_clip(r, *q_span), g.segments[q_shard], q_span[0], g.chunk)
              for r in self.runs[q_shard]]
        ks = [_units(_clip(r, *kv_span), g.segments[kv_shard], kv_span[0], g.chunk)
              for r in self.runs[kv_shard]]
        rows_n = max(len(qs), len(ks), len(g.spans))
        if len(ks) == 1 and rows_n > 1:  # plain keys meet every batch row alike
            ks = ks * rows_n
        if len(qs) == 1 and rows_n > 1:
            qs = qs * rows_n
        spans = g.spans if len(g.spans) == rows_n else ((),) * rows_n
        if g.spans and len(g.spans) != rows_n:
            raise ValueError(f"image spans are given for {len(g.spans)} batch rows; the batch "
                             f"has {rows_n}")
        per_row = [_row_bands(q_units, k_units, g) + _span_bands(q_units, k_units, row_spans)
                   for q_units, k_units, row_spans in zip(qs, ks, spans)]
        if all(p == per_row[0] for p in per_row):
            rows = [(ALL, per_row[0])]
        else:
            rows = [(slice(b, b + 1), p) for b, p in enumerate(per_row)]
        whole = ((0, q_span[1] - q_span[0]), (0, kv_span[1] - kv_span[0]))
        return [Call(batch, ALL if (qr, kr) == whole else slice(*qr),
                     ALL if (qr, kr) == whole else slice(*kr), c, w)
                for batch, bands in rows for qr, kr, c, w in bands]


Unit = tuple[tuple, int, int, int]  # ((document id, chunk), first row, stop, sequence index)


def _row_bands(q_units: list[Unit], k_units: list[Unit], g: Geometry) -> tuple:
    """The calls of one batch row: each query unit against the key units of its (document,
    chunk), looked up rather than scanned (thousands of short documents stay linear)."""
    by_key: dict[tuple, list[Unit]] = {}
    for ku in k_units:
        by_key.setdefault(ku[0], []).append(ku)
    return tuple(band for qu in q_units for ku in by_key.get(qu[0], ())
                 if (band := _band(qu, ku, g.causal, g.window)) is not None)


def _span_bands(q_units: list[Unit], k_units: list[Unit], spans: tuple[Span, ...]) -> tuple:
    """The calls that image ``spans`` add to one batch row: each span's queries [s, e - 1)
    against its later keys, i < j < e, within one document (no window: a later key is never
    out of it)."""
    out = []
    for s, e in spans:
        if e - s < 2:
            continue  # a one-token span has no later key
        for qu in q_units:
            q = _within(qu, s, e - 1)
            if q is None:
                continue
            for ku in k_units:
                k = _within(ku, s + 1, e)
                if k is not None and k[0][0] == q[0][0]:
                    band = _offsets_band(q, k, None, -1)
                    if band is not None:
                        out.append(band)
    return tuple(out)


def _within(unit: Unit, first: int, stop: int) -> Unit | None:
    """The part of ``unit`` at sequence indices [first, stop), or None."""
    key, a, b, index = unit
    lo, hi = max(index, first), min(index + b - a, stop)
    if lo >= hi:
        return None
    return key, a + lo - index, a + hi - index, lo


def _units(runs: list[Run], segments: tuple[Segment, ...], offset: int,
           chunk: int | None) -> list[Unit]:
    """Block-relative runs cut where the sequence index jumps (segments, in shard rows) and
    at chunk boundaries; each piece with the sequence index of its first row."""
    out = []
    for d, a, b in runs:
        for s0, s1, start in segments:
            lo, hi = max(a + offset, s0), min(b + offset, s1)
            while lo < hi:
                index = start + lo - s0
                piece = hi - lo if chunk is None else min(hi - lo, chunk - index % chunk)
                out.append(((d, None if chunk is None else index // chunk), lo - offset,
                            lo - offset + piece, index))
                lo += piece
    return out


def _band(qu: Unit, ku: Unit, causal: bool, window: int | None):
    """((q rows), (kv rows), causal, window) of the call between two units, None if no query
    sees a key. Visible: 0 <= i - j (causal) and i - j <= window - 1, on sequence indices."""
    return _offsets_band(qu, ku, 0 if causal else None, None if window is None else window - 1)


def _offsets_band(qu: Unit, ku: Unit, dmin: int | None, dmax: int | None):
    """As :func:`_band`, for visibility dmin <= i - j <= dmax (None: unbounded)."""
    _, qa, qb, qi = qu
    _, ka, kb, ki = ku
    q_first, q_last, k_first, k_last = qi, qi + qb - qa - 1, ki, ki + kb - ka - 1
    if dmax is not None:
        k_first = max(k_first, q_first - dmax)
    if dmin is not None:
        k_last = min(k_last, q_last - dmin)
    if k_first > k_last:
        return None
    if dmin is not None:
        q_first = max(q_first, k_first + dmin)
    if dmax is not None:
        q_last = min(q_last, k_last + dmax)
    if q_first > q_last:
        return None
    rows = (qa + q_first - qi, qa + q_last - qi + 1)
    keys = (ka + k_first - ki, ka + k_last - ki + 1)
    nq, nk = q_last - q_first + 1, k_last - k_first + 1
    if ((dmin is None or q_first - k_last >= dmin)
            and (dmax is None or q_last - k_first <= dmax)):
        return rows, keys, False, None  # every query sees every key
    if q_first == k_first and nq == nk and dmin == 0 and (dmax is None or nq - 1 <= dmax):
        return rows, keys, True, None  # the same tokens on both sides
    # flash-attn's window on the call: j - i in [nk - nq - left, nk - nq + right]
    off, diag = nk - nq, q_first - k_first
    right = -1 if dmin is None else diag - dmin - off
    left = -1 if dmax is None else off - diag + dmax
    return rows, keys, False, (left, right)


def _bounds(rows: slice, length: int) -> tuple[int, int]:
    r = range(length)[rows]
    if r.step != 1:
        raise ValueError("block rows must be a contiguous slice")
    return r.start, r.stop


def _clip(runs: tuple[Run, ...], lo: int, hi: int) -> list[Run]:
    """The runs' parts inside rows [lo, hi), shifted to block-relative rows."""
    return [(d, max(a, lo) - lo, min(b, hi) - lo) for d, a, b in runs if a < hi and b > lo]


def _pairs(q_runs: list[Run], kv_runs: list[Run], causal: bool):
    """((q start, stop), (kv start, stop), causal) per pair of same-id runs that see each
    other. On a causal diagonal block both sides are the same tokens, so two same-id runs
    are the same stretch (a causal square), or one lies wholly before the other."""
    by_id: dict[int, list[tuple[int, int]]] = {}
    for d, a, b in kv_runs:
        by_id.setdefault(d, []).append((a, b))
    out = []
    for d, qa, qb in q_runs:
        for ka, kb in by_id.get(d, ()):
            if not causal:
                out.append(((qa, qb), (ka, kb), False))
            elif (ka, kb) == (qa, qb):
                out.append(((qa, qb), (ka, kb), True))
            elif kb <= qa:
                out.append(((qa, qb), (ka, kb), False))
            elif ka < qb:
                raise AssertionError("runs of a causal diagonal block overlap partially")
    return tuple(out)
