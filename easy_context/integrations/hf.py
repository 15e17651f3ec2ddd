"""The one place that knows transformers internals.

Importing this module registers every sequence-parallel method as a transformers attention
implementation (``AttentionInterface``); after ``import easy_context`` that happens as soon
as transformers' modeling code is imported (registration.py). So any model whose attention
layers go through that interface (Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo, ...) runs
sequence-parallel with

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="zigzag_ring_attn")

or, for a model already built, ``apply_sequence_parallel(model, method, group, ring_degree)``,
which also records the process group. Each rank then feeds its shard of input_ids with its
*global* position_ids (RoPE is exact on a shard only with those), and, for packed documents,
its shard of ``document_ids``: ``model(input_ids=..., position_ids=..., document_ids=...)``;
transformers passes extra keyword arguments through to the attention function.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface

from ..attention.variants import variant_of
from ..mesh import SPGroup, group_size, process_group, usp_groups
from ..parallel import METHODS, get_method
from ..parallel.latent import attend_gathered
from ..parallel.settings import SequenceParallelSettings, module_settings, store_settings
from ..sequence_parallel import sequence_parallel_attention
from ..utils.decoder import decoder_of, text_config
from . import whole_sequence as ws
from .hf_latent import gathered_call, route_latent_layers
from .hf_recurrent import KV_CACHE_KWARG  # noqa: F401 - generate reads it from here
from .hf_recurrent import RUNS as RECURRENT_RUNS, recurrent_layer_types, route_recurrent_layers
from .vision import IMAGE_SPANS_KWARG  # the attention function reads it; so does generate

Tensor = torch.Tensor


# KV_CACHE_KWARG (defined beside the recurrent kernels, which read it too): the keyword
# argument under which easy_context.generate hands its sharded KV cache to the model
# (transformers passes it through the layers); the attention function then lets the cache run
# the call: ``cache.attend(layer_idx, q, k, v, causal=, softmax_scale=, sliding_window=,
# chunk_size=, softcap=, sinks=)`` with (B, S, H, D) tensors.

def hf_attention_name(method: str) -> str:
    """The name under which ``method`` is registered with transformers: transformers treats
    any implementation name containing "flash" as FlashAttention and tries to load flash
    kernels for it, so such names lose the word (dist_flash_attn -> dist_attn)."""
    return get_method(method).name.replace("flash_", "")




def _unsupported(query: Tensor, key: Tensor, dropout: float,
                 keys_gathered: bool = False) -> str | None:
    """Why this attention call cannot run sequence-parallel, or None. ``keys_gathered``: the
    keys are the whole sequence's (an MLA layer's gathered latent, hf_latent.py)."""
    if query.size(2) != key.size(2) and not keys_gathered:
        return ("queries and keys differ in length (transformers' KV cache: decoding); "
                "generate with easy_context.generate, which keeps a KV cache sharded over the "
                "ranks, or in one process with attn_implementation='sdpa'")
    if dropout and dropout > 0:
        return f"attention dropout ({dropout}) is not supported; set config.attention_dropout=0"
    return None


def _needs_apply(module: nn.Module, method: str) -> str | None:
    """Why a model switched by name only (``attn_implementation=...`` at loading, no
    apply_sequence_parallel) would run silently wrong: what it derives from the call's length
    is taken from the whole sequence only by the hooks apply_sequence_parallel installs."""
    what = None
    config = getattr(module, "config", None)
    if get_method(method).layout != "whole" and config is not None and token_mixing_types(
            config_layer_types(config)):
        what = ("has layers that are not attention, which would run on each shard as if it "
                "were the whole sequence")
    elif getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        what = ("uses attn_temperature_tuning (queries scaled by position), which must come "
                "from the whole sequence")
    elif dist.is_initialized() and dist.get_world_size() > 1 and get_method(method).layout != \
            "whole" and rope_types(getattr(module, "config", None)) & RESCALING_ROPE:
        what = (f"uses {'/'.join(sorted(rope_types(module.config) & RESCALING_ROPE))} RoPE "
                "scaling, which must come from the whole sequence")
    if what is None:
        return None
    return (f"{type(module).__name__} {what}: switch the model with "
            "easy_context.apply_sequence_parallel(model, method, group)")


def layer_chunk(module: nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4: ``layer_types[i] ==
    "chunked_attention"``, ``attention_chunk_size``), None for the others. transformers hands
    it to no attention function (the mask carries it), so it is read from the config."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or []
    index = getattr(module, "layer_idx", None)
    if index is None or index >= len(types) or types[index] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def layer_image_spans(module: nn.Module, spans):
    """The image spans this attention layer applies: all of them, or none where the model
    makes images bidirectional on its sliding layers only (Gemma 4's
    ``use_bidirectional_attention == "vision"``: its full-attention layers stay causal over
    images, transformers' ``create_masks_for_vision_model``). Read from the layer's config
    and type, as the model decides it."""
    if not spans:
        return None
    config = getattr(module, "config", None)
    if getattr(config, "use_bidirectional_attention", None) != "vision":
        return spans
    types = getattr(config, "layer_types", None) or []
    index = getattr(module, "layer_idx", None)
    if index is None or index >= len(types):
        raise ValueError(f"{type(module).__name__} makes images bidirectional on its sliding "
                         "layers only, and its layer type cannot be read (layer_idx, "
                         "config.layer_types)")
    return spans if types[index] == "sliding_attention" else None


def _one_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in one dtype. Under autocast they arrive mixed: the projections give bf16,
    RoPE's fp32 cos/sin promote q and k back to fp32, v stays bf16. torch's sdpa then runs in
    autocast's dtype; so do these (flash attention's integration does the same)."""
    if query.dtype == key.dtype == value.dtype:
        return query, key, value
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _make_attention(method: str):
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs):
        # query (B, Hq, S, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv), not repeated for
        # GQA; what the layer adds comes as transformers hands it to flash attention:
        # sliding_window, softcap, s_aux (sinks); chunks from the config (layer_chunk).
        settings = module_settings(module)
        latent = gathered_call(module, query, key)  # K/V from every rank's latent (hf_latent)
        reason = _unsupported(query, key, dropout, latent is not None) or (
            _needs_apply(module, method) if settings is None else None)
        settings = settings or SequenceParallelSettings(method)
        if reason:
            raise ValueError(f"{method}: {reason}")
        query, key, value = _one_dtype(query, key, value)
        temperature = ws.temperature_of(module)
        if temperature is not None and not getattr(module, "use_rope", True):
            # Llama 4's attn_temperature_tuning from the tokens' global positions
            # (integrations.whole_sequence; the module's own arange-based scaling is off)
            positions = kwargs.get(ws.POSITIONS_KWARG)
            if positions is None:
                raise ValueError(f"{method}: {type(module).__name__} scales its queries by "
                                 "position (attn_temperature_tuning) and got no positions")
            scales = ws.temperature_scales(positions.to(query.device), *temperature)
            query = (query * scales).to(query.dtype)  # (B, Hq, S, D) * (B, 1, S, 1)
        spans = layer_image_spans(module, kwargs.get(IMAGE_SPANS_KWARG))
        cache = kwargs.get(KV_CACHE_KWARG)
        if cache is not None:  # easy_context.generate: prefill or decode, the cache's call
            out = cache.attend(
                module.layer_idx, query.transpose(1, 2), key.transpose(1, 2),
                value.transpose(1, 2), causal=getattr(module, "is_causal", True),
                softmax_scale=scaling, sliding_window=kwargs.get("sliding_window"),
                chunk_size=layer_chunk(module), softcap=kwargs.get("softcap"),
                sinks=kwargs.get("s_aux"),
                **({"image_spans": spans} if spans else {}))
            return out, None
        if latent is not None:  # this rank's queries against the whole sequence's K/V
            out = attend_gathered(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                group=latent.group, causal=getattr(module, "is_causal", True),
                softmax_scale=scaling, document_ids=kwargs.get("document_ids"),
                variant=variant_of(kwargs.get("sliding_window"), layer_chunk(module),
                                   kwargs.get("softcap")), sinks=kwargs.get("s_aux"))
            return out, None
        out = sequence_parallel_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), method,
            group=settings.group, causal=getattr(module, "is_causal", True),
            softmax_scale=scaling, ring_degree=settings.ring_degree,
            document_ids=kwargs.get("document_ids"),
            sliding_window=kwargs.get("sliding_window"), chunk_size=layer_chunk(module),
            softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
            image_spans=spans)
        return out, None  # (B, S, Hq, Dv), no attention weights

    attention.__name__ = f"{method}_hf_attention"
    return attention


