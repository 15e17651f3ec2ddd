"""Max-length mode for any decoder layer: the model's own layer forward, tiled and recomputed.

The fused layer (easy_context.memory.fused_layer) re-implements one layer shape. This path
re-implements nothing: it runs the layer's own ``forward``, so whatever the layer computes
(sandwich norms, multipliers, soft-caps, residual scalings, fused projections, MoE blocks,
LoRA adapters) runs as written. Around and inside that forward:

- the layer's MLP module (its ``mlp`` / ``feed_forward`` / ``block_sparse_moe`` child,
  whatever it is: gated, dense, an MoE with its router; the MLP of a transformer block the
  layer calls, Zamba2's shared block; or, inline in the layer's forward, ``fc1`` ->
  activation -> ``fc2``: OPT, BioGPT, Whisper's decoder) runs over sequence tiles of ``tile``
  tokens, each tile under its own (non-reentrant) checkpoint, so a tile's (B, tile, I)
  intermediates are not kept for backward but computed again there, tile by tile;
- the attention function transformers calls (any sequence-parallel method's included) runs
  ``heads_per_chunk`` query heads at a time: q, k, v arrive there already projected,
  whatever the layer's norms and projections were, and are cut by heads; a ring method
  then sends each chunk's K/V in its own pass (the same bytes in all, in more messages);
- one autograd function keeps only the layer's input (on the device, or in host memory and
  with the nested recompute, through the same storage as the fused layer:
  easy_context.memory.offload) and, in backward, runs the layer's own forward again with
  grad and differentiates it. With ``keep_attention`` it also keeps each head chunk's
  attention result (easy_context.attention.saving), which that recompute takes instead of
  running attention, and its communication, again.

What this path keeps in backward: the layer's backward runs its forward again in sequence
tiles, split at the attention call (easy_context.memory.tiled_backward): the whole sequence's
attention output and its gradient, with one tile's graph or with q, k, v and one head
chunk's attention backward, where the layer passes that module's check (per token but for
its attention call); its forward then runs in the same split (tiles up to the attention
call, the attention, tiles after it: ``GenericRun.compute``). Else its recompute's
autograd graph holds every whole-sequence intermediate other than the MLP's (the normed
input, q, k, v, the attention output, the residual, the normed residual: about 17
hidden-sized tensors a token on Gemma 3's layer) for that one layer. The MLP's I-wide
tensors, the large ones, exist one tile at a time either way.

Hybrid models: a layer holding a recurrent mixer (gated DeltaNet, KDA, Mamba-1/2, a short
convolution) runs it whole, as its own forward calls it: routed to the sequence-parallel
kernels (integrations.hf_recurrent), which exchange the state between ranks. That exchange
is a collective inside the recompute; every rank recomputes the same layers in the same
order (backward, the nested recompute), as for attention. State a layer's forward pre-hooks
set for the call (Jamba's document ids: ``CALL_STATE``) is put back before each recompute.
A layer of norms and token mixers only (Nemotron-H's Mamba and attention blocks) has no
MLP to tile and runs whole.

K/V shared between layers (Gemma 3n's and Gemma 4's ``num_kv_shared_layers``: a layer writes
its K/V into the ``shared_kv_states`` mapping every layer is handed, later layers attend to
them): the entries a layer is handed are inputs of its autograd function and those it writes
are outputs (:class:`SharedStore`), so their gradient, summed over the reading layers, reaches
the writing layer's recompute; every recompute reads the K/V its layer was handed.

Exact: the same modules on the same numbers; MLP tiles and head chunks are independent
(per-token MLPs, per-head attention), which :func:`mlp_mismatch` checks for the MLP on a
few random tokens and the MoE checks below refuse where routing looks past one token
(:func:`inline_mismatch`, for an inline fc1 -> activation -> fc2, the layer's own forward
against the swapped one).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy as _copy
import functools
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention.saving import recording, replaying
from . import tiled_backward
from .fused_layer import _grad, head_chunks, tiles
from .layer_check import state_carrying_layers

Tensor = torch.Tensor

# a decoder layer's MLP children (Granite 4 hybrids: an MoE block and a shared MLP, summed;
# CTRL and DBRX: ffn)
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp", "ffn")
# a child that is the layer's MLP when it is neither attention nor a recurrent mixer (Nemotron-H
# blocks hold one "mixer": Mamba-2, attention, an MLP or an MoE, by the block's type)
MIXER_NAMES = ("mixer",)
# The attribute under which a decoder layer may hold ``snapshot(layer) -> restore()``: state
# its forward pre-hooks set for this call and its forward reads (hf_recurrent's recording of
# the document ids for Jamba's Mamba layers), put back before each recompute, which runs the
# layer's forward without its __call__ and so without those hooks.
CALL_STATE = "_easy_context_call_state"
CHUNKED = "easy_context_head_chunked"  # the attention-interface name of the chunking wrapper
# (inner implementation name, query heads per chunk) while a generic layer runs
_CHUNKING: contextvars.ContextVar = contextvars.ContextVar("ec_head_chunking", default=None)
# Config entries of MoE routers that look at more than one token: a capacity per expert
# counts the tokens routed to it over the whole batch (drops depend on the other tokens).
CAPACITY_KEYS = ("capacity_factor", "expert_capacity", "moe_capacity_factor",
                 "eval_capacity_factor", "train_capacity_factor")
PROBE_TOKENS = 8


def find_mlp(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The layer's (first) MLP child (its name and module), or None."""
    found = find_mlps(layer)
    return found[0] if found else None


