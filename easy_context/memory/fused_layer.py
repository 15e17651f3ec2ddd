"""A decoder layer that never holds a whole-sequence intermediate: its MLP in sequence tiles,
its attention one group of heads at a time, its own recompute.

For a pre-norm layer (transformers' Llama, Mistral, Qwen2/3, Gemma, Granite...)

    h = x + r * o_proj(attention(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = h + r * mlp(n2(h))

(r: Granite's residual_multiplier, else 1; no rope on NoPE layers; which layers have exactly
this shape is verified by easy_context.memory.layer_check)

the untiled layer, recomputed under per-layer checkpointing, holds for every token of the
sequence the normed input, q, k, v (before and after RoPE), the attention output, h, the
normed h and the MLP's four I-wide intermediates at once, plus their gradients in backward.
Here one autograd function computes the layer and keeps only its input x (and, with
``keep_attention``, each head group's attention output and log-sum-exp; the first layer
keeps a way to look its input up again instead, when that is the embedding, and every layer
one to compute the decoder's RoPE tables again: easy_context.memory.recomputed); its backward
recomputes what it needs in pieces:

- attention, ``heads_per_chunk`` query heads at a time (whole KV heads with all their query
  heads, or a part of one KV head's query heads, its K and V recomputed for each part):
  n1, the group's rows of q/k/v_proj (and per-head q/k norms) tile by tile, RoPE, then the
  model's attention function, any sequence-parallel method included (for Ulysses, the
  all-to-all of the group's heads). The attention result each group records in forward
  (easy_context.attention.saving) is handed back in backward, so the kernel's forward is not
  run again there;
- o_proj, the residual and the MLP with n2 in tiles of ``tile`` tokens; in backward each tile
  is recomputed and differentiated on its own (as DeepSpeed's TiledMLP does).
What lives for the whole sequence is x, each group's attention output (and, for Ulysses, its
head-sharded copy and the lse), the incoming gradient, the gradient of h and that of x;
every I-wide or norm intermediate is tile x width, every q/k/v a group's heads only.

Parameter gradients are summed over tiles and groups in float32 (in the parameter's dtype
when that is float32 or wider) and returned by the function, so each parameter receives one
gradient per step: FSDP's and ZeRO-3's reduction hooks fire once, as for an untiled layer.
Exact: the same operations on the same numbers, summed in another order (tested against the
untiled model, loss and every gradient, on 1, 2 and 4 ranks).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.saving import recording, replaying

Tensor = torch.Tensor


def layer_window(attn: nn.Module) -> int | None:
    """The sliding window the layer's own forward hands its attention function: its
    ``sliding_window`` attribute (Gemma, Qwen2, GPT-OSS, Cohere 2: None on global layers),
    or, for families that read it from the config at each call (Mistral), the config's,
    on the layers ``layer_types`` calls sliding (all, without layer_types)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    config = getattr(attn, "config", None)
    types = getattr(config, "layer_types", None)
    index = getattr(attn, "layer_idx", None)
    if types and index is not None and types[index] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def mlp_output(out):
    """An MLP's output; MoE blocks that also return their router logits (GPT-OSS) give
    (hidden, logits), of which the layer keeps the hidden states."""
    return out[0] if isinstance(out, tuple) else out


def branch(t: Tensor, factor: float) -> Tensor:
    """A residual branch (or its gradient) times the layer's factor; as is when it is 1."""
    return t if factor == 1.0 else t * factor


def tiles(length: int, tile: int) -> list[slice]:
    return [slice(i, min(i + tile, length)) for i in range(0, length, max(1, tile))]


