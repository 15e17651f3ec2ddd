"""Max-length mode: every decoder layer tiled and head-chunked, the final norm folded into the loss.

    apply_max_length(model, mlp_tile=4096, heads_per_chunk=4, checkpointing="offload")

replaces each decoder layer's forward with :class:`~easy_context.memory.fused_layer.FusedLayer`
or :class:`~easy_context.memory.generic_layer.GenericLayer` (its MLP and norms over sequence tiles of ``mlp_tile`` tokens, its attention ``heads_per_chunk``
query heads at a time, its own recompute) and lets ``causal_lm_loss`` apply the final norm chunk by
chunk inside the chunked loss (easy_context.memory.tiled_loss), so no whole-sequence
intermediate of a layer, and no float32 copy of the hidden states, ever exists. The layers
keep, between forward and backward:

    checkpointing  kept per layer                         where
    full           its input                              device
    offload        its input                              host, prefetched one layer ahead
    attention      its input, each head group's attention output and lse   device
    none           as attention (the fused layer always recomputes its MLP)

``keep_every = k > 1`` adds a nested recompute: only every k-th layer input is kept, the
others are regenerated in backward (easy_context.memory.offload). The first layer's input,
when it is the embedding lookup, and the decoder's RoPE tables are not kept at all: backward
computes them again (easy_context.memory.recomputed).

Which path each layer takes (:func:`path_for`; :func:`layer_paths` for a model's layers):
the fused layer for pre-norm decoder layers, found by their structure, not by model name:
the children ``input_layernorm``, ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj`` linear layers, optional per-head ``q_norm``/``k_norm``),
``post_attention_layernorm`` and ``mlp``, and nothing else (Llama, Mistral, Qwen2 and Qwen3,
Gemma, Granite, SmolLM3...), with no setting the fused layer does not reproduce
(easy_context.memory.layer_check: every number attribute of the layer and its attention,
and the config entries read inside a layer), and whose own forward, run on a few random
tokens, gives what the fused layer gives (probe_mismatch: what no attribute shows). Any
other layer (post-norm layers such as OLMo-2's, Cohere's parallel block, fused qkv
projections, norms over all heads, OLMo's clip_qkv, sandwich norms, MoE blocks, LoRA
adapters on the projections) takes the generic path (easy_context.memory.generic_layer:
the layer's own forward, its MLP module (or inline fc1 -> activation -> fc2, or the MLP of
a transformer block it calls: Zamba2's) in checkpointed sequence tiles, its attention
function a chunk of heads at a time, its input kept as the fused layer's), unless that
refuses it too (dropout, router logits for an auxiliary loss, expert capacities, an MLP
that is not per token): then a ValueError says what does not fit. A hybrid's layer holding
a recurrent mixer (a state carried along the sequence) always takes the generic path, the
mixer run whole (routed to easy_context.recurrent's sequence-parallel kernels as without
max-length mode) and its MLP tiled.
Generation with a KV cache runs the layers unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
from typing import Callable

import torch
from torch import nn

from . import fused_layer, generic_layer, recomputed
from ..utils.decoder import decoder_of
from .fused_layer import FusedLayer, LayerSpec, Run, head_chunks
from .generic_layer import GenericLayer, GenericRun
from .head_transform import head_transform, vocab_scaled_head
from .layer_check import fused_layer_mismatch, state_carrying_layers
from .offload import DeviceStorage, LayerStorage

KINDS = ("none", "full", "offload", "attention")
_STATE = "_easy_context_max_length"
_CACHE_KEYS = ("cache", "past_key_values", "past_key_value", "layer_past", "use_cache",
               "cache_position", "output_attentions")
_SKIP_FINAL_NORM: contextvars.ContextVar = contextvars.ContextVar("ec_skip_final_norm",
                                                                  default=False)


def _text_config(model: nn.Module):
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers in the order the model runs them (:func:`layer_list`)."""
    return list(layer_list(model))


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of layers: its ``layers``, or else its one ``nn.ModuleList`` (not
    inside another: GPT-2's ``h``, DBRX's ``blocks``, BERT's ``encoder.layer``) of as many
    modules as the config has layers. Where there is none, its lists of transformers decoder
    layers (``GradientCheckpointingLayer``s, all of one class), one after the other: HRM's two
    stacks, each layer run several times per forward (its config counts the calls), where
    every call keeps its own input (_State.enter refuses what would not). Two lists of as many
    layers as the config has, or no list of layers: a ValueError."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    want = getattr(_text_config(model), "num_hidden_layers", None)
    lists, stack = [], list(decoder.named_children())
    while stack:
        name, module = stack.pop(0)
        if isinstance(module, nn.ModuleList):
            lists.append((name, module))
            continue  # a layer's own lists (experts) are not the decoder's
        stack += [(f"{name}.{n}", m) for n, m in module.named_children()]
    found = [m for _, m in lists if len(m) and (want is None or len(m) == want)]
    if not found:
        from transformers.modeling_layers import GradientCheckpointingLayer

        stacks = [m for _, m in lists if len(m) and all(
            isinstance(layer, GradientCheckpointingLayer) for layer in m)]
        if stacks and len({type(layer) for m in stacks for layer in m}) == 1:
            return nn.ModuleList([layer for m in stacks for layer in m])  # not registered
    if len(found) != 1:
        seen = ", ".join(f"{n} ({len(m)})" for n, m in lists) or "none"
        raise ValueError(f"max-length mode: cannot tell {type(decoder).__name__}'s list of "
                         f"decoder layers: one list of its {want} layers, or lists of decoder "
                         f"layers of one class, is needed (its lists: {seen}); train this "
                         "model without "
                         "--mlp-tile/--head-chunk")
    return found[0]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        ("Norm", "LayerNorm", "RMSNorm"))


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's final norm, which max-length mode applies inside the loss, chunk by
    chunk: its ``norm``, or else its one norm child (GPT-2's ``ln_f``, OPT's
    ``final_layer_norm``, LFM2's ``embedding_norm``...) where every other child with
    parameters is an embedding or holds the layer list (nothing with weights of its own,
    such as OPT's ``project_out``, may act between that norm and the head). None: nothing is
    folded, the decoder applies whatever it applies after its layers itself (its norm
    included) and the loss takes its output. Whether the folded norm really is the last thing
    the decoder does is checked on every forward (max_length_loss)."""
    decoder = decoder_of(model)
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, nn.Module):
        return norm
    layers = {id(layer) for layer in layer_list(model)}
    norms, others = [], []
    for name, child in decoder.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if any(id(m) in layers for m in child.modules()) or any(
                isinstance(m, nn.Embedding) for m in child.modules()):
            continue  # the layers, or what feeds them (embeddings, their norms)
        (norms if _is_norm(child) else others).append(child)
    return norms[0] if len(norms) == 1 and not others else None


def layer_spec(layer: nn.Module, config) -> LayerSpec:
    """The parts of a pre-norm decoder layer, or a ValueError naming what does not fit."""
    reason = fused_layer_mismatch(layer, config)
    if reason:
        raise ValueError(reason)
    attn = layer.self_attn
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = attn.head_dim
    if attn.q_proj.out_features != heads * head_dim or attn.o_proj.in_features != heads * head_dim \
            or attn.k_proj.out_features != kv_heads * head_dim \
            or attn.v_proj.out_features != kv_heads * head_dim:
        raise ValueError(f"{type(attn).__name__}: q/k/v/o_proj widths do not match {heads} / "
                         f"{kv_heads} heads of {head_dim}")
    for n in ("q_norm", "k_norm"):
        norm = getattr(attn, n, None)
        width = getattr(norm, "weight", None)
        if norm is not None and (width is None or width.numel() != head_dim):
            raise ValueError(f"{type(attn).__name__}.{n} normalises across heads (width "
                             f"{None if width is None else width.numel()}, head_dim {head_dim}): "
                             "attention cannot be computed a group of heads at a time")
    module = sys.modules[type(attn).__module__]
    rope = getattr(attn, "rotary_fn", None) or getattr(module, "apply_rotary_pos_emb", None)
    if rope is None:
        raise ValueError(f"{type(attn).__name__}: no apply_rotary_pos_emb in {module.__name__}")
    eager = getattr(module, "eager_attention_forward", None)

    def attention():
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)

    return LayerSpec(layer.input_layernorm, attn, layer.post_attention_layernorm, layer.mlp,
                     rope, attention, heads, kv_heads, head_dim,
                     float(getattr(layer, "residual_multiplier", 1.0)),
                     bool(getattr(attn, "use_rope", True)))


PROBE_TOKENS = 8  # tokens of the numerical check of each layer (probe_mismatch)


def probe_mismatch(model: nn.Module, layer: nn.Module, spec: LayerSpec) -> str | None:
    """Run ``layer``'s own forward and the fused computation on a few random tokens (eager
    attention, no grad, eval mode) and say how far apart they are, when they differ: a check
    of what no attribute shows. Skipped (None) where it cannot run without a collective or a
    gather: weights on the meta device, ZeRO-3 or DTensor shards, RoPE that is not static."""
    params = list(layer.parameters())
    if not params or any(p.is_meta or hasattr(p, "ds_id") or type(p.data) is not torch.Tensor
                         or not p.is_floating_point() for p in params):
        return None
    rotary = getattr(decoder_of(model), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in recomputed.STATIC_ROPE_TYPES:
        return None
    p = params[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, spec.attn.q_proj.in_features,  # (1, 8, hidden)
                    generator=gen).to(p.device, p.dtype)
    pos = torch.arange(PROBE_TOKENS, device=p.device)[None]
    config = spec.attn.config
    implementation, training = config._attn_implementation, layer.training
    forward = getattr(layer, "_ec_original_forward", layer.forward)
    try:
        config._attn_implementation = "eager"  # the family's own, on both sides
        layer.train(False)
        with torch.no_grad():
            cos, sin = rotary(x, pos)
            want = forward(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
            want = want[0] if isinstance(want, tuple) else want
            got = fused_layer.Run(spec, PROBE_TOKENS, spec.heads, False, DeviceStorage(),
                                  attn_kwargs={"position_ids": pos}).forward(x, cos, sin)
    finally:
        config._attn_implementation = implementation
        layer.train(training)
    # relative to the layer's branches (its output less its input)
    err = float((got.float() - want.float()).abs().max() /
                (want.float() - x.float()).abs().max().clamp(min=1e-12))
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 5e-2
    if err <= tol:
        return None
    return (f"max-length mode: {type(layer).__name__}'s own forward and the fused layer differ "
            f"by {err:.1e} (relative, {PROBE_TOKENS} random tokens): it computes something the "
            "fused layer does not reproduce; train this model without --mlp-tile/--head-chunk")


def recurrent_reason(model: nn.Module) -> str | None:
    """Why the fused layer cannot run ``model`` (a decoder layer, or a whole model): its
    layers that carry state along the sequence (layer_check.state_carrying_layers), or None.
    The generic path runs such layers (path_for), their recurrent mixer whole."""
    found = state_carrying_layers(model)
    if not found:
        return None
    return (f"{type(model).__name__} has layers that carry state along the sequence "
            f"({', '.join(found)}), which max-length mode's fused layer does not run; let "
            "them take the generic path (path 'auto' or 'generic')")


PATHS = ("auto", "fused", "generic")


def path_for(layer: nn.Module, model: nn.Module | None = None, path: str = "auto") -> str:
    """How max-length mode runs ``layer``: "fused" (easy_context.memory.fused_layer: the
    Llama-shaped layer re-implemented, where it verifies), "generic" (easy_context.memory.
    generic_layer: the layer's own forward, its MLP tiled and its attention head-chunked),
    or, when neither fits, the one-line reason (a string that is neither). ``model`` (the
    whole model) lets the fused path's numerical probe run; ``path`` forces one of the two."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    config = _text_config(model) if model is not None else _layer_config(layer)
    # a hybrid's recurrent mixer is neither attention nor per token: the generic path runs it
    # whole (the layer's own forward), never the fused layer
    recurrent = recurrent_reason(layer)
    if recurrent:
        if path == "fused":
            return recurrent
        path = "generic"
    if getattr(config, "output_router_logits", False):
        # on both paths the MoE block runs once per sequence tile, and in forward without
        # grad: the router logits recorded for the auxiliary loss would carry no gradient
        return generic_layer.static_mismatch(layer, config)
    fused_reason = None
    if path in ("auto", "fused"):
        try:
            spec = layer_spec(layer, config)
            fused_reason = probe_mismatch(model, layer, spec) if model is not None else None
        except (ValueError, AttributeError) as e:
            fused_reason = str(e)
        if fused_reason is None:
            return "fused"
        if path == "fused":
            return fused_reason
    reason = generic_layer.static_mismatch(layer, config)
    return reason or generic_layer.mlp_mismatch(layer, index=_index(model, layer)) or "generic"


def _index(model: nn.Module | None, layer: nn.Module) -> int | None:
    """The layer's index in the decoder (which the decoder hands it: an MLP may take it)."""
    try:
        layers = decoder_layers(model) if model is not None else []
    except (ValueError, AttributeError):
        return None
    return next((i for i, other in enumerate(layers) if other is layer), None)


def _layer_config(layer: nn.Module):
    for m in layer.modules():
        c = getattr(m, "config", None)
        if c is not None:
            return c.get_text_config() if hasattr(c, "get_text_config") else c
    return None


def layer_paths(model: nn.Module, path: str = "auto") -> list[str]:
    """Each decoder layer's path ("fused" or "generic", as :func:`path_for` picks it); a
    ValueError with the first refusal."""
    paths = [path_for(layer, model, path) for layer in decoder_layers(model)]
    for p in paths:
        if p not in ("fused", "generic"):
            raise ValueError(p)
    return paths


def unsupported_reason(model: nn.Module) -> str | None:
    """Why max-length mode cannot run this model's layers (fused or generic), or None."""
    try:
        layer_paths(model)
    except (ValueError, AttributeError) as e:
        return str(e)
    return None


class _State:
    """What every patched layer of one model shares: its settings, the layer storage and the
    watchers of the embedding and RoPE modules (easy_context.memory.recomputed)."""

    def __init__(self, mlp_tile: int, heads_per_chunk: int, checkpointing: str,
                 keep_every: int, layers: int):
        self.mlp_tile, self.heads_per_chunk = mlp_tile, heads_per_chunk
        self.checkpointing, self.keep_every = checkpointing, keep_every
        self.keep_attention = checkpointing in ("attention", "none")
        offload = checkpointing == "offload"
        self.storage = (LayerStorage(layers, offload=offload, keep_every=keep_every)
                        if offload or keep_every > 1 else DeviceStorage())
        self.embedding = self.rotary = None  # recomputed.Recorded watchers
        self.paths: list[str] = []  # each layer's path: "fused" or "generic"
        self.layers = layers
        self.last_output = None  # the last layer's output in this forward, until normed
        self.final_norm = None  # the norm the loss applies (final_norm), or None
        self.folded = None  # what that norm passed on un-normed in this forward (the loss's)
        # (projection, per-token transform | None) of a BERT-style head or of a head with a
        # factor per vocabulary entry (memory.head_transform)
        self.head: tuple | None = None
        self.vocab_scale = None  # that factor (head_transform.VocabScale), or None
        self.previous = None  # (index, output) of the layer that ran last in this forward

    def start(self) -> None:
        """A decoder forward begins (a forward pre-hook on the decoder, _watch_decoder)."""
        self.last_output = self.folded = self.previous = None

    def enter(self, index: int, x: torch.Tensor, layer: nn.Module) -> None:
        """Refuse a layer call that the layer storage would get wrong. LayerStorage
        (offload, keep_every > 1) keeps one input per layer index, and the nested recompute
        (keep_every > 1) regenerates a layer's input by running the layer before it: each
        layer must run once per decoder forward, in order, and (keep_every > 1) on the
        previous layer's output as it is. Decoders that run layers more than once (Dory's
        recurrent section) or change the hidden states between layers (Dory's norms between
        its sections) train with the input of every call kept (DeviceStorage)."""
        if not isinstance(self.storage, LayerStorage):
            return
        what = (f"max-length mode: layer {index} ({type(layer).__name__}) runs after "
                f"{'no layer' if self.previous is None else f'layer {self.previous[0]}'} in "
                "one forward")
        if index != (0 if self.previous is None else self.previous[0] + 1):
            raise ValueError(f"{what}: the decoder runs layers more than once or out of order, "
                             "and --checkpointing offload and --keep-every keep one input per "
                             "layer; use --checkpointing full or attention with --keep-every 1")
        if self.keep_every > 1 and index and not _same(x, self.previous[1]):
            raise ValueError(f"{what}, on another input than that layer's output (the decoder "
                             "changes it between them): the nested recompute would regenerate "
                             "it without that change; use --keep-every 1")

    def output(self, index: int, y: torch.Tensor) -> torch.Tensor:
        """Note the last layer's output (the one input of the final norm that the loss
        applies instead, _fold_final_norm), and this layer as the one that ran last."""
        self.previous = (index, y)
        if index == self.layers - 1:
            self.last_output = y
        return y

    def input_recipe(self, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """How to compute the first layer's input again, when it is the embedding lookup."""
        return None if self.embedding is None else self.embedding.recipe(x)

    def rope_recipe(self, cos: torch.Tensor, sin: torch.Tensor) -> Callable[[], tuple] | None:
        """How to compute the RoPE tables again, when they are the decoder's."""
        return None if self.rotary is None else self.rotary.recipe(cos, sin)


def _fused_forward(self, hidden_states, *args, attention_mask=None, position_ids=None,
                   position_embeddings=None, **kwargs):
    state, spec, index = self._ec_max_length
    if args or position_embeddings is None or any(
            kwargs.get(k) is not None and kwargs.get(k) is not False for k in _CACHE_KEYS):
        # generation with a cache, or a call we do not recognise: the layer as it was
        return self._ec_original_forward(hidden_states, *args, attention_mask=attention_mask,
                                         position_ids=position_ids,
                                         position_embeddings=position_embeddings, **kwargs)
    state.enter(index, hidden_states, self)
    attn_kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_KEYS}
    attn_kwargs["position_ids"] = position_ids
    cos, sin = position_embeddings
    run = Run(spec, state.mlp_tile, state.heads_per_chunk, state.keep_attention, state.storage,
              index, attn_kwargs, attention_mask, lambda: _gathered(self),
              state.input_recipe(hidden_states) if index == 0 else None,
              state.rope_recipe(cos, sin))
    if not torch.is_grad_enabled():
        return state.output(index, run.forward(hidden_states, cos, sin))
    return state.output(index, FusedLayer.apply(run, hidden_states, cos, sin, *spec.parameters()))


def _by_name(forward: Callable, hidden_states, args: tuple, kwargs: dict) -> dict | None:
    """The positional arguments after the hidden states by their names in ``forward``'s
    signature (Gemma 4 hands its per_layer_input positionally), or None if they do not bind."""
    import inspect

    try:
        signature = inspect.signature(forward)
        bound = signature.bind(hidden_states, *args, **kwargs)
    except (TypeError, ValueError):
        return None
    params = signature.parameters
    named: dict = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif i:  # the first is the hidden states
            named[name] = value
    return named


def _generic_forward(self, hidden_states, *args, **kwargs):
    state, _, index = self._ec_max_length
    if args:
        named = _by_name(self._ec_original_forward, hidden_states, args, kwargs)
        if named is None:  # a call we do not recognise: the layer as it was
            return self._ec_original_forward(hidden_states, *args, **kwargs)
        kwargs = named
    if any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in _CACHE_KEYS):
        # generation with a cache: the layer as it was
        return self._ec_original_forward(hidden_states, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_KEYS}
    state.enter(index, hidden_states, self)
    # tensors that require grad (Gemma 4's per_layer_input) go in as inputs of the recompute
    grads = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad)
    tables = None
    pe = kwargs.get("position_embeddings")
    if isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe):
        tables = state.rope_recipe(*pe)
        if tables is not None:
            del kwargs["position_embeddings"]  # computed again where backward needs them
    snapshot = self.__dict__.get(generic_layer.CALL_STATE)  # e.g. Jamba's recorded documents
    # the mapping every layer is handed (Gemma's shared_kv_states): its K/V go in and out of
    # the layer's autograd function (generic_layer.SharedStore)
    store = generic_layer.shared_store_name(kwargs)
    shared = generic_layer.kv_sharing(self)
    if shared and store is None:
        raise ValueError(f"max-length mode: {type(self).__name__}.{shared[0]} reuses another "
                         "layer's keys and values but the layer is handed no mapping holding "
                         "them (shared_kv_states); train this model without "
                         "--mlp-tile/--head-chunk")
    run = GenericRun(self, self._ec_original_forward, kwargs, state.mlp_tile,
                     state.heads_per_chunk, state.keep_attention, state.storage, index,
                     lambda: _gathered(self),
                     state.input_recipe(hidden_states) if index == 0 else None, tables,
                     restore=snapshot(self) if snapshot is not None else None,
                     grad_inputs=grads, store=store)
    if not torch.is_grad_enabled():
        return run.output(state.output(index, run.call(hidden_states)))
    y = run.finish(GenericLayer.apply(run, hidden_states, *run.extra_inputs(),
                                      *run.parameters()))
    return run.output(state.output(index, y))


