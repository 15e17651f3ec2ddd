"""Memory of max-length mode's generic layer (easy_context.memory.generic_layer), per device.

The generic layer keeps what the fused one keeps between forward and backward (the layer's
input, through the same storage: plan/fused.py ``stored`` / ``host``), and its head chunks
send what the fused layer's head groups send (the same buffers). Its backward differs: it
runs the layer's own forward again with grad over the whole local sequence, so while that
layer is differentiated the autograd graph of the recompute holds, for the s local tokens
(G, per token, below), where the fused layer holds only the attention results (R):

    each normalisation     its output and normalised value (2 H a; in bf16 also its float32
                           input: H x (4 + 2a)), and its float32 rsqrt
    sandwich norms         (Gemma 2/3: 4 norms a layer) the input each extra norm saves (the
                           attention's and the MLP's outputs): H a each
    the residual           after attention, saved by the next norm: H a
    q/k norms              (Gemma 3, Qwen 3) their inputs and outputs: 2 (Hq + Hkv) D a
    MLA                    (DeepSeek-V2/V3) the query's low-rank projection, its norm and
                           the up-projection (3 r_q + Hq D) a, the compressed K/V with its
                           RoPE part, its norm and the expanded K/V
                           (r_kv + rope + 2 r_kv + Hq (D - rope + Dv)) a
    attention              what the method keeps for all heads (every chunk's calls are in
                           the graph at once): its saved_per_token (q, k, v, output, lse)
    the chunks' output     concatenated, o_proj's input: Hq Dv a

The MLP runs in checkpointed tiles, so only one tile's intermediates exist at a time, as in
the fused layer; an MoE tile holds, per token, the router's float32 scores (logits, scores,
the scores it chooses from: 12 E), the top-k gathered inputs and weighted outputs
(2 k H a) and its active experts' gated intermediates (6 (k I_e + I_shared) a, the
dense tile's 6 I a).

A layer with a recurrent mixer (gated DeltaNet, Mamba-2, a short convolution: hybrids) runs
the mixer whole inside the same recompute, so its G holds, in place of the attention's part,
the mixer's saved tensors as the untiled terms count them (plan/recurrent.py
``recurrent_saved_per_token``: projections, conv, the kernel's values and intermediates, the
gated norm), and sequence-parallel the (A, B) maps it gathered and the chained states
(2 x ``state_bytes``, per sequence); its MLP runs in tiles as above. When the backward reaches
the mixer it holds, beside dy, the input norm's and the mixer's saved tensors and the mixer's
gradients (``recurrent_transient_per_token``, the residual's in and out among them) and a
third copy of the states (their gradient): that is a recurrent layer's mixer half, which
takes no attention buffers. A layer of norms and mixers only (Nemotron-H's blocks) has no MLP
tile and no residual saved for a next norm.

That is the whole-sequence backward, which layers with a recurrent mixer (and any layer the
tiled backward's runtime check turns away) still run. A layer of attention and per-token parts
runs its backward in sequence tiles split at its attention call
(easy_context.memory.tiled_backward): while it replays the tiles after attention it holds
the attention output's gradient over the whole sequence beside R and one tile's G; at the
attention's backward, q, k, v gathered again (each head chunk's gradients written over its
own) and the output's (``tiled_per_token``). Those replace G below for such layers
(:func:`tiled`).

The two halves of plan/fused.py then hold G instead of R: the generic layer's MLP half is the
fused layer's plus s x (G - R), with the MLP tile of the widest MLP kind; its attention half
the fused one's plus s x (G_attn - R), G_attn being the part of G that precedes the attention
output (the input norm, q/k norms, MLA's projections, the method's saved tensors): the
backward has freed the rest by the time it reaches the attention. Where any layer of a
model takes the generic path the planner prices every layer so (the generic terms are the
larger); a model whose layers all verify on the fused path keeps the fused terms.
"""

from __future__ import annotations

from dataclasses import replace

from .fused import FusedTerms, fused_terms, group_dims, results_per_token
from .shapes import ModelShape


def norm_per_token(shape: ModelShape, a: int) -> int:
    """One RMSNorm's saved tensors per token (its input apart, which is saved elsewhere)."""
    h = shape.hidden
    return h * (4 + 2 * a) - (4 * h if a == 4 else 0) + 4