def head_chunks(heads: int, kv_heads: int, per_chunk: int) -> list[tuple[slice, slice]]:
    """(query-head slice, KV-head slice) per chunk of ``per_chunk`` query heads: whole KV heads
    (per_chunk a multiple of the ratio heads / kv_heads; the last chunk may be smaller) or a
    part of one KV head's query heads (per_chunk dividing the ratio)."""
    r = heads // kv_heads
    if per_chunk >= r:
        if per_chunk % r:
            raise ValueError(f"a head chunk of {per_chunk} query heads splits a group of {r} "
                             f"query heads sharing a KV head; use a multiple or a divisor of {r}")
        g = per_chunk // r
        return [(slice(i * r, min(i + g, kv_heads) * r), slice(i, min(i + g, kv_heads)))
                for i in range(0, kv_heads, g)]
    if r % per_chunk:
        raise ValueError(f"a head chunk of {per_chunk} query heads does not divide the {r} query "
                         f"heads sharing a KV head; use a divisor or a multiple of {r}")
    return [(slice(j * r + i, j * r + i + per_chunk), slice(j, j + 1))
            for j in range(kv_heads) for i in range(0, r, per_chunk)]


@dataclass
class LayerSpec:
    """The parts of one pre-norm decoder layer, found by structure (easy_context.memory.maxlen)."""

    norm1: nn.Module
    attn: nn.Module  # q_proj, k_proj, v_proj, o_proj (nn.Linear), optional per-head q_norm/k_norm
    norm2: nn.Module
    mlp: nn.Module
    rope: Callable  # the family's apply_rotary_pos_emb(q, k, cos, sin) on (B, H, S, D)
    attention: Callable  # () -> the attention function transformers would call now
    heads: int
    kv_heads: int
    head_dim: int
    residual: float = 1.0  # each residual branch's factor (Granite's residual_multiplier)
    use_rope: bool = True  # False on NoPE layers (SmolLM3's): q and k are not rotated

    def parameters(self) -> list[nn.Parameter]:
        # Read at each call: FSDP2 swaps sharded for unsharded parameters around a forward.
        return [p for m in (self.norm1, self.attn, self.norm2, self.mlp) for p in m.parameters()]