for _method in METHODS:
    AttentionInterface.register(hf_attention_name(_method), _make_attention(_method))
_HF_NAMES = frozenset(hf_attention_name(m) for m in METHODS)


def _text_config(model: nn.Module):
    return text_config(model.config)


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# RoPE types that transformers rescales from the largest position one forward sees: on a
# shard that is the shard's; whole_sequence.whole_sequence_rope makes it the sequence's.
RESCALING_ROPE = ws.RESCALING_ROPE


def rope_types(config) -> set[str]:
    """The RoPE types of a (text) config: one, or one per layer type (Gemma 3's nested
    rope_parameters)."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        return {"default"}
    if params and all(isinstance(v, dict) for v in params.values()):
        return {str(v.get("rope_type", "default")) for v in params.values()}
    return {str(params.get("rope_type", "default"))}


# Layer types whose block mixes no tokens (Nemotron-H: a block whose only mixer is an MLP or a
# MoE, called on the hidden states alone). No attribute tells a per-token block from a
# recurrent one, hence the names.
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe"})


def config_layer_types(config) -> list[str]:
    """The kind of each layer of a (text) config: ``layer_types``, or Jamba-style
    ``layers_block_type``; [] when the config names none (every layer attention)."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    return [str(t) for t in types or []]


def token_mixing_types(layer_types: list[str]) -> set[str]:
    """Of ``layer_types``, the kinds that mix tokens without being attention (recurrent
    mixers, convolutions): they carry state along the sequence."""
    return set(layer_types) - ATTENTION_LAYER_TYPES - {"attention"} - PER_TOKEN_LAYER_TYPES


