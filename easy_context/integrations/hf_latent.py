"""Multi-head latent attention layers that send their latent, not K/V, under all-gather attention.

transformers' MLA attention modules (DeepSeek-V2/V3, Kimi K2 / Moonlight, Kimi Linear,
GLM-4-MoE-lite, MiniCPM3, Longcat-Flash, Youtu, ...: every module with ``kv_b_proj`` and
``expand_kv``) compute per token the normalised compressed KV (``kv_lora_rank`` values) and
the RoPE'd key part shared by the heads (``qk_rope_head_dim``), write those two to their
cache, and then call ``self.expand_kv(kv_nope, k_rot)``, which up-projects them into every
head's K and V with ``kv_b_proj``. transformers calls ``expand_kv`` on the whole cache (every
token so far), so it is a per-token map over any length: the mechanism used here.

Under a method whose description moves the latent (``Method.latent_comm_bytes``: all-gather
attention), in a call without a KV cache over more than one rank, the module's ``expand_kv``
first gathers every rank's (kv_nope, k_rot) in sequence order (parallel/latent.gather_latent:
one all-gather of kv_lora_rank + qk_rope_head_dim values a token; k_rot after RoPE, which
depends only on its own token's global position), then expands the whole sequence's K/V with
the layer's own ``kv_b_proj``; the attention function attends this rank's queries to them
(latent.attend_gathered). Autograd takes the gradient back through ``kv_b_proj`` (its weight,
LoRA adapters on it) and the gather's backward reduce-scatters the latent's float32 gradient
to the owners (then ``kv_a_layernorm``, ``kv_a_proj_with_mqa``). Everything else of the
module's forward runs as written: q from q_proj or q_a/q_b, biases, interleaved RoPE, YaRN's
mscale (``module.scaling``), gates. Exact as the expanded path (tests/dist/test_mla_latent.py).

The expanded path runs instead (the attention function gets this rank's K/V, the method moves
them): under the other methods (ring, Ulysses: parallel/latent.py says why), on one rank, in
a call with a KV cache (pass use_cache=False: the loss functions and the trainer do), and in
max-length mode's head chunks (memory/generic_layer.py switches the layer's attention to its
chunking wrapper): they exist to hold a few heads' K/V at a time, and expanding the latent
makes every head's K/V for the whole sequence at once.

Cost: each rank runs ``kv_b_proj`` on the whole sequence (N times the projection FLOPs), and
a layer keeps the whole sequence's expanded K/V for its backward (as all-gather attention's
backward holds it anyway; without activation checkpointing that is kept for every layer).
"""

from __future__ import annotations

import inspect
import logging
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..mesh import group_size
from ..parallel import METHODS, get_method
from ..parallel.latent import gather_latent
from ..parallel.settings import module_settings
from .hf_recurrent import KV_CACHE_KWARG

Tensor = torch.Tensor
log = logging.getLogger(__name__)

CALL_ATTR = "_easy_context_latent_call"  # this forward's LatentCall, or None
NAME_ATTR = "_easy_context_latent_name"  # the attention implementation name it runs under
HOOKS_ATTR = "_easy_context_latent_hooks"
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


@dataclass
class LatentCall:
    """One forward of an MLA module on the latent path: its group, and whether its
    ``expand_kv`` gathered (then the attention function gets the whole sequence's K/V)."""

    group: object
    world: int
    gathered: bool = False