@contextlib.contextmanager
def _gathered(layer: nn.Module):
    """The layer's whole weights outside its own forward/backward (a collective: every rank
    regenerates the same layers in the same order): FSDP2's unshard/reshard, ZeRO-3's
    GatheredParameters, nothing for unsharded models."""
    if hasattr(layer, "unshard") and hasattr(layer, "reshard"):  # an FSDP2 FSDPModule
        layer.unshard()
        try:
            yield
        finally:
            layer.reshard()
    elif any(hasattr(p, "ds_id") for p in layer.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(layer.parameters())):
            yield
    else:
        yield


def _check_chunks(model: nn.Module, layer: nn.Module, heads: int, kv_heads: int,
                  heads_per_chunk: int) -> None:
    """Every head chunk must suit the sequence-parallel method the model was switched to."""
    from ..mesh import group_size
    from ..parallel import get_method
    from ..parallel.settings import module_settings

    chunks = head_chunks(heads, kv_heads, heads_per_chunk)  # raises if it splits badly
    settings = next((s for s in map(module_settings, layer.modules()) if s is not None), None)
    if settings is None:
        return
    world = group_size(settings.group)
    if world == 1:
        return
    for hq, hkv in sorted({(q.stop - q.start, k.stop - k.start) for q, k in chunks}):
        try:
            get_method(settings.method).check(hq, hkv, world, settings.ring_degree)
        except ValueError as e:
            raise ValueError(f"head chunks of {hq} query heads ({hkv} KV heads) do not suit "
                             f"{settings.method} over {world} ranks: {e}. Choose another "
                             "--head-chunk (query heads per chunk)") from None