def check_model_supported(model: nn.Module) -> None:
    """Raise a ValueError naming the reason when ``model`` cannot run sequence-parallel.

    Every attention layer can (full, sliding-window, chunked; soft-capped, with sinks, with
    its own value head dim). Layers that are not softmax attention carry state along the
    sequence: those hf_recurrent.py routes to easy_context.recurrent run (its ``RUNS`` names
    them); the others (MiniMax's lightning attention, ...) are refused by name. A model with no
    attention layer runs when every token mixer is such a routed layer. Refused too: models
    whose attention does not go through transformers' attention interface, and decoders that take no
    ``position_ids`` (BART-style: positions from the shard's own length)."""
    layer_types = config_layer_types(_text_config(model))
    routed = recurrent_layer_types(model, layer_types)  # hf_recurrent.py routes those
    other = sorted(token_mixing_types(layer_types) - routed)
    if other:
        layers = [i for i, t in enumerate(layer_types) if str(t) in other]
        raise ValueError(
            f"{type(model).__name__} has layers that are not attention ({', '.join(other)}: "
            f"layers {layers[:8]}{'...' if len(layers) > 8 else ''}); sequence parallelism "
            "runs attention and, of the layers that carry state along the whole sequence, "
            f"{RECURRENT_RUNS} only. Use a model whose every other layer is attention")
    if not _attention_modules(model) and not (routed & token_mixing_types(layer_types)):
        # (a model whose every token mixer is a routed recurrent layer, e.g. a hybrid config
        # with no attention layer, has nothing else to shard: it runs)
        raise ValueError(f"found no attention layers in {type(model).__name__}: its attention "
                         "does not go through transformers' attention interface")
    reason = _positions_not_from_ids(model)
    if reason:
        raise ValueError(reason)


