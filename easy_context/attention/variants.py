"""Any kernel made to run every attention the supported models compute, exactly.

A kernel does what its flags say (contract.Kernel); :func:`adapt` does the rest around it:
- a v head dim other than q's (multi-head latent attention, e.g. 192 and 128) on a kernel
  that needs them equal: the narrower side is padded with zeros, which adds nothing to any
  score or output, and the padding's gradients are dropped;
- a sliding window on a kernel without one: the band is tiled (bands.py);
- logit soft-capping on a kernel without it: the reference, a tile of query rows at a time
  (torch's ops have no soft-capping; flash-attn has, on GPUs).
Attention sinks are not a kernel matter: they join the softmax once, after every block is
merged (sinks.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .bands import band_backward, band_forward
from .contract import Kernel, default_scale
from .documents import Geometry, Segment
from .kernels import REFERENCE

Tensor = torch.Tensor


def _padded(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    width = max(q.size(-1), v.size(-1))
    return tuple(t if t.size(-1) == width else F.pad(t, (0, width - t.size(-1)))
                 for t in (q, k, v))


@functools.lru_cache(maxsize=256)
def adapt(kernel: Kernel) -> Kernel:
    """``kernel`` taking ``window=`` and ``softcap=`` and any v head dim (see module doc)."""
    if kernel.windows and kernel.softcap and kernel.value_dim:
        return kernel

    def route(q, v, window, softcap):
        """(the kernel that runs the call, pad the head dims?, its keyword arguments, tile
        the band?): the same decision for forward and backward."""
        use = REFERENCE if softcap is not None and not kernel.softcap else kernel
        pad = v.size(-1) != q.size(-1) and not use.value_dim
        extra = {} if softcap is None else {"softcap": softcap}
        banded = window is not None and not use.windows
        if window is not None and not banded:
            extra["window"] = window
        return use, pad, extra, banded

    def forward(q, k, v, causal=False, scale=None, window=None, softcap=None):
        scale = default_scale(q.size(-1)) if scale is None else scale
        use, pad, extra, banded = route(q, v, window, softcap)
        dv = v.size(-1)
        if pad:
            q, k, v = _padded(q, k, v)
        if banded:
            out, lse = band_forward(use, q, k, v, window, scale, **extra)
        else:
            out, lse = use.forward(q, k, v, causal=causal, scale=scale, **extra)
        return (out[..., :dv] if pad else out), lse

    def backward(dout, q, k, v, out, lse, causal=False, scale=None, window=None, softcap=None):
        scale = default_scale(q.size(-1)) if scale is None else scale
        use, pad, extra, banded = route(q, v, window, softcap)
        d, dv = q.size(-1), v.size(-1)
        if pad:
            q, k, v = _padded(q, k, v)
            dout, out = (F.pad(t, (0, q.size(-1) - dv)) for t in (dout, out))
        if banded:
            dq, dk, dvv = band_backward(use, dout, q, k, v, out, lse, window, scale, **extra)
        else:
            dq, dk, dvv = use.backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                       **extra)
        if pad:
            dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]
        return dq, dk, dvv

    return Kernel(kernel.name, forward, backward, windows=True, softcap=True, value_dim=True)


def with_softcap(kernel: Kernel, softcap: float | None) -> Kernel:
    """``kernel`` adapted, with every call soft-capped at ``softcap`` (None: as it is); one
    object per (kernel, softcap), so that every layer's call finds the same."""
    if softcap is None:
        return kernel
    return _softcapped(kernel, float(softcap))


@functools.lru_cache(maxsize=64)
def _softcapped(kernel: Kernel, softcap: float) -> Kernel:
    full = adapt(kernel)
    return Kernel(kernel.name, functools.partial(full.forward, softcap=softcap),
                  functools.partial(full.backward, softcap=softcap),
                  windows=True, softcap=True, value_dim=True)


@dataclass(frozen=True)
class Variant:
    """What one layer's attention computes beyond causal softmax(q k^T * scale) v.

    ``window``: sliding window (transformers' ``sliding_window``): query i sees key j iff
    i - j < window. ``chunk``: chunked attention (Llama 4): iff i // chunk == j // chunk.
    ``softcap``: scores s -> softcap * tanh(s / softcap) (Gemma 2). ``spans``: per batch
    row, image spans (first, one past the last sequence index) whose tokens also see the
    later tokens of their span (Gemma 3; documents.py). Attention sinks are a learned
    tensor, passed beside it (sinks.py)."""

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self):
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{'sliding_window' if name == 'window' else 'chunk_size'} "
                                 f"must be a positive integer, got {value!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 (None: no soft-capping), got {self.softcap!r}")
        if self.spans and self.chunk is not None:
            raise ValueError("image spans (bidirectional attention inside each image) are not "
                             "supported with chunked attention")
        for row in self.spans:
            for a, b in row:
                if not 0 <= a < b:
                    raise ValueError(f"an image span is (first, one past the last) sequence "
                                     f"index, 0 <= first < stop; got {(a, b)}")

    def geometry(self, segments: tuple[tuple[Segment, ...], ...], causal: bool,
                 length: int) -> Geometry | None:
        """The plan's geometry for shards at ``segments`` of a ``length``-token sequence, or
        None where nothing is cut by position (a window or chunk at least the sequence)."""
        window = self.window if self.window is not None and self.window < length else None
        chunk = self.chunk if self.chunk is not None and self.chunk < length else None
        # spans only widen a causal mask (a bidirectional layer already sees them)
        spans = self.spans if causal and any(self.spans) else ()
        if any(b > length for row in spans for _, b in row):
            raise ValueError(f"an image span ends past the sequence ({length} tokens)")
        if window is None and chunk is None and not spans:
            return None
        if not causal:
            raise ValueError("sliding-window and chunked attention are supported for causal "
                             "attention; this layer is bidirectional (is_causal=False)")
        return Geometry(segments, True, window, chunk, spans)


def variant_of(sliding_window: int | None = None, chunk_size: int | None = None,
               softcap: float | None = None, image_spans=None) -> Variant | None:
    """The Variant of these arguments, None when they ask for plain attention.
    ``image_spans``: per batch row, (first, one past the last) sequence indices of each image
    whose tokens attend to each other both ways (Gemma 3)."""
    spans = tuple(tuple((int(a), int(b)) for a, b in row) for row in image_spans or ())
    if sliding_window is None and chunk_size is None and softcap is None and not any(spans):
        return None
    return Variant(sliding_window, chunk_size, None if softcap is None else float(softcap),
                   spans if any(spans) else ())