def _heads(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def apply_max_length(model: nn.Module, mlp_tile: int, heads_per_chunk: int,
                     checkpointing: str = "full", keep_every: int = 1,
                     path: str = "auto") -> nn.Module:
    """Tile and head-chunk every decoder layer of ``model`` (see the module docstring), each
    on its path (:func:`path_for`: the fused layer where it verifies, else the generic one;
    ``path`` forces one). Call after :func:`easy_context.apply_sequence_parallel` (the head
    groups are checked against its method) and before sharding the model (FSDP, ZeRO-3)."""
    if checkpointing not in KINDS:
        raise ValueError(f"checkpointing must be one of {KINDS}, got {checkpointing!r}")
    if mlp_tile < 1 or heads_per_chunk < 1 or keep_every < 1:
        raise ValueError(f"mlp_tile ({mlp_tile}), heads_per_chunk ({heads_per_chunk}) "
                         f"and keep_every ({keep_every}) must be >= 1")
    config = _text_config(model)
    layers = decoder_layers(model)
    paths = layer_paths(model, path)
    specs = [layer_spec(layer, config) if p == "fused" else None
             for layer, p in zip(layers, paths)]
    heads, kv_heads = (specs[0].heads, specs[0].kv_heads) if specs[0] else _heads(config)
    heads_per_chunk = min(heads_per_chunk, heads)
    _stop_kernelizing(model)
    _check_chunks(model, layers[0], heads, kv_heads, heads_per_chunk)
    state = _State(mlp_tile, heads_per_chunk, checkpointing, keep_every, len(layers))
    for index, (layer, spec) in enumerate(zip(layers, specs)):
        if not hasattr(layer, "_ec_original_forward"):
            layer._ec_original_forward = layer.forward
        layer._ec_max_length = (state, spec, index)
        layer.forward = types.MethodType(_fused_forward if spec else _generic_forward, layer)
        _mark_zero3_leaf(layer)
        if not hasattr(layer, "_ec_input_hook"):
            layer._ec_input_hook = layer.register_forward_pre_hook(_input_takes_grad,
                                                                   with_kwargs=True)
    state.paths = paths
    _watch_decoder(model, state)
    _fold_final_norm(model, state)
    state.head = _transform_head(model, state)
    _tile_rotary(model)
    state.embedding = recomputed.watch(
        model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None,
        _gathered)
    rotary = getattr(decoder_of(model), "rotary_emb", None)
    if getattr(rotary, "rope_type", None) in recomputed.STATIC_ROPE_TYPES:
        state.rotary = recomputed.watch(rotary, _gathered, stub_first=True)
    setattr(model, _STATE, state)
    return model


def _transform_head(model: nn.Module, state: "_State") -> tuple | None:
    """(projection, per-token transform | None) where the logits are not a plain linear
    layer of the decoder's output but a BERT-style head (memory.head_transform), or a head
    that scales each vocabulary entry's logit (its VocabScale, in state.vocab_scale); None
    otherwise."""
    head, transform = head_transform(model)
    if head is not None:
        return head, transform
    head, scale = vocab_scaled_head(model)
    if head is None:
        return None
    state.vocab_scale = scale
    return head, None


def max_length_head(model: nn.Module) -> tuple:
    """(projection, per-token transform | None) of the model's BERT-style head, or of a head
    with a factor per vocabulary entry, in max-length mode, which the chunked loss applies
    chunk by chunk; (None, None) otherwise."""
    state = max_length_settings(model)
    return (None, None) if state is None or state.head is None else state.head


def _stop_kernelizing(model: nn.Module) -> None:
    """Turn off transformers' hub kernels (``use_kernels``, on by default from transformers
    5.25) before the final norm and the RoPE tables are patched below. A kernelized model is
    kernelized again by every ``model.train()`` / ``model.eval()`` (a new kernels Mode), and
    that pops the instance ``forward`` of each kernel layer (RMSNorm, rotary embedding): the
    final norm would then run in the decoder and again in the loss's chunks (the Trainer's
    ``train()`` did exactly that: a loss 4e-6 off). The fused layers call the norms and
    projections themselves, so the kernels' speed-up mostly does not apply here anyway."""
    for module in model.modules():
        if getattr(module, "use_kernels", False) and hasattr(module, "set_use_kernels"):
            module.set_use_kernels(False)  # back to torch's forwards, and no re-kernelizing


def _mark_zero3_leaf(layer: nn.Module) -> None:
    # ZeRO-3 gathers a module's parameters when *that module's* forward runs; the fused layer
    # uses its submodules' weights directly, so the whole layer must be gathered at once: a
    # "leaf module" (what deepspeed.utils.set_z3_leaf_module sets, without importing DeepSpeed).
    layer._z3_leaf = True


def _input_takes_grad(layer: nn.Module, args: tuple, kwargs: dict):
    """Under ZeRO-3, a layer input that requires grad (a forward pre-hook of the layer).

    ZeRO-3 reduces a leaf module's parameter gradients (and zero-fills those still None) in
    the module's full backward hook, which fires when the gradients of the module's inputs
    are computed, after its backward. When no input requires grad (the first layer, whose
    input is the embedding of frozen weights: LoRA), torch fires that hook on the gradient
    of its *output*, before the layer's backward: DeepSpeed then gave each adapter a zero
    gradient of its partition's size (0 elements on this rank, the weights not yet gathered
    for backward) and the layer's gradient (32 wide) could not be added to it ("The size of
    tensor a (0) must match the size of tensor b (32)" in AccumulateGrad). A detached copy
    of the input that requires grad puts the hook after the layer's backward, as for every
    other layer; its gradient (one layer input's) is dropped. Runs before DeepSpeed's own
    pre-hooks (registered later, at initialize), so they see it too."""
    if not torch.is_grad_enabled():
        return None
    params = list(layer.parameters())
    if not any(hasattr(p, "ds_id") for p in params) or not any(p.requires_grad for p in params):
        return None
    if args and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
        return (args[0].detach().requires_grad_(True), *args[1:]), kwargs
    x = kwargs.get("hidden_states")
    if not args and isinstance(x, torch.Tensor) and not x.requires_grad:
        return args, {**kwargs, "hidden_states": x.detach().requires_grad_(True)}
    return None


def _same(a, b) -> bool:
    """The same tensor, or a view of all of it (FSDP2's and DeepSpeed's hooks hand a layer's
    output on as a new tensor object over the same memory)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
        a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                   and a.stride() == b.stride()))


def _watch_decoder(model: nn.Module, state: _State) -> None:
    """Every decoder forward starts afresh (_State.start), whatever its layers do."""
    decoder = decoder_of(model)
    old = decoder.__dict__.get("_ec_start_hook")
    if old is not None:
        old.remove()  # an earlier apply_max_length's state
    decoder._ec_start_hook = decoder.register_forward_pre_hook(lambda *_: state.start())


def _fold_final_norm(model: nn.Module, state: _State) -> None:
    norm = state.final_norm = final_norm(model)
    if norm is None:  # the decoder applies its own, and the loss takes its output
        return
    norm._ec_state = state  # the latest apply_max_length's
    if hasattr(norm, "_ec_original_forward"):
        return
    norm._ec_original_forward = norm.forward

    def forward(self, hidden_states):
        # Inside max_length_loss the loss applies this norm chunk by chunk to the last
        # layer's output, when that is what it gets. Any other input is normed here, as the
        # decoder does without max-length mode: what the decoder hands it before the layers
        # (NanoChat norms its embeddings with it too), or what the decoder makes of the last
        # layer's output first (Gemma 3n combines its AltUp streams, a per-token transform
        # with weights of its own): the fold is off for that forward and the loss takes the
        # decoder's output, normed, as where there is no final norm to fold.
        state = self._ec_state
        if not _SKIP_FINAL_NORM.get() or state.last_output is None:
            if _same(hidden_states, state.last_output):
                state.last_output = None  # not kept past its forward
            return self._ec_original_forward(hidden_states)
        if not _same(hidden_states, state.last_output):
            state.last_output = None  # the decoder transformed it: nothing is folded
            return self._ec_original_forward(hidden_states)
        if state.folded is not None:
            # the decoder went on from an earlier output of its last layer, un-normed here
            raise ValueError("max-length mode: the decoder runs its last layer and its final "
                             "norm more than once in one forward (its layers run again after "
                             "the norm); train this model without --mlp-tile/--head-chunk")
        state.last_output = None
        state.folded = hidden_states  # max_length_loss checks the decoder returns it as is
        return hidden_states

    norm.forward = types.MethodType(forward, norm)


ROPE_TILE = 16384  # positions per piece of the RoPE tables (their float32 intermediates)


def _tile_rotary(model: nn.Module) -> None:
    """Build the RoPE cos/sin tables piece by piece: transformers computes them in float32 for
    the whole sequence (four float32 (S, head_dim) intermediates) before casting them to the
    model's dtype. Rope types that rescale with the sequence length (dynamic, longrope) look at
    all positions at once and keep the one-piece computation."""
    rotary = getattr(decoder_of(model), "rotary_emb", None)
    if rotary is None or hasattr(rotary, "_ec_original_forward") or \
            getattr(rotary, "rope_type", None) not in recomputed.STATIC_ROPE_TYPES:
        return
    rotary._ec_original_forward = rotary.forward

    def forward(self, x, position_ids, **kw):
        if position_ids.size(-1) <= ROPE_TILE:
            return self._ec_original_forward(x, position_ids, **kw)
        pieces = [self._ec_original_forward(x, position_ids[..., i:i + ROPE_TILE], **kw)
                  for i in range(0, position_ids.size(-1), ROPE_TILE)]
        return tuple(torch.cat(parts, dim=-2) for parts in zip(*pieces))

    rotary.forward = types.MethodType(forward, rotary)


def max_length_settings(model: nn.Module):
    """The model's max-length state (tile, chunk, checkpointing), or None when it is off."""
    return getattr(model, _STATE, None)


@contextlib.contextmanager
def final_norm_skipped():
    token = _SKIP_FINAL_NORM.set(True)
    try:
        yield
    finally:
        _SKIP_FINAL_NORM.reset(token)


def max_length_loss(model: nn.Module, head: nn.Linear, input_ids, position_ids, target_ids,
                    extra: dict, chunk_size: int, group=None, num_items_in_batch=None,
                    transform=None, stats=None, head_transform: nn.Module | None = None):
    """causal_lm_loss's chunked loss in max-length mode: the decoder without its final norm,
    then norm, ``head_transform`` (a BERT-style head's dense, activation and LayerNorm:
    max_length_head), head and cross-entropy chunk by chunk (easy_context.memory.tiled_loss). The
    last layer's output is read by nothing but the loss, so the loss's backward writes the
    gradient of the hidden states over them (one sequence-long tensor fewer)."""
    from ..utils.fsdp import unshard_for_direct_use
    from .tiled_loss import normed_chunked_cross_entropy

    state = max_length_settings(model)
    state.start()  # as the decoder's forward pre-hook does, should a wrapper bypass it
    with final_norm_skipped():
        hidden = decoder_of(model)(input_ids=input_ids, position_ids=position_ids,
                                     use_cache=False, **extra).last_hidden_state
    folded, state.folded = state.folded, None
    if folded is not None and not _same(hidden, folded):
        raise ValueError(f"max-length mode: {type(decoder_of(model)).__name__} changes the "
                         "output of its final norm, which the loss applies, before it returns "
                         "it; train this model without --mlp-tile/--head-chunk")
    norm = state.final_norm if folded is not None else None
    pre = _PreHead(norm, head_transform)
    for module in pre.parts:
        unshard_for_direct_use(module)  # read directly, never called
    weight, bias = head.weight, head.bias
    if state.vocab_scale is not None and state.vocab_scale.head is head:
        weight, bias = state.vocab_scale.projection()  # (V, H): W times each entry's factor
    # the last layer's output, which nothing but the loss reads, takes its own gradient; the
    # output of a norm the decoder applied itself may be saved by that norm's backward
    return normed_chunked_cross_entropy(hidden, pre, weight, target_ids,
                                        bias, chunk_size=chunk_size, group=group,
                                        num_items_in_batch=num_items_in_batch, transform=transform,
                                        overwrite_hidden=folded is not None, stats=stats)


class _PreHead(nn.Module):
    """What the chunked loss applies to each chunk of the decoder's output before the head's
    projection: the folded final norm (its own forward, not the patched one), then a
    BERT-style head's transform, or nothing."""

    def __init__(self, norm: nn.Module | None, transform: nn.Module | None = None):
        super().__init__()
        # not registered: not its children
        self.parts = [m for m in (norm, transform) if m is not None]
        self._params = [p for m in self.parts for p in m.parameters()]

    def parameters(self, recurse: bool = True):
        return iter(self._params)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for module in self.parts:
            h = getattr(module, "_ec_original_forward", module.forward)(h)
        return h


def loss_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights max-length mode's loss reads without calling them through
    the model (the folded final norm; a BERT-style head's projection and transform parts):
    what ZeRO-3 must gather with the head, as external parameters."""
    state = max_length_settings(model)
    norm = state.final_norm if state is not None else final_norm(model)
    head = state.head if state is not None else None
    extra = [head[0], *(head[1].parts if head[1] is not None else ())] if head is not None else []
    return [m for m in (norm, *extra) if m is not None]