def _positions_not_from_ids(model: nn.Module) -> str | None:
    """Why the decoder's positions would not come from the ``position_ids`` each rank passes
    (its global positions), or None. BART-style decoders (BART, mBART, Marian, Pegasus,
    PLBart, Blenderbot, BigBird-Pegasus, MVP, TrOCR) take no ``position_ids``: they number
    their learned or sinusoidal positions 0..S-1 from the input's own length, which on a
    shard is the shard's, so every rank would embed the first positions of the sequence."""
    decoder = decoder_of(model)
    if "position_ids" in inspect.signature(decoder.forward).parameters:
        return None
    return (f"{type(model).__name__}'s decoder ({type(decoder).__name__}) takes no position_ids: "
            "it numbers positions from the length of its own input, which under sequence "
            "parallelism is one shard, so every rank would embed the first positions of the "
            "sequence. Use a model whose decoder takes position_ids (RoPE or learned positions "
            "read from position_ids, e.g. Llama, Qwen, GPT-2, OPT)")


# Families whose training-mode forward draws random numbers per token: drawn over a shard,
# they are other draws than the same tokens get in one process, so no step equals the
# single-process one. PhiMoE samples its two experts per token (sparsemixer: Gumbel sampling
# and a random Heun mask) whenever the model trains; no config field turns that off and no
# attribute shows it, hence a name. Jitter (``jitter_noise``, ``input_jitter_noise``: Mixtral,
# MiniMax, DBRX, PhiMoE) shows as an attribute of the module that draws it.
SAMPLING_IN_TRAINING = {"phimoe": "samples its experts at random in training (Gumbel sampling)"}
_JITTER_ATTRS = ("jitter_noise", "input_jitter_noise")


def training_randomness(model: nn.Module) -> str | None:
    """What of ``model`` draws random numbers per token in training mode, or None."""
    config = _text_config(model)
    reason = SAMPLING_IN_TRAINING.get(getattr(config, "model_type", None))
    if reason:
        return f"{type(model).__name__} {reason}"
    for name, module in model.named_modules():
        for attr in _JITTER_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return (f"{type(model).__name__} multiplies its router inputs by random jitter "
                        f"in training ({name}.{attr}={value}; set the config's jitter field, "
                        "e.g. router_jitter_noise or input_jitter_noise, to 0)")
    return None


def _refuse_training_randomness(reason: str):
    """A forward pre-hook for the decoder: in training mode, refuse (eval and generation
    draw nothing and stay exact)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if module.training and getattr(module.config, "_attn_implementation", None) in _HF_NAMES:
            raise ValueError(f"{reason}: each rank would draw for its shard what one process "
                             "draws for the whole sequence, so training steps would differ; "
                             "train it without sequence parallelism, or use it in eval mode "
                             "(model.eval(): evaluation, generation)")
        return None

    return hook


_MASK_HOOK_ATTR = "_easy_context_mask_hook"
_RANDOM_HOOK_ATTR = "_easy_context_random_hook"


def _refuse_padding(group):
    """A forward pre-hook for the decoder: the sequence-parallel attention functions build
    their own causal (and packed-document) masks and take no other, and transformers hands a
    custom attention function no mask at all, so a padding mask would silently be ignored.
    Raise instead, on every rank of ``group`` (one collective, only when a mask is given)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if getattr(module.config, "_attn_implementation", None) not in _HF_NAMES:
            return None  # switched back to a plain attention since
        if "attention_mask" in kwargs:
            mask = kwargs["attention_mask"]
        else:  # passed by position (input_ids, attention_mask, ...)
            params = list(inspect.signature(module.forward).parameters)
            index = params.index("attention_mask") if "attention_mask" in params else len(args)
            mask = args[index] if index < len(args) else None
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError("sequence-parallel attention takes no prepared (4-D) attention "
                             "mask: it is causal, and keeps packed documents apart with "
                             "document_ids")
        padded = (mask == 0).any().to(torch.int32).reshape(1)
        if group_size(group) > 1:  # some ranks' shards may be padded and others not
            dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=process_group(group))
        if padded.item():
            raise ValueError("attention_mask has zeros (padding), which sequence-parallel "
                             "attention cannot honour: pack sequences instead (position_ids "
                             "restarting at 0, or document_ids), or, for padding at the end "
                             "of a sequence, drop the mask and set those targets to -100")
        return None

    return hook