@dataclass
class Run:
    """One call of the layer: its spec, settings and the attention's keyword arguments."""

    spec: LayerSpec
    tile: int
    heads_per_chunk: int  # query heads: a multiple of the GQA ratio, or a divisor of it
    keep_attention: bool
    storage: object  # easy_context.memory.offload: DeviceStorage or LayerStorage
    index: int = 0  # the layer's place in the model (LayerStorage keys by it)
    attn_kwargs: dict = field(default_factory=dict)
    attention_mask: Tensor | None = None
    gathered: Callable = contextlib.nullcontext  # () -> context with the layer's weights whole
    input_recipe: Callable | None = None  # () -> x again (the first layer's: an embedding lookup)
    rope_recipe: Callable | None = None  # () -> (cos, sin) again (the decoder's RoPE tables)
    replay: tuple | None = None  # (outs, recorded) from the nested recompute's regenerate()

    # ---------------------------------------------------------------- head groups
    def groups(self) -> list[tuple[slice, slice]]:
        """(query-head slice, KV-head slice) per chunk; query head h uses KV head h // ratio."""
        return head_chunks(self.spec.heads, self.spec.kv_heads, self.heads_per_chunk)

    def _rows(self, heads: slice) -> slice:
        d = self.spec.head_dim
        return slice(heads.start * d, heads.stop * d)

    def group_weights(self, qs: slice, ks: slice) -> list[Tensor | None]:
        """The group's rows of the q, k, v projections: [wq, bq, wk, bk, wv, bv] (views)."""
        a, out = self.spec.attn, []
        for proj, heads in ((a.q_proj, qs), (a.k_proj, ks), (a.v_proj, ks)):
            rows = self._rows(heads)
            out += [proj.weight[rows], None if proj.bias is None else proj.bias[rows]]
        return out

    def project(self, x: Tensor, w: list[Tensor | None], hq: int, hkv: int):
        """n1(x) through the group's q, k, v rows (+ per-head norms): (B, S, h, D) each."""
        a, d = self.spec.attn, self.spec.head_dim
        xn = self.spec.norm1(x)
        q = F.linear(xn, w[0], w[1]).unflatten(-1, (hq, d))
        k = F.linear(xn, w[2], w[3]).unflatten(-1, (hkv, d))
        v = F.linear(xn, w[4], w[5]).unflatten(-1, (hkv, d))
        if getattr(a, "q_norm", None) is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        return q, k, v

    def project_tiled(self, x: Tensor, qs: slice, ks: slice):
        """The group's q, k, v for the whole sequence, computed tile by tile without grad."""
        b, s, _ = x.shape
        hq, hkv, d = qs.stop - qs.start, ks.stop - ks.start, self.spec.head_dim
        w = self.group_weights(qs, ks)
        q = x.new_empty(b, s, hq, d)
        k, v = x.new_empty(b, s, hkv, d), x.new_empty(b, s, hkv, d)
        for t in tiles(s, self.tile):
            q[:, t], k[:, t], v[:, t] = self.project(x[:, t], w, hq, hkv)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
               sinks: Tensor | None = None) -> Tensor:
        """RoPE and the model's attention function on one group: (B, S, h, D) -> (B, S, hq, D).
        What the layer's own forward hands its attention function beyond q, k, v goes with
        it: the sliding window, soft-capping, and the group's attention sinks."""
        a = self.spec.attn
        qr, kr = q.transpose(1, 2), k.transpose(1, 2)
        if self.spec.use_rope:
            qr, kr = self.spec.rope(qr, kr, cos, sin)
        extra = {} if sinks is None else {"s_aux": sinks}
        if getattr(a, "attn_logit_softcapping", None) is not None:
            extra["softcap"] = a.attn_logit_softcapping
        out, _ = self.spec.attention()(
            a, qr, kr, v.transpose(1, 2), self.attention_mask, dropout=0.0, scaling=a.scaling,
            sliding_window=layer_window(a), **extra, **self.attn_kwargs)
        return out

    def sinks(self, qs: slice) -> Tensor | None:
        """The attention sinks (GPT-OSS) of the group's query heads, or None."""
        sinks = getattr(self.spec.attn, "sinks", None)
        return None if sinks is None else sinks[qs]

    # ---------------------------------------------------------------- forward pieces
    def attention_forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep_last: bool = False):
        """Every group's attention output (B, S, hq, D) and what its function recorded;
        with ``keep_last`` also the last group's q, k, v (before RoPE), which the backward
        that follows takes first (attention_backward runs the groups last to first) rather
        than projecting them again (with one group: the layer's whole q, k, v)."""
        outs, recorded, last = [], [], None
        groups = self.groups()
        for i, (qs, ks) in enumerate(groups):
            q, k, v = self.project_tiled(x, qs, ks)
            rec: list = []
            with recording(rec):
                outs.append(self.attend(q, k, v, cos, sin, self.sinks(qs)))
            recorded.append(rec)
            if keep_last and i == len(groups) - 1:
                last = (q, k, v)
            del q, k, v
        return (outs, recorded, last) if keep_last else (outs, recorded)

    def residual_tile(self, x: Tensor, outs: list[Tensor], t: slice) -> tuple[Tensor, Tensor]:
        """(h = x + o_proj(attention output), the attention output) for tile t."""
        o = torch.cat([out[:, t].flatten(2) for out in outs], dim=-1)  # (B, T, Hq * D)
        proj = self.spec.attn.o_proj
        return x[:, t] + branch(F.linear(o, proj.weight, proj.bias), self.spec.residual), o

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep: bool = False) -> Tensor:
        """The layer's output without autograd. ``keep``: this layer's backward comes next,
        so its attention results are kept for it (``replay``) instead of being computed a
        third time there."""
        with torch.no_grad():
            got = self.attention_forward(x, cos, sin, keep_last=keep)
            outs, recorded = got[0], got[1]
            if keep:
                self.replay = got  # (outs, recorded, the last group's q, k, v)
            return self.output(x, outs)

    def regenerate(self, x: Tensor, cos: Tensor, sin: Tensor, keep: bool = False) -> Tensor:
        """The forward again, from another layer's backward (the nested recompute): this
        layer's weights are sharded then, so they are gathered around it."""
        with self.gathered():
            return self.forward(x, cos, sin, keep)

    def output(self, x: Tensor, outs: list[Tensor]) -> Tensor:
        y = torch.empty_like(x)
        for t in tiles(x.size(1), self.tile):
            h, _ = self.residual_tile(x, outs, t)
            y[:, t] = h + branch(mlp_output(self.spec.mlp(self.spec.norm2(h))), self.spec.residual)
        return y


