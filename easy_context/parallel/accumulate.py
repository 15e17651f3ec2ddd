"""Summing partial gradients into their output buffer, as exactly as a float32 accumulator.

A block method's gradients are sums of per-block partials (the kernel returns each one in the
inputs' dtype). Summing them in a float32 buffer and rounding once at the end costs a float32
tensor per gradient (twice the bf16 output) for the whole backward. It is not needed when an
element receives at most two partials: the first lands in the zeroed output exactly
(0 + a = a), and the second is one float32 addition rounded once, which is exactly what the
float32 accumulator followed by the final cast computes (torch adds bf16/fp16 tensors on the
CPU by converting to float32, adding and rounding once). With more partials a float32 buffer
is made, lazily at the second addition (from the output, which still holds the first partial
exactly), so the results are bitwise those of a float32 accumulator in every case.

The number of partials per element is known from a method's schedule before it runs: see
:func:`max_cover`.
"""

from __future__ import annotations

from typing import Iterable

import torch

Tensor = torch.Tensor
ALL = slice(None)


def max_cover(intervals: Iterable[tuple[int, int]]) -> int:
    """The largest number of half-open intervals [a, b) that share a point (empty ones ignored)."""
    spans = [(a, b) for a, b in intervals if b > a]
    return max((sum(1 for a, b in spans if a <= p < b) for p, _ in spans), default=0)


def span(rows: slice, length: int) -> tuple[int, int]:
    """[start, stop) of ``rows`` over ``length`` rows (a stepped slice counts as covering all)."""
    r = range(length)[rows]
    return (r.start, r.stop) if r.step == 1 else (0, length)


class GradSum:
    """``dst`` (a view of a gradient, any layout) receives the sum of partials added along dim 1.

    ``max_terms``: the most partials any element receives. ``finish()`` must be called after
    the last ``add``. Up to two partials per element: added in place. Three: the second and
    third are kept (references, no copies) and summed with the first in float32 at
    ``finish``, a chunk of rows at a time. More: a float32 buffer from the second on.
    """

    CHUNK_ROWS = 1024  # rows per float32 temporary in finish()

    def __init__(self, dst: Tensor, max_terms: int):
        dst.zero_()
        self.dst = dst
        wide = dst.dtype in (torch.float32, torch.float64)
        self.mode = "inplace" if wide or max_terms <= 2 else ("defer" if max_terms == 3 else "widen")
        self.acc: Tensor | None = None
        self.pending: list[tuple[Tensor, slice]] = []
        self.adds = 0

    def add(self, part: Tensor, rows: slice = ALL) -> None:
        first, self.adds = self.adds == 0, self.adds + 1
        if self.mode == "defer" and not first:
            self.pending.append((part, rows))
            return
        if self.mode == "widen" and not first and self.acc is None:
            self.acc = self.dst.float()  # the first partials, exactly: a float32 sum from here
        (self.dst if self.acc is None else self.acc)[:, rows].add_(part)

    def finish(self) -> None:
        if self.acc is not None:
            self.dst.copy_(self.acc)
            self.acc = None
        if not self.pending:
            return
        length = self.dst.size(1)
        spans = [span(rows, length) for _, rows in self.pending]
        for c0 in range(0, length, self.CHUNK_ROWS):
            c1 = min(c0 + self.CHUNK_ROWS, length)
            acc = self.dst[:, c0:c1].float()
            for (part, _), (r0, r1) in zip(self.pending, spans):
                lo, hi = max(r0, c0), min(r1, c1)
                if lo < hi:
                    acc[:, lo - c0:hi - c0].add_(part[:, lo - r0:hi - r0])
            self.dst[:, c0:c1].copy_(acc)
        self.pending = []