def _runs_sequence_parallel(decoder: nn.Module):
    """() -> whether ``decoder`` runs one of easy_context's attention functions now."""
    return lambda: getattr(decoder.config, "_attn_implementation", None) in _HF_NAMES


def _attention_modules(model: nn.Module):
    # Attention layers are the modules that carry a layer index and a causal flag.
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]


def apply_sequence_parallel(model: nn.Module, method: str, group=None,
                            ring_degree: int | None = None) -> nn.Module:
    """Switch an already built model to sequence-parallel attention over ``group`` (a process
    group, an easy_context.mesh.SPGroup, or None for the world).

    ``method`` is a key of ``easy_context.METHODS`` or an alias (``data_parallel``: the
    ``local`` method, whole sequences on each rank). Checks the model's heads against the
    method before any collective. Returns the model (changed in place).
    """
    m = get_method(method)
    check_model_supported(model)
    config = _text_config(model)
    world = group_size(group)
    if ring_degree is None and isinstance(group, SPGroup) and m.needs_ring_degree:
        ring_degree = group.ring_degree
    modules = _attention_modules(model)
    if world > 1:
        heads = kv_heads = None  # no attention layer: no heads to split (the rest still holds)
        if modules:
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
        m.check(heads, kv_heads, world, ring_degree)
    if m.needs_ring_degree and world > 1 and 1 < ring_degree < world:
        group = usp_groups(group, ring_degree)  # once, not at every forward
    settings = SequenceParallelSettings(m.name, group, ring_degree)
    for module in modules:
        store_settings(module, settings)
    # MLA layers send their latent instead of K/V where the method can (hf_latent.py)
    route_latent_layers(modules, m.name, hf_attention_name(m.name), world)
    route_recurrent_layers(model, settings)
    decoder = decoder_of(model)
    if getattr(decoder, _MASK_HOOK_ATTR, None) is not None:
        getattr(decoder, _MASK_HOOK_ATTR).remove()  # applied again: the new group counts
    setattr(decoder, _MASK_HOOK_ATTR, decoder.register_forward_pre_hook(
        _refuse_padding(group), with_kwargs=True))
    # what transformers derives from the call's length, from the whole sequence's positions
    active = _runs_sequence_parallel(decoder)
    ws.whole_sequence_rope(model, group, active, enabled=world > 1 and m.layout != "whole")
    layers = getattr(decoder, "layers", None)
    ws.tune_temperature_globally(model, list(layers) if layers is not None else [], active)
    if getattr(decoder, _RANDOM_HOOK_ATTR, None) is not None:
        getattr(decoder, _RANDOM_HOOK_ATTR).remove()
        setattr(decoder, _RANDOM_HOOK_ATTR, None)
    randomness = training_randomness(model) if m.layout != "whole" else None
    if randomness:
        setattr(decoder, _RANDOM_HOOK_ATTR, decoder.register_forward_pre_hook(
            _refuse_training_randomness(randomness), with_kwargs=True))
    model.set_attn_implementation(_text_only(model, hf_attention_name(m.name)))
    from . import vision

    if vision.is_vision_language(model):  # images go through prepare_vision_inputs
        sharded = world > 1 and m.layout != "whole"
        vision.guard_own_forward(model, lambda: sharded and active())
    return model


def _text_only(model: nn.Module, name: str) -> str | dict:
    """``name`` for ``set_attn_implementation``, aimed at the text decoder alone where the
    config nests it (vision-language models): a vision tower attends within each image, on
    the rank that encodes it (integrations/vision.py), with its own attention."""
    config = model.config
    for key in getattr(config, "sub_configs", {}) or {}:
        if getattr(config, key, None) is text_config(config) and text_config(config) is not config:
            return {key: name}
    return name


# ``logits_scaling`` divides the logits in Granite (and MiniCPM3, before its head) but
# multiplies them in HyperCLOVAX (``lm_head(h) * logits_scaling``): the config field is the
# same, only the modeling code tells, hence names.
LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})


