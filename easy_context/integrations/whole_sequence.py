"""What transformers derives from "the sequence" inside one forward, taken from the whole
sequence under sequence parallelism, where each rank's forward sees only its shard.

- dynamic and LongRoPE scaling (``dynamic_rope_update`` in transformers.modeling_rope_utils)
  choose the rotary frequencies from ``max(position_ids) + 1`` of the call: Phi-3.5/Phi-4
  long-context configs switch from short to long factors past
  ``original_max_position_embeddings``, dynamic NTK rescales past ``max_position_embeddings``.
  On a shard that is the shard's own largest position, which differs from rank to rank (a
  zigzag middle rank, a contiguous first rank). :func:`whole_sequence_rope` adds one column to
  the rotary module's ``position_ids``: the largest position over the group (one all-reduce
  of a one-element tensor on the positions' device), so transformers' own update sees the
  whole sequence's length, and drops that column from the cos/sin it returns. The rotary
  state then moves exactly as in one process that holds the whole sequence.
- Llama 4's ``attn_temperature_tuning`` scales the queries of its NoPE layers by
  ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` with ``pos`` an arange over the
  call's length (plus the tokens in its KV cache), so a shard would count from 0.
  :func:`temperature_scales` computes it from the tokens' global positions (the position_ids
  the decoder layer is handed, which the sequence-parallel inputs carry); the attention
  module's own scaling is switched off while a sequence-parallel attention runs it
  (:func:`tune_temperature_globally`), and the attention function applies these scales.
  In one process with ``position_ids = arange`` (an unpacked batch) both are the same
  numbers; for packed documents this follows position_ids (each document counts from 0, as
  its RoPE does), where transformers counts along the packed row.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import group_size, process_group

Tensor = torch.Tensor

# RoPE types that transformers rescales from the largest position one forward sees.
RESCALING_ROPE = frozenset({"dynamic", "longrope"})
_ROPE_HOOKS = "_easy_context_whole_sequence_rope"
# The keyword argument under which a NoPE layer's attention function gets the tokens'
# global positions (B, S_local) for attn_temperature_tuning (transformers passes it through
# the decoder layer and the attention module to the attention function).
POSITIONS_KWARG = "easy_context_positions"
_TEMPERATURE = "_easy_context_temperature"  # (attn_scale, floor_scale) on a tuned module


def rescaling_rotaries(model: nn.Module) -> list[nn.Module]:
    """The rotary-embedding modules whose tables depend on the longest position of a call."""
    found = []
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
        if any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
            found.append(module)
    return found


def _positions_arg(module: nn.Module) -> int:
    params = list(inspect.signature(module.forward).parameters)
    return params.index("position_ids") if "position_ids" in params else 1


def whole_sequence_rope(model: nn.Module, group, active: Callable[[], bool],
                        enabled: bool = True) -> int:
    """Make every rescaling rotary module of ``model`` see the whole sequence's length over
    ``group`` (its shards) while ``active()`` (the model runs a sequence-parallel attention).
    Applied again, the old hooks go first; ``enabled=False`` only removes them (one rank, or
    whole sequences on each rank). Returns how many modules were hooked."""
    rotaries = rescaling_rotaries(model)
    pg = process_group(group)
    for rotary in rotaries:
        for handle in getattr(rotary, _ROPE_HOOKS, ()):
            handle.remove()
        setattr(rotary, _ROPE_HOOKS, ())
        if not enabled:
            continue
        index = _positions_arg(rotary)
        state: dict = {}

        def pre(module, args, kwargs, index=index, state=state):
            state.clear()
            if not active() or group_size(group) == 1:
                return None
            in_kwargs = "position_ids" in kwargs
            pos = kwargs["position_ids"] if in_kwargs else args[index]  # (B, S) or (S,)
            longest = pos.max().reshape(1)  # on the positions' device (NCCL needs that)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=pg)
            # the largest position of the whole sequence as one more column: transformers'
            # update reads max(position_ids) + 1; the tables get one row too many, dropped below
            extra = longest.to(pos.dtype).expand(*pos.shape[:-1], 1)
            state["length"], state["dim"] = pos.size(-1), pos.dim() - 1
            pos = torch.cat([pos, extra], dim=-1)
            if in_kwargs:
                return args, {**kwargs, "position_ids": pos}
            return (*args[:index], pos, *args[index + 1:]), kwargs

        def post(module, args, kwargs, output, state=state):
            if not state:
                return None
            n, d = state.pop("length"), state.pop("dim")
            cut = lambda t: t.narrow(d, 0, n) if isinstance(t, Tensor) else t  # noqa: E731
            return tuple(cut(t) for t in output) if isinstance(output, tuple) else cut(output)

        setattr(rotary, _ROPE_HOOKS, (
            rotary.register_forward_pre_hook(pre, with_kwargs=True),
            rotary.register_forward_hook(post, with_kwargs=True)))
    return len(rotaries) if enabled else 0


def temperature_scales(positions: Tensor, attn_scale: float, floor_scale: float) -> Tensor:
    """Llama 4's query scale per token from its position: (B, S) -> (B, 1, S, 1) float32,
    transformers' formula (Llama4TextAttention.forward) on global positions."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return scales[:, None, :, None]


def tuned_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules that scale their NoPE queries by position (Llama 4's
    ``attn_temperature_tuning``; hooked ones included)."""
    return [m for m in model.modules()
            if hasattr(m, _TEMPERATURE) or (getattr(m, "attn_temperature_tuning", False)
                                            and not getattr(m, "use_rope", True))]


def tune_temperature_globally(model: nn.Module, layers: list[nn.Module],
                              active: Callable[[], bool]) -> int:
    """For each tuned attention module (a child ``self_attn`` of one of ``layers``): while
    ``active()``, its own position-from-arange scaling is off and the decoder layer hands the
    attention function the tokens' positions (``POSITIONS_KWARG``), which applies
    :func:`temperature_scales`; otherwise transformers' own scaling runs unchanged. Returns
    how many modules were set up."""
    count = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or attn not in tuned_attention_modules(model):
            continue
        if not hasattr(attn, _TEMPERATURE):
            setattr(attn, _TEMPERATURE, (float(attn.attn_scale), float(attn.floor_scale)))
            attn.register_forward_pre_hook(_switch_temperature(active))
            layer.register_forward_pre_hook(_hand_positions(active), with_kwargs=True)
        count += 1
    return count


def _switch_temperature(active: Callable[[], bool]):
    def hook(module, args):
        # transformers' arange-based scaling off exactly while the attention function
        # applies the global one; on again as soon as another attention runs the module
        module.attn_temperature_tuning = not active()
        return None

    return hook


def _hand_positions(active: Callable[[], bool]):
    def hook(layer, args, kwargs):
        if not active():
            kwargs.pop(POSITIONS_KWARG, None)
            return args, kwargs
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError(f"{type(layer).__name__} was called without position_ids: Llama 4's "
                             "attn_temperature_tuning needs the tokens' global positions")
        return args, {**kwargs, POSITIONS_KWARG: pos}

    return hook


def temperature_of(module: nn.Module) -> tuple[float, float] | None:
    """(attn_scale, floor_scale) of a module set up by tune_temperature_globally, else None."""
    return getattr(module, _TEMPERATURE, None)