def latent_structure(module: nn.Module) -> str | None:
    """Why ``module`` is not an MLA attention module whose latent can be gathered, or None.
    It must expand K/V from the latent in its own ``expand_kv(kv_nope, k_rot)`` with a
    ``kv_b_proj`` module, and name its latent widths (``kv_lora_rank``,
    ``qk_rope_head_dim``)."""
    expand = getattr(type(module), "expand_kv", None)
    if not callable(expand):
        return f"{type(module).__name__} has no expand_kv (it expands no latent)"
    if not isinstance(getattr(module, "kv_b_proj", None), nn.Module):
        return f"{type(module).__name__} has no kv_b_proj module"
    for name in ("kv_lora_rank", "qk_rope_head_dim"):
        if not isinstance(getattr(module, name, None), int):
            return f"{type(module).__name__}.{name} is not an int"
    params = [p for p in inspect.signature(expand).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 3:  # self, kv_nope, k_rot
        return (f"{type(module).__name__}.expand_kv takes {len(params) - 1} arguments, not "
                "(kv_nope, k_rot)")
    return None


def latent_width(module: nn.Module) -> int:
    """Values a token's latent holds: kv_lora_rank + qk_rope_head_dim."""
    return module.kv_lora_rank + module.qk_rope_head_dim


def _expand_kv(module: nn.Module, kv_nope: Tensor, k_rot: Tensor):
    """The module's expand_kv; on the latent path, on every rank's latent in sequence order.
    kv_nope (B, 1, s, r), k_rot (B, 1, s, rope) -> the class's (k, v) for B x S tokens."""
    call = getattr(module, CALL_ATTR, None)
    if call is not None:
        b, _, s, r = kv_nope.shape
        dtype = torch.promote_types(kv_nope.dtype, k_rot.dtype)  # one gather for both
        latent = torch.cat([kv_nope.reshape(b, s, r).to(dtype),
                            k_rot.reshape(b, s, -1).to(dtype)], dim=-1)  # (B, s, r + rope)
        whole = gather_latent(latent, call.group)  # (B, S, r + rope), sequence order
        kv_nope = whole[..., :r].to(kv_nope.dtype).unsqueeze(1)
        k_rot = whole[..., r:].to(k_rot.dtype).unsqueeze(1)
        call.gathered = True
    return type(module).expand_kv(module, kv_nope, k_rot)


def _begin(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: whether this call takes the latent path (see the module doc)."""
    call = None
    settings = module_settings(module)
    if (settings is not None and get_method(settings.method).latent_comm_bytes is not None
            and getattr(getattr(module, "config", None), "_attn_implementation", None)
            == getattr(module, NAME_ATTR, None)
            and KV_CACHE_KWARG not in kwargs
            and all(kwargs.get(k) is None for k in CACHE_KWARGS)):
        world = group_size(settings.group)
        if world > 1:
            call = LatentCall(settings.group, world)
    setattr(module, CALL_ATTR, call)


def _end(module: nn.Module, args: tuple, output):
    setattr(module, CALL_ATTR, None)


def gathered_call(module: nn.Module, query: Tensor, key: Tensor) -> LatentCall | None:
    """The LatentCall whose expand_kv gave ``key`` (B, H, S, D) for the local ``query``
    (B, H, S/N, D), or None (the expanded path)."""
    call = getattr(module, CALL_ATTR, None)
    if call is None or not call.gathered:
        return None
    if key.size(2) != call.world * query.size(2):
        raise ValueError(f"{type(module).__name__}: the gathered latent gave {key.size(2)} "
                         f"keys for {query.size(2)} local queries over {call.world} ranks")
    return call


def remove_latent(module: nn.Module) -> None:
    for handle in getattr(module, HOOKS_ATTR, None) or ():
        handle.remove()
    for attr in (HOOKS_ATTR, CALL_ATTR, NAME_ATTR):
        if attr in vars(module):
            delattr(module, attr)
    if "expand_kv" in vars(module):
        del module.expand_kv


def install_latent(module: nn.Module, attention_name: str) -> None:
    """Make ``module`` (latent_structure None) gather its latent under ``attention_name``
    when its settings' method moves latents (see the module doc); idempotent."""
    remove_latent(module)
    module.expand_kv = types.MethodType(_expand_kv, module)  # deep copies rebind it
    setattr(module, NAME_ATTR, attention_name)
    setattr(module, CALL_ATTR, None)
    setattr(module, HOOKS_ATTR, (
        module.register_forward_pre_hook(_begin, with_kwargs=True),
        module.register_forward_hook(_end, always_call=True)))


def route_latent_layers(modules: list[nn.Module], method: str, attention_name: str,
                        world: int) -> list[nn.Module]:
    """Install the latent path on the MLA modules among ``modules`` (or take it off, for a
    method that moves K/V), and say on the log which path they take. Returns the modules
    that gather their latent."""
    m = get_method(method)
    mla = [mod for mod in modules if latent_structure(mod) is None]
    for mod in modules:
        remove_latent(mod)
    if not mla:
        return []
    first = mla[0]
    heads = getattr(first, "num_heads", None) or first.config.num_attention_heads
    kv = heads * (first.qk_head_dim + first.v_head_dim) if hasattr(first, "v_head_dim") and \
        hasattr(first, "qk_head_dim") else None
    sizes = (f"{latent_width(first)} values a token (kv_lora_rank {first.kv_lora_rank} + "
             f"rope {first.qk_rope_head_dim})" + (f" instead of {kv} of expanded K/V" if kv else ""))
    if m.latent_comm_bytes is None or world == 1:
        if world > 1:
            senders = [n for n, other in METHODS.items() if other.latent_comm_bytes is not None]
            log.info("%s: %d multi-head latent attention layers move their expanded K/V; %s "
                     "would send their latent, %s", m.name, len(mla), " or ".join(senders),
                     sizes)
        return []
    for mod in mla:
        install_latent(mod, attention_name)
    log.info("%s: %d multi-head latent attention layers (%s) send their latent, %s; K/V are "
             "expanded on each rank with the layer's kv_b_proj", m.name, len(mla),
             type(first).__name__, sizes)
    return mla