def _token_mixer(module: nn.Module) -> bool:
    """Attention (a module with ``is_causal``) or a layer carrying a state along the sequence,
    or a module holding one: what mixes tokens, never tiled."""
    return any(hasattr(m, "is_causal") for m in module.modules()) or \
        bool(state_carrying_layers(module))


def find_mlps(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layer's MLP children (name and module each): those of MLP_NAMES, and a child of
    MIXER_NAMES that mixes no tokens (Nemotron-H's MLP and MoE blocks); where there are none,
    the MLP children of a child that is a transformer block (attention and an MLP), under
    "child.name": Zamba2's hybrid layers call the shared attention block
    (``shared_transformer``), whose ``feed_forward`` is the layer's MLP."""
    found = [(n, m) for n in MLP_NAMES if isinstance(m := getattr(layer, n, None), nn.Module)]
    found += [(n, m) for n in MIXER_NAMES if isinstance(m := getattr(layer, n, None), nn.Module)
              and not _token_mixer(m)]
    if found:
        return found
    return [(f"{cn}.{n}", m) for cn, child in layer.named_children()
            if any(hasattr(c, "is_causal") for c in child.modules())
            for n in MLP_NAMES if isinstance(m := getattr(child, n, None), nn.Module)]


def _mixer_only(layer: nn.Module) -> bool:
    """A layer with nothing to tile: its children are norms (leaves holding one-dimensional
    tensors only) and token mixers (attention, recurrent layers), as Nemotron-H's Mamba and
    attention blocks and Zamba2's Mamba layers are. The generic path runs it whole."""
    def norm(m: nn.Module) -> bool:
        tensors = list(m.parameters()) + list(m.buffers())
        return not list(m.children()) and all(t.dim() <= 1 for t in tensors)

    children = list(layer.children())
    return any(_token_mixer(c) for c in children) and \
        all(norm(c) or _token_mixer(c) for c in children)


# A layer method that is its per-token feed-forward, where no child is: BERT-style layers
# (BERT, RoBERTa, ELECTRA...) call ``self.feed_forward_chunk(attention_output)`` (their
# ``intermediate`` and ``output`` children, the residual and LayerNorm included).
FFN_METHODS = ("feed_forward_chunk",)


# A feed-forward inline in the layer's forward, on children: ``fc2(act(fc1(x)))`` (OPT, on
# hidden states flattened to (B * S, H); BioGPT and Whisper's decoder, on (B, S, H)). The
# names of its two linear children and of the activation between them (a module or a function).
INLINE_LINEARS = ("fc1", "fc2")
INLINE_ACTIVATIONS = ("activation_fn", "act_fn", "activation")


def _inline_ffn(layer: nn.Module) -> tuple[str, str, str] | None:
    """(fc1, activation, fc2) attribute names where ``layer`` holds the two linear children
    and a callable activation of an inline feed-forward, else None."""
    first, second = INLINE_LINEARS
    if not all(isinstance(getattr(layer, n, None), nn.Module) for n in INLINE_LINEARS):
        return None
    act = next((a for a in INLINE_ACTIVATIONS if callable(getattr(layer, a, None))), None)
    return (first, act, second) if act else None


def mlp_sites(layer: nn.Module) -> list[tuple[str, object, str | tuple]]:
    """Every feed-forward site max-length mode tiles in ``layer``, as (its name, the object,
    the attribute tiled): each MLP child's ``forward`` (find_mlps), or else the layer's
    feed-forward method, or else its inline ``fc1 -> activation -> fc2`` (the attribute is
    then the three names, :func:`inline_tiled`); [] for a layer of token mixers and norms
    only (run whole). :func:`site_tiled` tiles any of them."""
    children = [(n, m, "forward") for n, m in find_mlps(layer)]
    if children:
        return children
    methods = [(name, layer, name) for name in FFN_METHODS
               if callable(getattr(layer, name, None))][:1]
    if methods:
        return methods
    inline = _inline_ffn(layer)
    return [(" -> ".join(inline), layer, inline)] if inline else []


def static_mismatch(layer: nn.Module, config) -> str | None:
    """Why the generic path cannot run ``layer`` exactly (from its structure and the
    config), or None."""
    name = type(layer).__name__
    if getattr(config, "output_router_logits", False):
        return ("max-length mode: config.output_router_logits is on: the router's auxiliary "
                "loss would see the MLP's sequence tiles as separate calls, recorded without "
                "grad; turn it off (router_aux_loss_coef=0)")
    # a recurrent mixer (a state carried along the sequence) runs whole, in the layer's own
    # forward, routed to the sequence-parallel kernels as without max-length mode
    if not mlp_sites(layer) and not _mixer_only(layer):
        return (f"max-length mode tiles a decoder layer's MLP child ({', '.join(MLP_NAMES)}), "
                f"feed-forward method ({', '.join(FFN_METHODS)}) or inline "
                f"{' -> '.join(INLINE_LINEARS)} (an activation between them); "
                f"{name} has {sorted(n for n, _ in layer.named_children())}. Train this model "
                "without --mlp-tile/--head-chunk")
    drop = [n for n, m in layer.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    drop += [f"{n + '.' if n else ''}{a}" for n, m in layer.named_modules()
             for a, v in vars(m).items() if "dropout" in a and isinstance(v, (int, float))
             and not isinstance(v, bool) and v > 0]
    if drop:
        # the recompute in backward would draw other masks than the forward did
        return (f"max-length mode: {name}.{drop[0]} is a dropout (p > 0), which the layer's "
                "recompute would draw again; set the config's dropout to 0")
    for key in CAPACITY_KEYS:
        if getattr(config, key, None):
            return (f"max-length mode: config.{key} = {getattr(config, key)}: an expert capacity "
                    "counts tokens over the whole sequence, which MLP tiles do not see; "
                    "train this model without --mlp-tile/--head-chunk")
    return None


# The arguments a decoder layer's forward may take besides the hidden states that the generic
# path knows by name: masks, positions, the RoPE tables, the cache ones (a call with a cache
# runs the layer unchanged). Others are handed on too (_generic_forward: values as they are,
# tensors that require grad as inputs of the layer's recompute, Gemma 4's per-layer inputs,
# and a mapping the layers share, below).
# The attribute by which an attention module reads another layer's K/V instead of computing
# its own (Gemma 3n / Gemma 4's KV sharing): through the mapping every layer of one forward is
# handed (``shared_kv_states``), in which the producing layer ("store_full_length_kv") put its
# K/V. A gradient between layers, which a layer's own recompute would not hand back: the
# generic path makes the mapping's entries inputs of each layer's autograd function and the
# entries a layer stores its outputs (SharedStore), so autograd carries it.
KV_SHARING_FLAG = "is_kv_shared_layer"


def kv_sharing(layer: nn.Module) -> list[str]:
    """The modules of ``layer`` that reuse another layer's K/V."""
    return [n or "self" for n, m in layer.named_modules()
            if getattr(m, KV_SHARING_FLAG, False) is True]


def shared_store_name(kwargs: dict) -> str | None:
    """The keyword argument that is a mapping handed to every layer of one forward (Gemma 3n's
    and Gemma 4's ``shared_kv_states``: a layer writes its K/V there, later layers read them),
    or None."""
    names = [k for k, v in kwargs.items() if isinstance(v, MutableMapping)]
    return names[0] if names else None


def _float(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def _entry_tensors(value) -> list[Tensor]:
    """The floating-point tensors of one entry of a shared mapping (a tensor, or a tuple or
    list of them: Gemma's (keys, values))."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if _float(t)]


def _with_tensors(value, tensors):
    """``value`` with its floating-point tensors taken in order from the iterator ``tensors``."""
    if isinstance(value, (tuple, list)):
        items = [next(tensors) if _float(t) else t for t in value]
        return items if isinstance(value, list) else tuple(items)
    return next(tensors) if _float(value) else value


class SharedStore:
    """A mapping the layers of one forward share (``shared_kv_states``), seen by one layer's
    call: the entries it held when the layer was called (``held``: read by the layer, inputs of
    its autograd function) and the keys the layer's first call (re)wrote (``written``: outputs
    of its autograd function, so their gradient, summed over every later layer that read them,
    comes back to it). The first call of the layer writes into the model's mapping; every later
    call (backward's recompute, the nested recompute's regeneration) gets a private copy holding
    what the layer was handed, so it reads the K/V it read in forward (in backward: their
    differentiable copies) and writes nowhere another layer reads."""

    def __init__(self, mapping: MutableMapping):
        self.mapping = mapping
        self.held = dict(mapping.items())  # key -> entry, as the layer was called
        self.written: list | None = None  # keys the first call wrote; None: not run yet

    def inputs(self) -> list[Tensor]:
        """The floating-point tensors of the held entries, in order."""
        return [t for v in self.held.values() for t in _entry_tensors(v)]

    def private(self, tensors: list[Tensor] | None = None) -> MutableMapping:
        """A copy of the mapping (its type) holding the held entries, their tensors replaced
        by ``tensors`` (in the order of :meth:`inputs`) when given."""
        copy_ = _copy.copy(self.mapping)
        copy_.clear()
        it = iter(tensors) if tensors is not None else None
        copy_.update({k: (_with_tensors(v, it) if it is not None else v)
                      for k, v in self.held.items()})
        return copy_

    def note_written(self) -> None:
        """After the layer's first call: which entries of the mapping it wrote."""
        self.written = [k for k, v in self.mapping.items()
                        if k not in self.held or self.held[k] is not v]

    def outputs(self, mapping: MutableMapping | None = None) -> list[Tensor]:
        """The floating-point tensors of the written entries in ``mapping`` (the model's one
        by default), in order."""
        mapping = self.mapping if mapping is None else mapping
        return [t for k in self.written or [] for t in _entry_tensors(mapping[k])]

    def put_back(self, tensors) -> None:
        """The written entries of the model's mapping, their tensors replaced by ``tensors``
        (the autograd function's outputs, which carry the gradient back to this layer)."""
        it = iter(tensors)
        for k in self.written or []:
            self.mapping[k] = _with_tensors(self.mapping[k], it)


# ------------------------------------------------------------------------- MLP tiles
def _tile_output(outs: list, b: int, t: list[int]):
    """The tiles' outputs as one: (B, T, H) tensors along the sequence; a tuple (an MoE's
    hidden states and its (B * T, E) router logits) element by element, token-major."""
    if isinstance(outs[0], Tensor):
        return torch.cat(outs, dim=1)
    parts = []
    for i in range(len(outs[0])):
        items = [o[i] for o in outs]
        if not all(isinstance(x, Tensor) for x in items):
            parts.append(items[0])
        elif items[0].dim() >= 3 and items[0].size(0) == b:
            parts.append(torch.cat(items, dim=1))
        elif items[0].dim() >= 1 and items[0].size(0) == b * t[0]:
            parts.append(torch.cat([x.unflatten(0, (b, n)) for x, n in zip(items, t)], 1)
                         .flatten(0, 1))
        else:
            raise ValueError(f"max-length mode: the MLP returned a {tuple(items[0].shape)} "
                             "tensor that is not per token; it cannot run in sequence tiles")
    return type(outs[0])(parts)


def tiled(forward: Callable, tile: int) -> Callable:
    """``forward`` (an MLP's, on (B, S, H)) over sequence tiles of ``tile`` tokens, each
    checkpointed when grad is on: backward computes a tile's intermediates again."""

    def contiguous(x: Tensor, *args, **kwargs):
        # a tile of a batch of rows is a strided view; MoE blocks view it as (B * T, H). The
        # copy is made inside the checkpoint, which keeps the view (of a kept tensor) only.
        return forward(x.contiguous(), *args, **kwargs)

    @functools.wraps(forward)  # its signature: BERT's apply_chunking_to_forward counts it
    def run(hidden_states: Tensor, *args, **kwargs):
        # other arguments that are not tensors (Zamba2's shared MLP takes the layer's index)
        # go to every tile; a tensor beside the hidden states: the MLP runs whole
        if any(isinstance(a, Tensor) for a in (*args, *kwargs.values())) or \
                hidden_states.dim() != 3 or hidden_states.size(1) <= tile:
            return forward(hidden_states, *args, **kwargs)
        outs, lengths = [], []
        for t in tiles(hidden_states.size(1), tile):
            x = hidden_states[:, t]
            if torch.is_grad_enabled():
                outs.append(checkpoint(contiguous, x, *args, use_reentrant=False, **kwargs))
            else:
                outs.append(contiguous(x, *args, **kwargs))
            lengths.append(x.size(1))
        return _tile_output(outs, hidden_states.size(0), lengths)

    return run


@contextlib.contextmanager
def mlp_tiled(mlp: nn.Module, tile: int, attr: str = "forward"):
    """``mlp`` runs in sequence tiles inside (its instance ``forward``, or the method
    ``attr``, replaced, then put back)."""
    had = attr in vars(mlp)
    old = vars(mlp).get(attr)
    setattr(mlp, attr, tiled(getattr(mlp, attr), tile))
    try:
        yield
    finally:
        if had:
            setattr(mlp, attr, old)
        else:
            delattr(mlp, attr)


def _identity(x, *args, **kwargs):
    return x


@contextlib.contextmanager
def _forward_replaced(owner: nn.Module, name: str, by: Callable):
    """``owner.<name>`` (a child module, or a function attribute) acts as ``by`` inside: a
    module gets ``by`` as its instance ``forward`` (its hooks still run), a function is
    shadowed by an instance attribute; both put back after."""
    target = getattr(owner, name)
    obj, attr = (target, "forward") if isinstance(target, nn.Module) else (owner, name)
    had = attr in vars(obj)
    old = vars(obj).get(attr)
    object.__setattr__(obj, attr, by)
    try:
        yield
    finally:
        if had:
            object.__setattr__(obj, attr, old)
        else:
            delattr(obj, attr)


@contextlib.contextmanager
def inline_tiled(layer: nn.Module, names: tuple[str, str, str], tile: int,
                 batch: int | None = None):
    """The layer's inline feed-forward ``fc2(act(fc1(x)))`` in sequence tiles inside: fc1 and
    the activation return their input, and fc2 computes all three, tile by tile (tiled: each
    tile checkpointed, so its I-wide intermediates are computed again in backward). The
    three's own computations are taken before the swap, so a checkpoint's recompute (in
    backward, after this context closed) runs them. fc2 gets (B, S, H), or OPT's (B * S, H)
    with ``batch`` = B: viewed as (B, S, H) for the tiles (B x tile tokens each), flattened
    back. Exact where the layer calls nothing between fc1, the activation and fc2 that is not
    the identity (a dropout of p > 0 is refused: static_mismatch); inline_mismatch checks."""
    first, act, second = names
    fc1, fc2, fn = getattr(layer, first), getattr(layer, second), getattr(layer, act)
    f1, f2 = fc1.forward, fc2.forward
    fa = fn.forward if isinstance(fn, nn.Module) else fn

    def ffn(x: Tensor) -> Tensor:  # (B, T, H) -> (B, T, H)
        return f2(fa(f1(x)))

    over_tiles = tiled(ffn, tile)

    def fused_fc2(x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs:  # not the call this swap is for: nothing is exact to do
            raise ValueError(f"max-length mode: {type(layer).__name__}.{second} was called "
                             "with more than its input; it cannot run in sequence tiles")
        if x.dim() == 2 and batch and x.size(0) % batch == 0:
            return over_tiles(x.unflatten(0, (batch, -1))).flatten(0, 1)
        return over_tiles(x)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_forward_replaced(layer, first, _identity))
        stack.enter_context(_forward_replaced(layer, act, _identity))
        stack.enter_context(_forward_replaced(layer, second, fused_fc2))
        yield


def site_tiled(owner, attr: str | tuple, tile: int, batch: int | None = None):
    """One feed-forward site of :func:`mlp_sites` in sequence tiles (a context manager):
    an MLP child or feed-forward method (mlp_tiled), or an inline fc1 -> act -> fc2
    (inline_tiled; ``batch``: the layer's input's B)."""
    if isinstance(attr, tuple):
        return inline_tiled(owner, attr, tile, batch)
    return mlp_tiled(owner, tile, attr)


# The name transformers gives a decoder layer's index, which the decoder hands each layer and
# some MLPs take beside the hidden states (Zamba2's shared MLP picks its per-layer adapter)
LAYER_INDEX_ARG = "layer_idx"


def mlp_mismatch(layer: nn.Module, tile: int = 3, index: int | None = None) -> str | None:
    """Run the layer's MLP on a few random tokens whole and in tiles (no grad, eval mode)
    and say how far apart they are when they differ: a check that it is per token (an MoE
    whose routing looks at other tokens is not). Skipped (None) where the weights are not
    whole and local (meta, ZeRO-3, DTensor) or not floating point. Each of the layer's
    feed-forward sites (mlp_sites) is checked; none: None. ``index``: the layer's index in
    the decoder, for an MLP that takes it (LAYER_INDEX_ARG)."""
    for name, mlp, attr in mlp_sites(layer):
        if isinstance(attr, tuple):
            reason = inline_mismatch(layer, name, mlp, attr, tile)
        else:
            reason = _one_mlp_mismatch(layer, name, mlp, attr, tile, index)
        if reason:
            return reason
    return None


def _index_kwargs(forward: Callable, index: int | None) -> dict:
    """{LAYER_INDEX_ARG: index} where ``forward`` takes the layer's index, else {}."""
    import inspect

    try:
        takes = LAYER_INDEX_ARG in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    return {LAYER_INDEX_ARG: index} if takes and index is not None else {}


def _probe_call(forward: Callable, x: Tensor, index: int | None):
    """``forward`` on the probe's tokens as the layer would call it: on the hidden states
    alone (Moshi's MLP takes a layer_idx it is not given), or, where that fails and it takes
    the layer's index, with it (Zamba2's shared MLP needs it to pick its adapter)."""
    try:
        return forward(x)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001
        kw = _index_kwargs(forward, index)
        if not kw:
            raise
        return forward(x, **kw)


def _one_mlp_mismatch(layer: nn.Module, name: str, mlp, attr: str, tile: int,
                      index: int | None = None) -> str | None:
    params = list(mlp.parameters())
    if not params or any(p.is_meta or hasattr(p, "ds_id") or type(p.data) is not torch.Tensor
                         or not p.is_floating_point() for p in params):
        return None
    # the MLP's own input width before the layer's first linear layer's (a recurrent mixer's
    # may be wider: Qwen3.5's gated DeltaNet out_proj takes its value heads)
    hidden = getattr(getattr(layer, "config", None), "hidden_size", None) or _width(mlp) \
        or _width(layer)
    if hidden is None:
        return None
    p = params[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, PROBE_TOKENS, hidden, generator=gen).to(p.device, p.dtype)
    training = mlp.training
    try:
        mlp.train(False)
        with torch.no_grad():
            want = _probe_call(getattr(mlp, attr), x, index)
            with mlp_tiled(mlp, tile, attr):
                got = _probe_call(getattr(mlp, attr), x, index)
    except ValueError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001  (an MLP that takes more than the probe gives it)
        return (f"max-length mode: could not check {type(layer).__name__}.{name} in sequence "
                f"tiles on random tokens ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); train without "
                "--mlp-tile/--head-chunk")
    finally:
        mlp.train(training)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    err = _off(got, want, p.dtype)
    if err is None:
        return None
    return (f"max-length mode: {type(layer).__name__}.{name} gives other results in sequence "
            f"tiles ({err:.1e} relative on {PROBE_TOKENS} random tokens): it is not per token "
            "(e.g. routing that looks at the other tokens); train without --mlp-tile/--head-chunk")


def _off(got: Tensor, want: Tensor, dtype: torch.dtype) -> float | None:
    """A probe's error relative to ``want``'s largest entry, or None within its dtype's
    tolerance (1e-5 in fp32/fp64, 5e-2 below)."""
    err = float((got.float() - want.float()).abs().max() /
                want.float().abs().max().clamp(min=1e-12))
    return None if err <= (1e-5 if dtype in (torch.float32, torch.float64) else 5e-2) else err


def _local_weights(module: nn.Module) -> bool:
    """Whole, local, floating-point weights (not meta, ZeRO-3 or DTensor): a probe can run."""
    params = list(module.parameters())
    return bool(params) and not any(
        p.is_meta or hasattr(p, "ds_id") or type(p.data) is not torch.Tensor
        or not p.is_floating_point() for p in params)


@contextlib.contextmanager
def _eager_attention(layer: nn.Module):
    """The layer's attention through transformers' eager function inside: one process, no
    sequence-parallel collective (a probe runs on every rank before training starts)."""
    configs = _configs(layer)
    old = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = "eager"
    try:
        yield
    finally:
        for c, name in zip(configs, old):
            c._attn_implementation_internal = name


def inline_mismatch(layer: nn.Module, name: str, owner: nn.Module, names: tuple, tile: int
                    ) -> str | None:
    """The layer's own forward, whole, against the same forward with its inline feed-forward
    swapped for the tiled one (inline_tiled), on a few random tokens, eval mode, eager
    attention, no grad: they must agree (nothing else between fc1, the activation and fc2),
    else the reason. Skipped (None) where the weights are not whole and local."""
    if not _local_weights(layer):
        return None
    fc1 = getattr(layer, names[0])
    hidden = getattr(fc1, "in_features", None) or _width(fc1)
    p = next(layer.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, PROBE_TOKENS, hidden, generator=gen).to(p.device, p.dtype)
    forward = getattr(layer, "_ec_original_forward", None) or layer.forward
    training = layer.training

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    try:
        layer.train(False)
        with torch.no_grad(), _eager_attention(layer):
            want = first(forward(x))
            with inline_tiled(layer, names, tile, batch=x.size(0)):
                got = first(forward(x))
    except Exception as e:  # noqa: BLE001  (any failure: the swap is not verified)
        return (f"max-length mode: could not check {type(layer).__name__}'s inline "
                f"{name} in sequence tiles against its own forward ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); train without "
                "--mlp-tile/--head-chunk")
    finally:
        layer.train(training)
    err = _off(got, want, p.dtype)
    if err is None:
        return None
    return (f"max-length mode: {type(layer).__name__}'s inline {name} in sequence tiles "
            f"gives other results than its own forward ({err:.1e} relative on {PROBE_TOKENS} "
            "random tokens): its forward computes more between them than fc2(act(fc1(x))); "
            "train without --mlp-tile/--head-chunk")


def _width(layer: nn.Module) -> int | None:
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
    return None


# ------------------------------------------------------------------------- head chunks
def _eager(module: nn.Module) -> Callable | None:
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def chunk_calls(module: nn.Module, query: Tensor, key: Tensor, attention_mask, kwargs: dict,
                inner: Callable, per_chunk: int) -> list[tuple[slice, slice, Callable]]:
    """The attention call cut into head chunks: [(query heads, KV heads, call)], each
    ``call(q, k, v)`` (that chunk's heads) -> (out (B, S, hc, Dv), weights or None). GQA
    chunks take whole KV heads or part of one KV head's query heads (head_chunks); the sinks
    (``s_aux``) and a per-head mask go with their query heads."""
    heads, kv_heads = query.size(1), key.size(1)
    if per_chunk >= heads:
        return [(slice(0, heads), slice(0, kv_heads),
                 functools.partial(_call_inner, inner, module, attention_mask, kwargs, None))]
    odd = [k for k, v in kwargs.items() if k != "s_aux" and isinstance(v, Tensor)
           and v.dim() == 1 and v.numel() == heads]
    if odd:
        raise ValueError(f"max-length mode: the attention of {type(module).__name__} takes "
                         f"{odd[0]}, one value per head, which the head chunks do not cut; "
                         "use a --head-chunk of all heads")
    return [(qs, ks, functools.partial(_call_inner, inner, module, attention_mask, kwargs, qs))
            for qs, ks in head_chunks(heads, kv_heads, per_chunk)]


def _call_inner(inner: Callable, module: nn.Module, mask, kwargs: dict, heads: slice | None,
                q: Tensor, k: Tensor, v: Tensor):
    """One chunk's call; the sinks and a per-head mask cut to its query ``heads`` here, at
    the call, so that under grad (the tiled backward's pass 2) the cut carries it."""
    if heads is not None:
        kwargs = dict(kwargs)
        if isinstance(kwargs.get("s_aux"), Tensor):
            kwargs["s_aux"] = kwargs["s_aux"][heads]
        if isinstance(mask, Tensor) and mask.dim() == 4 and mask.size(1) > 1:
            mask = mask[:, heads]
    return inner(module, q, k, v, mask, **kwargs)


def chunked_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask, **kwargs):
    """The attention function transformers would call, a chunk of query heads at a time:
    query (B, Hq, S, D), key/value (B, Hkv, S, D) -> ((B, S, Hq, Dv), weights or None).
    While the tiled backward runs (tiled_backward.INTERCEPT), the call is handed to it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner_name, per_chunk = _CHUNKING.get()
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, _eager(module))
    calls = chunk_calls(module, query, key, attention_mask, kwargs, inner, per_chunk)
    intercept = tiled_backward.INTERCEPT.get()
    if intercept is not None:
        return intercept(query, key, value, calls), None
    if len(calls) == 1:
        return calls[0][2](query, key, value)
    outs, weights = [], []
    for qs, ks, call in calls:
        out, w = call(query[:, qs], key[:, ks], value[:, ks])
        outs.append(out)
        weights.append(w)
    w = None if any(x is None for x in weights) else torch.cat(weights, dim=1)
    return torch.cat(outs, dim=2), w


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if CHUNKED not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(CHUNKED, chunked_attention)


def _configs(layer: nn.Module) -> list:
    """The distinct configs (with an attention implementation) of the layer's modules."""
    seen: dict[int, object] = {}
    for m in layer.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation_internal"):
            seen.setdefault(id(c), c)
    return list(seen.values())


@contextlib.contextmanager
def heads_chunked(layer: nn.Module, per_chunk: int):
    """Inside, the layer's attention calls go through :func:`chunked_attention`."""
    _register()
    configs = _configs(layer)
    names = {c._attn_implementation_internal for c in configs}
    if len(names) != 1:  # nothing to switch, or modules disagreeing: left as they are
        yield
        return
    (inner,) = names
    token = _CHUNKING.set((inner, per_chunk))
    for c in configs:
        c._attn_implementation_internal = CHUNKED
    try:
        yield
    finally:
        for c in configs:
            c._attn_implementation_internal = inner
        _CHUNKING.reset(token)


# ------------------------------------------------------------------------- the layer
@dataclass
class GenericRun:
    """One call of a layer on the generic path: the layer's own forward and its arguments
    besides the hidden states, the settings, and where its input is kept."""

    layer: nn.Module
    forward: Callable  # the layer's own forward (bound)
    kwargs: dict  # its keyword arguments besides hidden_states (position_embeddings apart)
    tile: int
    heads_per_chunk: int
    keep_attention: bool
    storage: object  # easy_context.memory.offload: DeviceStorage or LayerStorage
    index: int = 0
    gathered: Callable = contextlib.nullcontext
    input_recipe: Callable | None = None  # () -> x again (the first layer's: an embedding)
    tables: Callable | None = None  # () -> position_embeddings (kept, or their recipe)
    replay: list | None = None  # what the nested recompute's regenerate() recorded
    restore: Callable | None = None  # () -> None: puts back the call's state (CALL_STATE)
    grad_inputs: tuple = ()  # names of the kwargs that are tensors requiring grad
    tail: tuple | None = None  # the Nones the layer returns after its hidden states, if any
    store: str | None = None  # the kwarg that is a mapping the layers share (shared_kv_states)

    def __post_init__(self):
        # what the shared mapping holds as this layer is called (before it writes there)
        self.shared = SharedStore(self.kwargs[self.store]) if self.store is not None else None

    def output(self, y: Tensor):
        """The layer's output as its own forward returns it: y, or (y, None...)."""
        return y if self.tail is None else (y, *self.tail)

    def extra_inputs(self) -> list[Tensor]:
        """Inputs of the autograd function beside the hidden states, so their gradients flow
        back: the kwargs that require grad (Gemma 4's per_layer_input), then the tensors of
        the shared mapping's entries (the K/V earlier layers stored there)."""
        shared = self.shared.inputs() if self.shared is not None else []
        return [self.kwargs[k] for k in self.grad_inputs] + shared

    def finish(self, out) -> Tensor:
        """The autograd function's result -> the hidden states; the K/V the layer wrote into
        the shared mapping (its other outputs) put back there, as the function's outputs."""
        if not isinstance(out, tuple):
            return out
        self.shared.put_back(out[1:])
        return out[0]

    def parameters(self) -> list[nn.Parameter]:
        return list(self.layer.parameters())

    def call(self, x: Tensor, rows: slice | None = None, length: int | None = None,
             **override) -> Tensor:
        """The layer's own forward on x, its MLPs tiled and its attention head-chunked (a
        recurrent mixer runs whole: its kernels exchange the state between ranks, and a
        recompute runs them on every rank in the same order, as it does attention);
        ``override``: kwargs replaced (backward's differentiable copies); ``rows``: x holds
        those tokens of the ``length`` the arguments are for (the tiled backward's tiles),
        and the per-token arguments are cut to them."""
        kwargs = {**self.kwargs, **override}
        first = self.shared is not None and self.shared.written is None
        if self.shared is not None and not first and self.store not in override:
            # a recompute: the K/V the layer read in forward, and a mapping nobody else reads
            kwargs[self.store] = self.shared.private()
        if self.tables is not None:
            kwargs["position_embeddings"] = self.tables()
        if rows is not None:
            kwargs = tiled_backward.cut_rows(kwargs, rows, length, keep=tuple(override))
        if self.restore is not None:
            self.restore()  # this call's document ids, not the latest forward's
        with contextlib.ExitStack() as stack:
            for _, mlp, attr in mlp_sites(self.layer):
                stack.enter_context(site_tiled(mlp, attr, self.tile, batch=x.size(0)))
            stack.enter_context(heads_chunked(self.layer, self.heads_per_chunk))
            out = self.forward(x, **kwargs)
        if first:
            self.shared.note_written()
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor) and all(
                t is None for t in out[1:]):
            # (hidden states, None...): Falcon's, Bamba's and Falcon-H1's (output, attention
            # weights) without weights
            self.tail, out = out[1:], out[0]
        if not isinstance(out, Tensor):
            raise ValueError(f"max-length mode: {type(self.layer).__name__} returns "
                             f"{type(out).__name__}, not the hidden states alone")
        return out

    def compute(self, x: Tensor) -> Tensor:
        """The layer's output without grad: split at its attention call and run in tiles
        where the layer qualifies (tiled_backward.split_forward; the same check as its
        backward's), else its own forward over the whole sequence (as also where one tile
        would hold the whole sequence: the split would only run the parts before attention
        twice). The check comes first either way: its verdict is agreed between the ranks."""
        extras = {k: self.kwargs[k] for k in self.grad_inputs}
        split = _splits(self, x, extras, self.parameters())
        with torch.no_grad():
            if split is None or x.size(1) <= self.tile:
                return self.call(x)
            try:
                return tiled_backward.split_forward(split, x, extras, self.tile)
            except tiled_backward.Unfit as e:  # after the check passed: a defect
                raise RuntimeError(f"max-length mode: the tiled forward of "
                                   f"{type(self.layer).__name__} failed after its check: "
                                   f"{e}") from None

    def forward_recorded(self, x: Tensor) -> tuple[Tensor, list]:
        rec: list = []
        with recording(rec):
            y = self.compute(x)
        return y, rec

    def regenerate(self, x: Tensor, keep: bool = False) -> Tensor:
        """The forward again, from another layer's backward (the nested recompute), weights
        gathered; ``keep``: this layer's backward comes next, so its attention results are
        kept for it."""
        with self.gathered():
            y, rec = self.forward_recorded(x)
        if keep:
            self.replay = rec
        return y


class GenericLayer(torch.autograd.Function):
    """(run, x (B, S, H), *run.extra_inputs(), *layer parameters) -> the layer's output
    (B, S, H), followed, where the layer wrote K/V into the mapping the layers share, by
    those tensors (run.finish puts them back there)."""

    @staticmethod
    def forward(ctx, run: GenericRun, x: Tensor, *inputs: Tensor):
        if run.keep_attention:
            y, rec = run.forward_recorded(x)
            ctx.layout = [len(result) for result in rec]
            kept = [x, *(t for result in rec for t in result)]
        else:
            y = run.compute(x)
            kept = [x]
        ctx.run = run
        recipe = None if run.keep_attention else run.input_recipe
        ctx.handle = run.storage.pack(kept, run.index, run.regenerate, recipe=recipe)
        written = run.shared.outputs() if run.shared is not None else []
        if not written:
            return y
        # K/V no later layer reads get no gradient (None), and no backward through them
        ctx.set_materialize_grads(False)
        seen: set[int] = set()
        outs = []
        for t in written:  # one tensor written twice: two outputs, each its own gradient
            outs.append(t.clone() if id(t) in seen else t)
            seen.add(id(t))
        return (y, *outs)

    @staticmethod
    def backward(ctx, dy: Tensor | None, *dwritten: Tensor | None):
        run = ctx.run
        kept = run.storage.unpack(ctx.handle)
        ctx.handle = None
        x, recorded = kept[0], None
        if len(kept) > 1:  # the attention results were kept
            flat = iter(kept[1:])
            recorded = [tuple(next(flat) for _ in range(n)) for n in ctx.layout]
        elif run.replay is not None:  # regenerated just before, with its attention
            recorded, run.replay = run.replay, None
        del kept
        params = run.parameters()
        xg = x.detach().requires_grad_(ctx.needs_input_grad[1])
        extras = {k: v.detach().requires_grad_(ctx.needs_input_grad[2 + i])
                  for i, (k, v) in enumerate(zip(run.grad_inputs, run.extra_inputs()))}
        if run.shared is None and dy is not None:
            got = _tiled_grads(run, xg, extras, params, dy, recorded)
            if got is not None:
                return (None, *got)
        override: dict = dict(extras)
        shared: list[Tensor] = []
        if run.shared is not None:
            # the K/V earlier layers stored, as differentiable copies, in a private mapping:
            # the layer's recompute reads them there (and writes its own there)
            start = 2 + len(extras)
            shared = [t.detach().requires_grad_(ctx.needs_input_grad[start + i])
                      for i, t in enumerate(run.shared.inputs())]
            override[run.store] = run.shared.private(shared)
        with torch.enable_grad(), (replaying(recorded) if recorded is not None
                                   else contextlib.nullcontext()):
            y = run.call(xg, **override)
        outs, grads = [], []
        if dy is not None:
            outs, grads = [y], [dy]
        if dwritten:  # the gradient of the K/V it wrote, summed over the layers that read them
            for t, g in zip(run.shared.outputs(override[run.store]), dwritten):
                if g is not None:
                    outs.append(t)
                    grads.append(g)
        inputs = [xg, *extras.values(), *shared, *params]
        live = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        if not live or not any(t.requires_grad for t in inputs):
            return (None, *([None] * len(inputs)))
        got = _grad([o for o, _ in live], inputs, [g for _, g in live])
        return (None, *got)


def _splits(run: GenericRun, x: Tensor, extras: dict, params: list) -> Callable | None:
    """``call(xs, rows, **override)``, the layer's forward on the tokens ``rows``, where the
    layer runs split at its attention call, in tiles (easy_context.memory.tiled_backward:
    checked once per layer structure), else None. A layer with a recurrent mixer never does:
    its mixer carries a state along the sequence (and exchanges it between ranks); nor does
    one without attention (nothing to split at: it is not checked at all), nor one handed
    the K/V mapping the layers share (Gemma 4)."""
    if run.shared is not None or state_carrying_layers(run.layer) or not any(
            hasattr(m, "is_causal") for m in run.layer.modules()):
        return None
    length = x.size(1)

    def call(xs: Tensor, rows: slice, **override) -> Tensor:
        return run.call(xs, rows=rows, length=length, **override)

    key = (tiled_backward.structure(run.layer, run.kwargs), run.tables is not None,
           tuple(extras))
    if tiled_backward.qualifies(key, call, x, extras, params,
                               type(run.layer).__name__) is not None:
        return None
    return call


def _tiled_grads(run: GenericRun, x: Tensor, extras: dict, params: list, dy: Tensor,
                 recorded: list | None) -> list | None:
    """The layer's gradients by the tiled backward (easy_context.memory.tiled_backward), or
    None where the layer does not qualify (:func:`_splits`: it then runs its backward over
    the whole sequence)."""
    call = _splits(run, x, extras, params)
    if call is None:
        return None
    record = [] if recorded is None else recorded
    pair = tiled_backward.chunked(record, replay=recorded is not None)
    try:
        grads, _ = tiled_backward.split_grads(call, x, extras, params, dy, run.tile, *pair)
    except tiled_backward.Unfit as e:  # after the check passed: a defect, never a fallback
        raise RuntimeError(f"max-length mode: the tiled backward of "
                           f"{type(run.layer).__name__} failed after its check: {e}") from None
    return grads