def between_decoder_and_head(model: nn.Module, head: nn.Module) -> bool:
    """Whether a top-level part of the model other than the one holding the decoder has
    parameters outside the head: a prediction transform between the decoder and the
    projection (BERT-style heads: dense, activation, LayerNorm, then the projection), so the
    logits are not ``head(last hidden state)``. (Parts beside the decoder inside its own
    parent, such as a vision tower, feed the decoder's input, not its output.)"""
    decoder = decoder_of(model)
    head_params = {id(p) for p in head.parameters()}
    for child in model.children():
        if child is head or any(m is decoder for m in child.modules()):
            continue
        if any(id(p) not in head_params for p in child.parameters()):
            return True
    return False


def generation_defaults() -> dict:
    """transformers' own values for the generation settings that neither the call nor the
    model's generation_config sets (greedy; top_k 50, temperature 1, top_p 1 when sampling;
    no repetition penalty): what its ``generate`` falls back to."""
    from transformers import GenerationConfig

    return dict(GenerationConfig._get_default_generation_params())


def output_head(model: nn.Module):
    """(the output projection, what the family does to its logits: a LogitTransform or None),
    or (None, None) when the logits are not a linear layer of the decoder's last hidden state
    (a head that is no linear layer, or a transform with parameters between them). Gemma 2/3
    soft-cap the logits (``final_logit_softcapping``), Cohere scales them (``logit_scale``),
    Granite divides by ``logits_scaling`` and HyperCLOVAX multiplies by it, Falcon-H1
    multiplies by ``lm_head_multiplier``; the chunked losses
    apply the same, chunk by chunk."""
    from ..memory.loss import LogitTransform

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (not isinstance(head, nn.Linear) or between_decoder_and_head(model, head)
            or {n for n, _ in head.named_parameters()} - {"weight", "bias"}):
        # a Linear subclass with parameters of its own (Dory's learned per-token logit
        # scale) computes more than ``hidden @ W.T``
        return None, None
    config = _text_config(model)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1.0, False):
        if getattr(config, "model_type", None) in LOGITS_SCALING_MULTIPLIES:
            scale *= float(scaling)
        else:
            scale /= float(scaling)
    multiplier = getattr(config, "lm_head_multiplier", None)
    if multiplier not in (None, 1.0, False):
        scale *= float(multiplier)
    if softcap in (None, 0, False) and scale == 1.0:
        return head, None
    if config is not model.config:
        # a composite model (text inside a multimodal one): whether its top class applies the
        # text config's soft-capping or scaling is its own code's choice (Gemma 3's
        # ForConditionalGeneration applies no final soft-capping, Aya Vision scales), so the
        # chunked loss does not guess: the logits path runs the model's own head
        return None, None
    return head, LogitTransform(scale, None if softcap in (None, 0, False) else float(softcap))


def plain_lm_head(model: nn.Module) -> nn.Linear | None:
    """The output projection, if logits are exactly ``hidden @ W.T (+ b)``; else None."""
    head, transform = output_head(model)
    return head if transform is None else None