def attention_graph_per_token(shape: ModelShape, a: int, method: str, world: int,
                              ring_degree: int | None) -> int:
    """The part of G that is still there when the layer's backward reaches its attention
    (what follows the attention has been differentiated and freed): the input norm, q/k
    norms, MLA's projections and what the method keeps (module docstring)."""
    from ..parallel import get_method

    hq, hkv, d = shape.heads, shape.kv_heads, shape.hd
    vd = shape.v_head_dim or d
    g = norm_per_token(shape, a)
    if shape.qk_norm:
        g += 2 * (hq + hkv) * d * a
    if shape.kv_lora_rank:
        r, rope, rq = shape.kv_lora_rank, shape.rope_head_dim or 0, shape.q_lora_rank or 0
        g += (3 * rq + hq * d) * a + (r + rope + 2 * r + hq * (d - rope + vd)) * a
    m = get_method("local" if world == 1 else method)
    return g + m.saved_per_token(shape.attention_dims(), a, world, ring_degree)


def graph_per_token(shape: ModelShape, kind, a: int, method: str, world: int,
                    ring_degree: int | None, device: str = "gpu") -> int:
    """G: the bytes per local token that a generic layer's recompute graph holds (its input
    apart) when the layer's backward starts (see the module docstring; a recurrent mixer's
    gathered states, per sequence, apart: :func:`states_held`)."""
    from .recurrent import recurrent_saved_per_token

    h, hq = shape.hidden, shape.heads
    vd = shape.v_head_dim or shape.hd
    x = h * a
    mixes = kind.attention is not None or kind.recurrent
    norms = shape.layer_norms if mixes and kind.mlp else max(shape.layer_norms // 2, 1)
    g = norms * norm_per_token(shape, a) + max(norms - 2, 0) * x
    if not mixes:
        return g
    if kind.mlp:
        g += x  # the residual after the mixers (the next norm's input)
    if kind.recurrent:
        g += recurrent_saved_per_token(shape, a, world, device)
    if kind.attention is not None:
        g += attention_graph_per_token(shape, a, method, world, ring_degree) - norm_per_token(
            shape, a)
        g += hq * vd * a  # the chunks' output, concatenated
    return g


def states_held(shape: ModelShape, kind, s: int, method: str, world: int,
                ring_degree: int | None) -> int:
    """Bytes per sequence a recurrent layer's recompute graph holds besides G: every piece's
    gathered (A, B) maps and the chained states (plan/recurrent.py ``state_bytes``, each);
    0 on one device or for a layer without a recurrent mixer."""
    from .recurrent import state_bytes

    return 2 * state_bytes(shape, s, method, world, ring_degree) if kind.recurrent else 0


def recurrent_half(shape: ModelShape, kind, s: int, a: int, method: str, world: int,
                   ring_degree: int | None, keep_attention: bool, heads_per_chunk: int,
                   device: str = "gpu") -> int:
    """What a recurrent layer's backward holds at its mixer beyond the fused layer's attention
    half (which may be negative: the fused half's R, dh, dx and head group are replaced):
    the input norm's and the mixer's saved tensors, the mixer's gradients (the residual's in
    and out: dh and dx) and the states' three copies; with attention beside the mixer
    (Falcon-H1), the attention's graph too (module docstring)."""
    from .recurrent import recurrent_saved_per_token, recurrent_transient_per_token
    from .fused import group_per_token

    r = results_per_token(shape, a, method, world, ring_degree)
    rec = recurrent_saved_per_token(shape, a, world, device)
    tr = recurrent_transient_per_token(shape, a, world)
    states = 3 * states_held(shape, kind, s, method, world, ring_degree) // 2
    if kind.attention is not None:  # both mixers: the attention half, and the mixer's own
        return (s * (attention_graph_per_token(shape, a, method, world, ring_degree) - r
                     + rec + tr - 2 * shape.hidden * a) + states)
    q = group_per_token(shape, a, method, world, ring_degree, heads_per_chunk)
    fused_part = (0 if keep_attention else r) + 2 * shape.hidden * a + q  # R, dh, dx, a group
    return s * (norm_per_token(shape, a) + rec + tr - fused_part) + states


def tile_per_token(shape: ModelShape, kind, a: int) -> int:
    """One MLP tile's working set per tile token (plan/fused.py's, an MoE's: module docstring)."""
    h = shape.hidden
    x = h * a
    base = 3 * x + h * (4 + 2 * a)
    if kind.mlp == "moe" and shape.moe is not None:
        moe = shape.moe
        return base + 6 * moe.active_intermediate() * a + 2 * moe.top_k * x + 12 * moe.experts
    return base + 6 * shape.intermediate * a


def tiled(kind) -> bool:
    """Whether a layer of this kind runs its backward in tiles (memory/tiled_backward.py):
    attention and no recurrent mixer (whose layers keep the whole-sequence backward). The
    runtime check may still turn a layer away (a layer mixing tokens outside attention, one
    handed shared K/V: Gemma 4); the plan cannot see that and then prices it too low."""
    return kind.attention is not None and not kind.recurrent


def tiled_per_token(shape: ModelShape, a: int) -> tuple[int, int]:
    """(q, k, v; the attention output's gradient) per local token, as the tiled backward
    holds them over the whole sequence (K/V per KV head: MLA's expanded)."""
    hd, vd = shape.hd, shape.v_head_dim or shape.hd
    return ((shape.heads * hd + shape.kv_heads * (hd + vd)) * a, shape.heads * vd * a)


def generic_terms(shape: ModelShape, s: int, a: int, method: str, world: int,
                  checkpointing: str, mlp_tile: int, heads_per_chunk: int,
                  ring_degree: int | None = None, keep_every: int = 1, workspace=None,
                  budget: int | None = None, device: str = "gpu") -> FusedTerms:
    """The generic layer's memory for s local tokens: plan/fused.py's terms with the
    recompute graph G in place of the attention results (module docstring); each half the
    largest over the layer kinds. ``device``: whose recurrent kernels' saved tensors count
    (plan/recurrent.py ``recurrent_saved_per_token``)."""
    ft = fused_terms(shape, s, a, method, world, checkpointing, mlp_tile, heads_per_chunk,
                     ring_degree, keep_every, workspace=workspace, budget=budget)
    kinds = [k for k, _ in shape.layer_counts()]
    results = results_per_token(shape, a, method, world, ring_degree)
    keep_attention = checkpointing in ("attention", "none")

    def fused_results(k) -> int:
        # what G replaces in the fused MLP half: its attention results (for a layer without
        # attention, the R the fused half counts unless it is kept, and so not counted there)
        return results if k.attention is not None or not keep_attention else 0

    t = min(mlp_tile, s)

    def mlp_extra(k) -> int:
        g = graph_per_token(shape, k, a, method, world, ring_degree, device)
        if tiled(k):  # pass 1: d(output) whole, one tile's graph (q, k, v let go)
            _, dout = tiled_per_token(shape, a)
            return s * dout + t * g
        return s * max(g - fused_results(k), 0) + states_held(shape, k, s, method, world,
                                                              ring_degree)

    extra = max(mlp_extra(k) for k in kinds)
    dense = 3 * shape.hidden * a + shape.hidden * (4 + 2 * a) + 6 * shape.intermediate * a
    tile = t * max((tile_per_token(shape, k, a) for k in kinds if k.mlp), default=dense)
    if not any(k.mlp for k in kinds):
        tile = 0  # layers of mixers and norms only: nothing runs in tiles
    if all(tiled(k) for k in kinds if k.attention is not None):
        # pass 2: q, k, v whole, each head chunk's dq, dk, dv written over its q, k, v
        # (tiled_backward.chunked), and d(output) whole; no residual gradient (the fused
        # half's dh: the tiles' dx sums stand for its dx)
        qkv, dout = tiled_per_token(shape, a)
        # a chunk's q, k, v are views of the whole ones and its d(output) part of the whole
        # one: less what the fused half's group counts for them apart (group_per_token)
        hq, hkv, d = group_dims(shape, heads_per_chunk)
        views = ((hq + 2 * hkv) * d + hq * d) * a
        attention = ft.attention_half + s * (qkv + dout - shape.hidden * a - views)
    else:
        attention = ft.attention_half + s * max(
            attention_graph_per_token(shape, a, method, world, ring_degree) - results, 0)
    half = attention if any(k.attention is not None and not k.recurrent for k in kinds) else 0
    for k in kinds:
        if k.recurrent:
            # a mixer half with no attention buffers or kernel workspace: less them here, as
            # the estimate adds them to the attention half (MemoryEstimate.attention_layer)
            own = ft.attention_half + recurrent_half(shape, k, s, a, method, world,
                                                     ring_degree, keep_attention,
                                                     heads_per_chunk, device)
            half = max(half, own if k.attention is not None
                       else own - ft.buffers - ft.workspace)
    stored = ft.stored
    if keep_attention and keep_every == 1 and checkpointing != "offload":
        # only the attention layers record their results (attention.saving): the others keep
        # their input alone
        stored -= s * results * shape.count(lambda k: k.attention is None)
    return replace(ft, stored=stored, mlp_half=ft.mlp_half + extra + tile - t * dense,
                   attention_half=max(half, 0))


__all__ = ["attention_graph_per_token", "generic_terms", "graph_per_token", "norm_per_token",
           "recurrent_half", "states_held", "tile_per_token", "tiled", "tiled_per_token"]