class Grads:
    """Parameter gradients summed over tiles and groups (float32 for 16-bit parameters)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.acc: dict[int, Tensor] = {}

    def _buf(self, p: Tensor) -> Tensor:
        if id(p) not in self.acc:
            dtype = torch.promote_types(p.dtype, torch.float32)
            self.acc[id(p)] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return self.acc[id(p)]

    def add(self, p: Tensor, g: Tensor | None, rows: slice | None = None) -> None:
        if g is None:
            return
        buf = self._buf(p)
        (buf if rows is None else buf[rows]).add_(g)

    def result(self) -> list[Tensor | None]:
        return [self.acc[id(p)].to(p.dtype) if id(p) in self.acc else None for p in self.params]


def _grad(outputs, inputs: list[Tensor | None], grad_outputs) -> list[Tensor | None]:
    """torch.autograd.grad over the inputs that require grad (None for the others)."""
    live = [t for t in inputs if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(outputs, live, grad_outputs, allow_unused=True))
    return [next(got) if t is not None and t.requires_grad else None for t in inputs]


def _leaf(t: Tensor | None, requires_grad: bool) -> Tensor | None:
    return None if t is None else t.detach().requires_grad_(requires_grad)


def mlp_backward(run: Run, x: Tensor, outs: list[Tensor], dy: Tensor, grads: Grads) -> Tensor:
    """Gradient of h (the residual after attention), tile by tile; o_proj's and the MLP's
    parameter gradients into ``grads``."""
    spec = run.spec
    wo = spec.attn.o_proj
    mlp_params = [p for m in (spec.norm2, spec.mlp) for p in m.parameters()]
    dh = torch.empty_like(dy)
    for t in tiles(x.size(1), run.tile):
        with torch.no_grad():
            h, o = run.residual_tile(x, outs, t)
        h.requires_grad_(True)
        with torch.enable_grad():
            m = mlp_output(spec.mlp(spec.norm2(h)))
        got = _grad(m, [h, *mlp_params], branch(dy[:, t], spec.residual))
        dh[:, t] = dy[:, t] + got[0]
        for p, g in zip(mlp_params, got[1:]):
            grads.add(p, g)
        del m, got, h
        da = branch(dh[:, t], spec.residual)  # the gradient of o_proj's output
        if wo.weight.requires_grad:  # d o_proj.weight = da^T o over the tile's tokens
            grads.add(wo.weight, da.flatten(0, 1).T.to(o.dtype) @ o.flatten(0, 1))
        if wo.bias is not None and wo.bias.requires_grad:
            grads.add(wo.bias, da.sum((0, 1)))
        del da
    return dh


def _projection_backward(run: Run, xn: Tensor, w: list[Tensor | None], grads_out: list,
                         owners: list, rows: list, grads: Grads, head_norms: list) -> Tensor:
    """One tile of one group: the gradient of n1(x) from those of q, k, v (B, T, h, D), and
    the q/k/v rows' (and per-head norms') parameter gradients into ``grads``. The
    projections are linear: their backward needs n1(x) and the gradients only, so q, k and v
    are not projected again, except q and k before their per-head norms (whose backward
    needs them)."""
    a = run.spec.attn
    d = run.spec.head_dim
    dq, dk, dv = grads_out
    if getattr(a, "q_norm", None) is not None:
        with torch.no_grad():
            q = F.linear(xn, w[0], w[1]).unflatten(-1, (dq.size(2), d))
            k = F.linear(xn, w[2], w[3]).unflatten(-1, (dk.size(2), d))
        q.requires_grad_(True), k.requires_grad_(True)
        with torch.enable_grad():
            qn, kn = a.q_norm(q), a.k_norm(k)
        got = _grad((qn, kn), [q, k, *head_norms], (dq, dk))
        dq, dk = got[0], got[1]
        for p, g in zip(head_norms, got[2:]):
            grads.add(p, g)
        del qn, kn, q, k, got
    dxn = None
    for i, dt in enumerate((dq, dk, dv)):
        weight, bias = w[2 * i], w[2 * i + 1]
        g = dt.flatten(2).to(weight.dtype)  # (B, T, h * D)
        part = g @ weight  # d n1(x) = dq W_q + dk W_k + dv W_v
        dxn = part if dxn is None else dxn + part
        if owners[2 * i].requires_grad:  # d W = dq^T n1(x) over the tile's tokens
            grads.add(owners[2 * i], g.flatten(0, 1).T @ xn.flatten(0, 1).to(g.dtype),
                      rows[i])
        if bias is not None and owners[2 * i + 1].requires_grad:
            grads.add(owners[2 * i + 1], g.sum((0, 1)), rows[i])
    return dxn


def attention_backward(run: Run, x: Tensor, cos: Tensor, sin: Tensor, recorded: list,
                       dh: Tensor, grads: Grads, needs_dx: bool,
                       last: list | None = None) -> Tensor | None:
    """Gradient of x: the residual's dh plus the attention's through n1 and the projections;
    their parameter gradients into ``grads``. Group by group, the gradient of n1(x) is
    summed over the groups (the projections' backward, tile by tile, from n1(x) computed
    again without grad); then n1's backward runs once per tile, on that sum (it is linear in
    its incoming gradient), rather than once per group and tile. The groups run last to
    first: ``last``, a list holding the last group's q, k, v when the attention was just
    computed again (emptied when taken), saves projecting them once more."""
    spec = run.spec
    a = spec.attn
    n1_params = list(spec.norm1.parameters())
    head_norms = [p for n in ("q_norm", "k_norm") if getattr(a, n, None) is not None
                  for p in getattr(a, n).parameters()]
    projs = (a.q_proj, a.k_proj, a.v_proj)
    owners = [t for proj in projs for t in (proj.weight, proj.bias)]
    # the gradient of n1(x), summed over the groups; then overwritten tile by tile with dx
    dxn = torch.zeros_like(dh)
    for (qs, ks), rec in reversed(list(zip(run.groups(), recorded))):
        if last:
            q, k, v = last.pop()
        else:
            with torch.no_grad():
                q, k, v = run.project_tiled(x, qs, ks)
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        sinks = run.sinks(qs)
        sinks = None if sinks is None else sinks.detach().requires_grad_(a.sinks.requires_grad)
        with torch.enable_grad(), replaying(rec):
            out = run.attend(q, k, v, cos, sin, sinks)  # the recorded result: no kernel forward
        # d out = r dh @ o_proj.weight[:, the group's columns]
        dout = (branch(dh, spec.residual) @ a.o_proj.weight[:, run._rows(qs)].to(dh.dtype)
                ).view_as(out)
        with_sinks = sinks is not None and sinks.requires_grad
        dq, dk, dv, *dsinks = torch.autograd.grad(out, [q, k, v] + ([sinks] if with_sinks else []),
                                                  dout)
        if with_sinks:
            grads.add(a.sinks, dsinks[0], qs)
        # The replayed result is the recorded tensor itself, which the attention function
        # returned as its output: it now carries the graph back to this group's q, k, v
        # leaves. Dropping the record frees them, and the group's output, here rather than
        # when the layer's backward ends (3 q/k/v-sized tensors a group otherwise).
        rec.clear()
        del out, dout, q, k, v
        w = [None if t is None else t.detach() for t in run.group_weights(qs, ks)]
        rows = [run._rows(qs), run._rows(ks), run._rows(ks)]
        for t in tiles(x.size(1), run.tile):
            with torch.no_grad():
                xn = spec.norm1(x[:, t])
                dxn[:, t] += _projection_backward(run, xn, w, (dq[:, t], dk[:, t], dv[:, t]),
                                                  owners, rows, grads, head_norms)
            del xn
        del dq, dk, dv
    n1_live = [p for p in n1_params if p.requires_grad]
    if not (needs_dx or n1_live):
        return None
    for t in tiles(x.size(1), run.tile):
        xt = x[:, t].detach().requires_grad_(needs_dx)
        with torch.enable_grad():
            xn = spec.norm1(xt)
        got = _grad(xn, [xt, *n1_params], dxn[:, t].to(xn.dtype))
        for p, g in zip(n1_params, got[1:]):
            grads.add(p, g)
        if needs_dx:
            dxn[:, t] = dh[:, t] + got[0]
        del xn, got
    return dxn if needs_dx else None


class FusedLayer(torch.autograd.Function):
    """(run, x (B, S, H), cos, sin, *layer parameters) -> the layer's output (B, S, H)."""

    @staticmethod
    def forward(ctx, run: Run, x: Tensor, cos: Tensor, sin: Tensor, *params: Tensor) -> Tensor:
        outs, recorded = run.attention_forward(x, cos, sin)
        y = run.output(x, outs)
        ctx.run = run
        # the RoPE tables: recomputed in backward when they are the decoder's
        # (easy_context.memory.recomputed), else kept
        ctx.tables = run.rope_recipe
        if ctx.tables is None:
            ctx.save_for_backward(cos, sin)
        tables = ctx.tables or (lambda: (cos, sin))
        if run.keep_attention:
            # per group, the length of each recorded result (e.g. (out, lse)): to unflatten
            ctx.layout = [[len(result) for result in rec] for rec in recorded]
            flat = [t for rec in recorded for result in rec for t in result]
            kept = [x, *outs, *flat]
        else:
            kept = [x]
        recipe = None if run.keep_attention else run.input_recipe  # x alone can be recomputed
        ctx.handle = run.storage.pack(kept, run.index,
                                      lambda x, keep=False: run.regenerate(x, *tables(), keep),
                                      recipe=recipe)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        run = ctx.run
        cos, sin = ctx.saved_tensors if ctx.tables is None else ctx.tables()
        kept = run.storage.unpack(ctx.handle)
        ctx.handle = None
        x, last = kept[0], None
        if len(kept) > 1:  # the attention was kept (a nested recompute regenerates x only)
            n = len(ctx.layout)
            outs, flat = kept[1:1 + n], iter(kept[1 + n:])
            recorded = [[tuple(next(flat) for _ in range(k)) for k in rec] for rec in ctx.layout]
        elif run.replay is not None:  # regenerated just before, with its attention
            (outs, recorded, last), run.replay = run.replay, None
        else:
            with torch.no_grad():
                outs, recorded, last = run.attention_forward(x, cos, sin, keep_last=True)
        del kept
        params = run.spec.parameters()
        grads = Grads(params)
        dh = mlp_backward(run, x, outs, dy, grads)
        del outs
        last = [last] if last is not None else []  # emptied when taken: not kept alive here
        dx = attention_backward(run, x, cos, sin, recorded, dh, grads, ctx.needs_input_grad[1],
                                last)
        return (None, dx, None, None, *grads.result())