def causal_lm_loss(model: nn.Module, input_ids: Tensor, position_ids: Tensor, target_ids: Tensor,
                   group: dist.ProcessGroup | None = None, document_ids: Tensor | None = None,
                   num_items_in_batch: Tensor | int | None = None, chunked: bool | None = None,
                   chunk_size: int | None = None, token_stats: Tensor | None = None,
                   vision=None) -> Tensor:
    """The exact global token-mean loss of a causal LM on this rank's shard.

    input_ids, position_ids, target_ids (and document_ids): this rank's (B, S_local) shards,
    targets already shifted (-100 = ignore). The value is the mean over every valid target in
    ``group`` (or over ``num_items_in_batch``, the global count across DP ranks and
    accumulation steps); the gradient is this rank's share, so gradients summed over ranks
    are the gradient of that mean (see easy_context.memory.loss.global_token_mean).

    ``chunked`` (default: when the vocabulary has >= 16384 entries and the head is a plain
    linear layer) computes the loss from the last hidden states chunk by chunk, never
    building the (tokens x vocab) logits; ``chunk_size`` rows at a time (default: about
    64 MiB of float32 logits per chunk on a CPU; 2,048 rows on a GPU, where fewer, larger
    chunks keep the head's matmuls compute-bound: easy_context.memory.loss.default_chunk_size).

    ``token_stats``, a (3,) float64 tensor, gets this rank's (entropy sum, top-1 hits, valid
    targets) added, from the same logits chunks (easy_context.memory.loss.lse_).

    ``vision`` (a vision-language step: ``prepare_vision_inputs(...)["vision"]``) puts this
    rank's image and video features into its embeddings (integrations/vision.py); position_ids
    are then the (3, B, S_local) multimodal ones where the model uses those.
    """
    from ..memory.loss import chunked_cross_entropy, default_chunk_size, logits_cross_entropy

    head, transform = output_head(model)
    head_pre = None
    if head is None and vision is None:  # max-length mode runs a BERT-style head in chunks
        from ..memory.maxlen import max_length_head

        head, head_pre = max_length_head(model)
    if chunked is None:
        chunked = head is not None and head.out_features >= 16384
    if chunked and head is None:
        raise ValueError(f"{type(model).__name__}'s logits are not a linear layer of the "
                         "decoder's last hidden state (another head, or a transform between "
                         "them); use chunked=False")
    extra = {} if document_ids is None else {"document_ids": document_ids}
    if vision is not None:
        from .vision import vision_language_loss

        if transform is not None:
            # (a composite model's head gives None above; one of its own config with a
            # soft-cap or scale would be dropped by the vision loss: refused, not guessed)
            raise ValueError(f"{type(model).__name__} transforms its logits ({transform}); "
                             "the vision-language loss does not apply that: train it without "
                             "images")

        return vision_language_loss(model, head, input_ids, position_ids, target_ids, vision,
                                    extra, chunked, chunk_size, group, num_items_in_batch,
                                    token_stats)
    if chunked:
        if chunk_size is None:
            chunk_size = default_chunk_size(head.out_features, head.weight.device)
        from ..utils.fsdp import unshard_for_direct_use

        unshard_for_direct_use(head)  # read directly below, never called
        from ..memory.maxlen import max_length_loss, max_length_settings

        if max_length_settings(model) is not None:  # the final norm goes into the chunks
            return max_length_loss(model, head, input_ids, position_ids, target_ids, extra,
                                   chunk_size, group, num_items_in_batch, transform, token_stats,
                                   head_transform=head_pre)
        hidden = decoder_of(model)(input_ids=input_ids, position_ids=position_ids,
                                     use_cache=False, **extra).last_hidden_state
        return chunked_cross_entropy(hidden, head.weight, target_ids, head.bias,
                                     chunk_size=chunk_size, group=group,
                                     num_items_in_batch=num_items_in_batch, transform=transform,
                                     stats=token_stats)
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra).logits
    return logits_cross_entropy(logits, target_ids, group=group,
                                num_items_in_batch=num_items_in_batch, stats=token_stats)


class CausalLMLoss(nn.Module):
    """``causal_lm_loss`` as a module around the model, for sharding engines.

    FSDP and ZeRO-3 gather the parameters of a module when *its* forward runs. The chunked
    loss calls the decoder and uses the head's weight outside the model's own forward, so
    the root that the engine wraps must be this module: its forward covers everything.
    """

    def __init__(self, model: nn.Module, chunked: bool | None = None, chunk_size: int | None = None):
        super().__init__()
        self.model = model
        self.chunked, self.chunk_size = chunked, chunk_size

    def forward(self, input_ids: Tensor, position_ids: Tensor, target_ids: Tensor,
                group: dist.ProcessGroup | None = None, document_ids: Tensor | None = None,
                num_items_in_batch: Tensor | int | None = None) -> Tensor:
        return causal_lm_loss(self.model, input_ids, position_ids, target_ids, group=group,
                              document_ids=document_ids, num_items_in_batch=num_items_in_batch,
                              chunked=self.chunked, chunk_size=self.chunk_size)
