"""A sliding-window call on a kernel that has no window of its own (torch's CPU and CUDA ops).

The band of a windowed call (query i sees keys lo <= j - i <= hi) is cut into tiles of query
rows. In a tile of n rows (n < the band's width W) three kinds of keys appear:
- the keys every row of the tile sees: one full call on the kernel;
- on the band's right edge, n keys where row i sees the first i + 1: a causal square;
- on its left edge, n keys where row i sees the last n - i: a causal square once both sides
  are taken in reverse order (a flip of the tile's rows, O(n) copies against O(n^2) work).
All three run on the kernel itself, so a sliding layer costs what its band covers at the
kernel's speed: a causal square of n costs n^2 / 2, so a tile's work is n (W - n) + n^2 =
n W whatever n is, and tiles are made as tall as the band allows (fewest calls); a tile clipped by the ends of the key range, or a band narrower than any
useful tile, runs its edges on the reference (kernels.masked_forward) instead. The pieces'
(out, lse) are merged as blocks are (merge.py); backward runs the same pieces with the final
out and lse, and sums their dK/dV in float32.

A kernel that takes an additive mask (Kernel.additive_mask: torch's CPU op) runs a bounded
band another way, cheaper there: tiles of MASK_TILE query rows, each one call against the
n + W - 1 keys its rows see, with an (n, n + W - 1) mask of 0 / -inf (:func:`masked_tiles`).
That op skips masked work only in blocks of 512 keys, so its causal squares under 512 rows
cost it the whole square: a tile of the pieces above costs about 2 n^2 + n (W - n), and
n ~ W; a masked tile costs n (n + W), and n = 256 (1.25 W per row at W = 1K, 1.06 at 4K).
Every row is in one tile (no merge), a tile's mask is the same for all interior tiles
(made once per call), and the measured cost (benchmarks/sliding.py) fell from 3.6x to under
2x the band's share of the scores at 16K tokens and W = 1K.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .contract import Kernel
from .kernels import masked_backward, masked_forward, offsets
from .merge import merge_into

Tensor = torch.Tensor
FULL, CAUSAL, FLIPPED, MASKED = "full", "causal", "flipped", "masked"
MAX_TILE = 8192
MASK_TILE = 256  # query rows per masked tile (see the module doc)
MASK_WIDTH = 16384  # wider bands take the pieces: a masked tile's mask grows with W
NARROW = 32  # bands narrower than this run on the reference: their tiles would be a few rows


class Piece(NamedTuple):
    rows: slice
    keys: slice
    kind: str


def tile_rows(width: int) -> int:
    """Query rows per tile for a band ``width`` keys wide: as many as keep the tile's two
    edges apart (width - 1), at most MAX_TILE (the flips copy a tile's rows)."""
    return max(1, min(width - 1, MAX_TILE))


def pieces(sq: int, sk: int, lo: int | None, hi: int | None) -> list[Piece]:
    """The calls of an (sq, sk) band with offsets (lo, hi), tile by tile (see module doc)."""
    width = sk + sq if lo is None or hi is None else hi - lo + 1
    n_rows = tile_rows(width)
    out = []
    for r0 in range(0, sq, n_rows):
        r1 = min(sq, r0 + n_rows)
        rows = slice(r0, r1)
        first = 0 if lo is None else max(0, r0 + lo)
        last = sk - 1 if hi is None else min(sk - 1, r1 - 1 + hi)
        if first > last:
            continue  # no row of the tile sees a key
        l1 = None if lo is None else r1 - 1 + lo  # the last row's first key
        h0 = None if hi is None else r0 + hi  # the first row's last key
        if width < NARROW or (l1 is not None and l1 > sk - 1) or (h0 is not None and h0 < 0):
            out.append(Piece(rows, slice(first, last + 1), MASKED))
            continue
        m0, m1 = 0, sk - 1
        if l1 is not None and l1 > 0:
            l0 = r0 + lo
            out.append(Piece(rows, slice(l0, l1 + 1), FLIPPED) if l0 >= 0
                       else Piece(rows, slice(0, l1 + 1), MASKED))
            m0 = l1 + 1
        if h0 is not None and h0 < sk - 1:
            h1 = r1 - 1 + hi
            out.append(Piece(rows, slice(h0, h1 + 1), CAUSAL) if h1 <= sk - 1
                       else Piece(rows, slice(h0, sk), MASKED))
            m1 = h0 - 1
        if m0 <= m1:
            out.append(Piece(rows, slice(m0, m1 + 1), FULL))
    return out


def _flip(t: Tensor, dim: int = 1) -> Tensor:
    return t.flip(dim)


def _by_tile(ps: list[Piece]) -> list[list[Piece]]:
    tiles: list[list[Piece]] = []
    for p in ps:
        if tiles and tiles[-1][0].rows == p.rows:
            tiles[-1].append(p)
        else:
            tiles.append([p])
    return tiles


def _forward_piece(kernel, p, q, k, v, lo, hi, scale, extra):
    qp, kp, vp = q[:, p.rows], k[:, p.keys], v[:, p.keys]
    if p.kind == MASKED:
        shift = p.rows.start - p.keys.start
        return masked_forward(qp, kp, vp, scale, None if lo is None else lo + shift,
                              None if hi is None else hi + shift, extra.get("softcap"))
    if p.kind == FLIPPED:
        o, l = kernel.forward(_flip(qp), _flip(kp), _flip(vp), causal=True, scale=scale, **extra)
        return _flip(o), _flip(l, 2)
    return kernel.forward(qp, kp, vp, causal=p.kind == CAUSAL, scale=scale, **extra)


def masked_tiles(sq: int, sk: int, lo: int, hi: int) -> list[tuple[slice, slice]]:
    """(query rows, keys) of each masked tile of a band with both offsets bounded: the rows
    that see a key, MASK_TILE at a time, each against the keys some row of it sees. Rows
    that see no key are in no tile (they keep out = 0, lse = -inf)."""
    first, last = max(0, -hi), min(sq - 1, sk - 1 - lo)
    out = []
    for r0 in range(first, last + 1, MASK_TILE):
        r1 = min(last + 1, r0 + MASK_TILE)
        out.append((slice(r0, r1), slice(max(0, r0 + lo), min(sk, r1 + hi))))
    return out


def _masked(kernel: Kernel, lo: int | None, hi: int | None, extra: dict) -> bool:
    return (kernel.additive_mask and not extra and lo is not None and hi is not None
            and NARROW <= hi - lo + 1 <= MASK_WIDTH)


class _Masks:
    """The additive mask of each tile shape (interior tiles share one), in q's dtype."""

    def __init__(self, q: Tensor, lo: int, hi: int):
        self.q, self.lo, self.hi, self.made = q, lo, hi, {}

    def __call__(self, rows: slice, keys: slice) -> Tensor:
        key = (rows.stop - rows.start, keys.stop - keys.start, keys.start - rows.start)
        if key not in self.made:
            n, m, shift = key
            d = (torch.arange(m, device=self.q.device)[None, :] + shift
                 - torch.arange(n, device=self.q.device)[:, None])  # j - i
            hidden = (d < self.lo) | (d > self.hi)
            self.made[key] = torch.zeros(n, m, dtype=self.q.dtype, device=self.q.device
                                         ).masked_fill_(hidden, float("-inf"))
        return self.made[key]


def band_forward(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int],
                 scale: float, **extra) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse float32) of a windowed call, on ``kernel`` without a window.
    Each tile's pieces merge in a float32 buffer of the tile's rows only."""
    lo, hi = offsets(q.size(1), k.size(1), False, window)
    b, sq, h, _ = q.shape
    out = torch.zeros(b, sq, h, v.size(-1), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if _masked(kernel, lo, hi, extra):
        mask = _Masks(q, lo, hi)
        for rows, keys in masked_tiles(sq, k.size(1), lo, hi):
            out[:, rows], lse[:, :, rows] = kernel.forward(
                q[:, rows], k[:, keys], v[:, keys], causal=False, scale=scale,
                attn_mask=mask(rows, keys))
        return out, lse
    for tile in _by_tile(pieces(sq, k.size(1), lo, hi)):
        rows = tile[0].rows
        if len(tile) == 1:
            o, lse[:, :, rows] = _forward_piece(kernel, tile[0], q, k, v, lo, hi, scale, extra)
            out[:, rows] = o
            continue
        acc = torch.zeros(b, rows.stop - rows.start, h, v.size(-1), dtype=torch.float32,
                          device=q.device)
        for p in tile:
            o, l = _forward_piece(kernel, p, q, k, v, lo, hi, scale, extra)
            merge_into(acc, lse[:, :, rows], o, l)
        out[:, rows] = acc
    return out, lse


def band_backward(kernel: Kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, window: tuple[int, int], scale: float, **extra):
    """dq, dk, dv of a windowed call, given its final out and lse. dq is summed a tile at a
    time; dK/dV, which several tiles share, in float32 buffers of the whole call."""
    lo, hi = offsets(q.size(1), k.size(1), False, window)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk, dv = (torch.zeros(t.shape, dtype=wide, device=t.device) for t in (k, v))
    if _masked(kernel, lo, hi, extra):
        mask = _Masks(q, lo, hi)
        for rows, keys in masked_tiles(q.size(1), k.size(1), lo, hi):
            g = kernel.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys],
                                out[:, rows], lse[:, :, rows], causal=False, scale=scale,
                                attn_mask=mask(rows, keys))
            dq[:, rows] = g[0]
            dk[:, keys] += g[1]
            dv[:, keys] += g[2]
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    for tile in _by_tile(pieces(q.size(1), k.size(1), lo, hi)):
        rows = tile[0].rows
        dq_tile = None
        for p in tile:
            args = (dout[:, rows], q[:, rows], k[:, p.keys], v[:, p.keys], out[:, rows],
                    lse[:, :, rows])
            if p.kind == MASKED:
                shift = rows.start - p.keys.start
                g = masked_backward(*args, scale, None if lo is None else lo + shift,
                                    None if hi is None else hi + shift, extra.get("softcap"))
            elif p.kind == FLIPPED:
                flipped = [_flip(t) for t in args[:5]] + [_flip(args[5], 2)]
                g = [_flip(t) for t in kernel.backward(*flipped, causal=True, scale=scale,
                                                       **extra)]
            else:
                g = kernel.backward(*args, causal=p.kind == CAUSAL, scale=scale, **extra)
            dq_tile = g[0].to(wide) if dq_tile is None else dq_tile.add_(g[0])
            dk[:, p.keys] += g[1]
            dv[:, p.keys] += g[2]
        dq[:, rows] = dq_tile
    return dq, dk.to(k.dtype), dv.to(v.dtype)
