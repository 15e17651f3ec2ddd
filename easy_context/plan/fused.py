"""Memory of max-length mode's fused decoder layer (easy_context.memory.fused_layer), per device.

The fused layer keeps only its input between forward and backward (and, with attention
checkpointing, each head group's attention output and lse). Its backward holds, for the s
local tokens of the whole sequence:

    dy            the incoming gradient                                  H a
    results       every group's attention output (+ lse): the method's   R (below)
                  saved tensors less q, k, v
    dh            the gradient of the residual after attention            H a
  then either the MLP half:
    one tile      T tokens of the MLP and n2 with their gradients        T x (3 H a + H (4 + 2a) + 6 I a)
  or the attention half:
    dx            the gradient of the layer input                        H a
    one group     its q, k, v (and the method's copies of them), the
                  gradient of its output, dq, dk, dv                     Q (below)
    the method's communication buffers for one group's heads
plus the layer's parameter gradients, summed in float32 while the tiles and groups are
differentiated (4 B per layer parameter) and one tile's MLP parameter gradients (a B each).

R = the method's ``saved_per_token`` for the query heads alone, less q: the output in the
layout(s) the method keeps it in, and the float32 lse. Q = the group's q, k, v (pre-RoPE
leaves and RoPE'd copies), the method's saved q, k, v for the group (the all-to-all'd ones
for Ulysses; the RoPE'd ones themselves for the block methods), its output gradient and its
dq, dk, dv. The loss phase keeps the un-normed last hidden states instead of the final norm's
float32 copies, and writes their gradient over them (easy_context.memory.tiled_loss).
With the nested recompute on the device (``keep_every`` > 1, no offload) the forward and
the loss hold one input per group of layers; the inputs a group regenerates exist in backward
only, so they count in the layer's two halves, with the attention results (R) of the last
layer regenerated, kept for its backward (not with offload). So do the RoPE tables, which
each layer's backward computes again (for RoPE types that depend on the positions alone).
The first layer's input is counted as the embedding of the token ids, recomputed in backward
(easy_context.memory.recomputed: so for Llama, Mistral, Qwen; a model that scales its
embeddings outside the embedding module keeps it, one layer input more than planned).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel import AttentionDims, get_method
from .shapes import ModelShape


@dataclass(frozen=True)
class FusedTerms:
    stored: int  # bytes on the device kept from forward to backward (all layers)
    mlp_half: int  # the layer's backward, MLP half (with dy, results, dh)
    attention_half: int  # ... attention half, without the method's buffers
    buffers: int  # the method's communication buffers for one head group
    host: int  # layer inputs in host memory
    head: int  # per-sequence tensors kept besides the layers (none: RoPE tables recomputed)
    workspace: int = 0  # one attention kernel call's backward workspace (attention/workspace.py)


def _method(method: str, world: int):
    return get_method("local" if world == 1 else method)


def results_per_token(shape: ModelShape, a: int, method: str, world: int,
                      ring_degree: int | None) -> int:
    """R: the attention output(s) and lse one layer's groups record, per local token."""
    hq, d = shape.heads, shape.hd
    m = _method(method, world)
    # saved_per_token is q + k + v (as the method holds them) + output(s) + lse; with no KV
    # heads what remains beside q (hq D a) is the output part, whatever the layout.
    return m.saved_per_token(AttentionDims(hq, 0, d), a, world, ring_degree) - hq * d * a


