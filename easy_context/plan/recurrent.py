"""The recurrent layers' terms of the planner (hybrids: gated DeltaNet, Mamba-2, short
convolutions): what a mixer saves for backward and holds in its backward per token, the
(A, B) states it gathers sequence-parallel and the bytes it sends. The untiled estimate
(plan/estimate.py, which re-exports these names) and max-length mode's generic layer
(plan/generic.py) both count a recurrent layer with them."""

from __future__ import annotations

from ..parallel import get_method
from .shapes import ModelShape


def _extended_values(shape: ModelShape, world_size: int) -> int:
    """Value elements per token through a recurrent layer's kernel: sequence-parallel, the
    scan appends an identity block of d_k (Mamba-2: d_state) columns per head to read off
    each piece's transition (easy_context.recurrent.scan)."""
    r = shape.recurrent
    return r.value_width + (r.heads * r.key_width if world_size > 1 else 0)


# What the chunked gated delta rule saves per token and value head beyond its inputs and
# output, in float32 elements: chunk-wide rows (in-chunk attention and decay matrices) and
# rows per (d_k + d_v) (normalized, scaled and decayed copies of q, k, v).
# - CPU (transformers' torch kernel, float32 inside): CHUNK_MATRICES and HEAD_VECTORS, fitted
#   to saved-tensor bytes measured on tiny Qwen3-Next layers (d 16 / 32, 4 / 8 value heads,
#   1K / 2K tokens: within 1%);
# - GPU (flash-linear-attention's kernel, not measured here): it keeps its inputs and the
#   in-chunk matrix A (one chunk-wide row) and recomputes the rest in backward.
DELTA_CHUNK, CHUNK_MATRICES, HEAD_VECTORS = 64, 5.25, 6
GPU_CHUNK_MATRICES, GPU_HEAD_VECTORS = 1, 0


def recurrent_saved_per_token(shape: ModelShape, a: int, world_size: int,
                              device: str = "gpu") -> int:
    """Bytes per local token one recurrent mixer saves for backward: its input projection's
    output, the causal conv's input, output and activation (3 x channels), the kernel's values
    in and out (with the scan's identity block), the gated norm's fp32 input, its output and
    the gated product (out_proj's input); for the gated delta rule also its chunked kernel's
    intermediates (above)."""
    r = shape.recurrent
    d = r.dims()
    norm = r.inner * (4 + 2 * a) if r.gated_norm else r.inner * a
    ext = _extended_values(shape, world_size)
    kernel = 0
    if r.kind == "gated_delta_net":
        dv = ext // r.heads
        rows, vectors = ((CHUNK_MATRICES, HEAD_VECTORS) if device == "cpu"
                         else (GPU_CHUNK_MATRICES, GPU_HEAD_VECTORS))
        kernel = int(4 * r.heads * (rows * DELTA_CHUNK + vectors * (r.key_width + dv)))
    return a * (r.projection + 3 * d.conv_channels + 2 * ext) + norm + kernel


def recurrent_transient_per_token(shape: ModelShape, a: int, world_size: int) -> int:
    """Gradient bytes per local token alive in a recurrent mixer's backward: the residual
    stream's in and out, the projection's and the conv's gradients, the kernel's value and
    output gradients."""
    r = shape.recurrent
    d = r.dims()
    return a * (2 * shape.hidden + r.projection + d.conv_channels
                + 2 * _extended_values(shape, world_size))


def pieces_per_rank(method: str, world_size: int, s: int, ring_degree: int | None = None) -> int:
    """Pieces of the sequence a rank holds under ``method``'s layout (recurrent.pieces): 1
    contiguous, 2 zigzag, 1-2 USP."""
    if world_size == 1:
        return 1
    from ..recurrent.pieces import piece_table

    m = get_method(method)
    rd = ring_degree or (world_size if m.needs_ring_degree else None)
    return max(len(p) for p in piece_table(m.layout, world_size, s, rd))


def state_bytes(shape: ModelShape, s: int, method: str, world_size: int,
                ring_degree: int | None = None) -> int:
    """Bytes of every piece's (A, B) maps one recurrent layer all-gathers (float32, per
    sequence): N x pieces x |A + B| (Mixer dims' ``state``). None on one device."""
    if world_size == 1 or shape.recurrent is None:
        return 0
    return (world_size * pieces_per_rank(method, world_size, s, ring_degree)
            * shape.recurrent.dims().state * 4)


def state_communication_per_layer(shape: ModelShape, s: int, a: int, method: str,
                                  world_size: int, ring_degree: int | None = None) -> int:
    """Bytes one rank sends per recurrent layer and step, forward and backward: the state
    all-gather and reduce-scatter and the conv halo (recurrent.mixer.Mixer.comm_bytes)."""
    if world_size == 1 or shape.recurrent is None:
        return 0
    r = shape.recurrent
    return r.mixer().comm_bytes(r.dims(), pieces_per_rank(method, world_size, s, ring_degree),
                                a, world_size)


__all__ = ["CHUNK_MATRICES", "DELTA_CHUNK", "GPU_CHUNK_MATRICES", "GPU_HEAD_VECTORS",
           "HEAD_VECTORS", "pieces_per_rank", "recurrent_saved_per_token",
           "recurrent_transient_per_token", "state_bytes", "state_communication_per_layer"]