def group_dims(shape: ModelShape, heads_per_chunk: int) -> AttentionDims:
    """The largest chunk: heads_per_chunk query heads and the KV heads they use."""
    hq = min(heads_per_chunk, shape.heads)
    return AttentionDims(hq, max(1, hq // (shape.heads // shape.kv_heads)), shape.hd)


def group_per_token(shape: ModelShape, a: int, method: str, world: int,
                    ring_degree: int | None, heads_per_chunk: int) -> int:
    """Q: one head group's working set in the attention backward, per local token."""
    dims = group_dims(shape, heads_per_chunk)
    hq, hkv, d = dims
    m = _method(method, world)
    held = m.saved_per_token(dims, a, world, ring_degree) - results_per_token(
        ModelShape("g", shape.hidden, 1, hq, hkv, 1, 1, head_dim=d), a, method, world, ring_degree)
    qkv = (hq + 2 * hkv) * d * a
    return qkv + held + hq * d * a + qkv  # leaves, the method's copies, d out, dq/dk/dv


def fused_terms(shape: ModelShape, s: int, a: int, method: str, world: int,
                checkpointing: str, mlp_tile: int, heads_per_chunk: int,
                ring_degree: int | None = None, keep_every: int = 1, workspace=None,
                budget: int | None = None) -> FusedTerms:
    """The fused layer's memory for s local tokens (see the module docstring)."""
    h, i, n = shape.hidden, shape.intermediate, shape.layers
    x = h * a
    results = results_per_token(shape, a, method, world, ring_degree)
    t = min(mlp_tile, s)
    tile = t * (3 * x + h * (4 + 2 * a) + 6 * i * a)
    # parameter gradients: float32 sums of the whole layer, one tile's MLP gradients
    grads = shape.layer_params() * 4 + (3 * h * i + h) * a
    keep_attention = checkpointing in ("attention", "none")
    per_layer = x + (results if keep_attention else 0)
    # the first layer's input is the embedding lookup, recomputed rather than kept, unless
    # the layer keeps its attention too (maxlen.py)
    kept, alive = kept_inputs(n, keep_every, first_free=not keep_attention)
    if checkpointing == "offload":
        # device: the input in use + the next one arriving; host: every input but the last
        # layer's, which stays on the device (needed first in backward, offload.py)
        stored, host, regen = 2 * per_layer * s, max(alive - 1, 0) * per_layer * s, 0
    else:
        # kept from forward on; the regenerated inputs (x alone) exist only in backward:
        # they count in the layer's halves, not in the loss phase
        stored, host, regen = kept * per_layer * s, 0, (alive - kept) * x * s
    if keep_every > 1 and n > 1 and checkpointing != "offload":
        # the layer regenerated last keeps its attention results for its backward, which
        # comes next: alive during the backward of the group's last layer (offload.py)
        regen += results * s
    dims = group_dims(shape, heads_per_chunk)
    m = _method(method, world)
    buffers = 0 if world == 1 else m.buffers(dims, s, a, world, ring_degree, budget, workspace)
    # one kernel call's backward workspace, for the chunk's heads in the method's groups
    call = m.call_workspace(dims, s, a, world, ring_degree, budget, workspace)
    base = s * (x + results + x)  # dy, every group's results (recomputed or kept), dh
    if keep_attention:
        base -= s * results  # counted in stored for the layer being differentiated
    q = group_per_token(shape, a, method, world, ring_degree, heads_per_chunk)
    # RoPE cos and sin: computed again by each layer's backward (memory/recomputed.py),
    # so they count in the layer's halves, not from forward to backward
    regen += s * 2 * shape.hd * a
    return FusedTerms(stored=stored, mlp_half=regen + base + tile + grads,
                      attention_half=regen + base + s * (x + q) + grads, buffers=buffers,
                      host=host, head=0, workspace=call)


def kept_inputs(layers: int, keep_every: int, first_free: bool) -> tuple[int, int]:
    """(layer inputs kept from forward to backward, the most alive at once in backward).

    The nested recompute (offload.py) keeps the first input of each group of ``keep_every``
    layers; group j regenerates its other inputs at its last layer's backward, while the kept
    inputs of groups 0..j are still there. ``first_free``: the first layer's input is
    recomputed from the token ids, so it is never kept (and alive only in its own backward)."""
    starts = range(0, layers, keep_every)
    free = 1 if first_free else 0
    alive = max(j + 1 - free + min(keep_every, layers - start) - 1
                for j, start in enumerate(starts))
    return len(starts) - free, max(alive, 1)
