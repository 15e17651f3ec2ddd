"""Does a decoder layer compute exactly what the fused layer computes? Verified, not assumed.

The fused layer (easy_context.memory.fused_layer) re-implements one layer shape:

    h = x + r * o_proj(attention(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = h + r * mlp(n2(h))

with r the layer's ``residual_multiplier`` (Granite; 1 elsewhere), RoPE skipped on layers
whose attention says ``use_rope`` is off (SmolLM3's NoPE layers), optional per-head q/k
norms, the attention's own ``scaling`` (Granite's attention_multiplier, Gemma's
query_pre_attn_scalar), sliding window, soft-capping and sinks. Many families share the
child modules of that shape but compute something else with them: Granite scales each
residual branch, MiniMax weighs residual and branch, OLMo clamps q/k/v (``clip_qkv``),
Seed-OSS and Starcoder2 add dropout to the branches, MiMo-V2 scales the values. What the
children alone cannot show sits in the layer's and the attention's own number attributes
(copied from the config in their ``__init__``) and in a few config entries read at each
call; :func:`fused_layer_mismatch` checks all three:

- the layer's children are exactly input_layernorm, self_attn, post_attention_layernorm,
  mlp; the attention's are q/k/v/o_proj (nn.Linear) and optional per-head q_norm/k_norm;
  neither holds a parameter or buffer of its own (except the attention's ``sinks``);
- every number attribute of the layer and of the attention is one the fused layer uses or
  ignores harmlessly (a width, an index) or has its neutral value; an attribute it does not
  know is refused by name, so a new family's multiplier cannot slip through;
- the config entries read at call time (``clip_qkv``, the Falcon-H1 multipliers, parallel
  residuals) have their neutral values.

easy_context.memory.maxlen.probe_mismatch then runs the layer's own forward against the
fused computation on a few random tokens, where its weights are whole and local: that
catches a forward that differs in a way no attribute shows (Flint's NoPE global layers:
5e-1 apart), but not a branch that only acts past some position or magnitude (clip_qkv,
Ministral 3's position scaling), which the checks here refuse.
"""

from __future__ import annotations

import numbers

from torch import nn

LAYER_CHILDREN = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
ATTN_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
ATTN_NORMS = frozenset({"q_norm", "k_norm"})

# Number attributes the fused layer reproduces (REPRODUCED), or that describe the layer's
# shape and do not change what it computes (SHAPE); checked against the modules elsewhere.
LAYER_REPRODUCED = frozenset({"residual_multiplier"})
LAYER_SHAPE = frozenset({"hidden_size", "layer_idx"})
ATTN_REPRODUCED = frozenset({"scaling", "sliding_window", "attn_logit_softcapping", "use_rope",
                             "is_causal"})
ATTN_SHAPE = frozenset({"layer_idx", "head_dim", "num_key_value_groups", "num_heads",
                        "num_attention_heads", "num_key_value_heads", "hidden_size",
                        "use_qk_norm",
                        "partial_rotary_factor"})  # applied by the family's apply_rotary_pos_emb
# Attributes whose neutral value computes the plain shape, and what to change otherwise.
NEUTRAL = {
    "attention_dropout": 0.0, "residual_dropout": 0.0, "dropout": 0.0,  # Seed-OSS, Starcoder2
    "v_scale": 1.0,  # MiMo-V2 scales the values
    "attn_alpha_factor": 1.0, "attn_beta_factor": 1.0,  # MiniMax: residual * alpha + branch * beta
    "mlp_alpha_factor": 1.0, "mlp_beta_factor": 1.0,
}
# Config entries read inside a layer's forward (no attribute of the layer shows them).
CONFIG_NEUTRAL = {
    "clip_qkv": None,  # OLMo clamps q, k and v
    "use_parallel_residual": False, "parallel_attn": False,  # GPT-NeoX, Falcon, Cohere-style
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0,  # Falcon-H1
    "key_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0],
}
# Entries of config.rope_parameters that act inside the attention beyond the RoPE tables.
ROPE_NEUTRAL = {"llama_4_scaling_beta": None}  # Ministral 3: queries scaled by position
# Attention classes whose forward differs from the shape in a way no attribute shows (a
# list, for want of a property to check): Flint rotates only its sliding-window layers.
DIFFERENT_ATTENTION = {"FlintAttention": "its full-attention layers skip RoPE"}


def _numbers(module: nn.Module) -> dict[str, object]:
    """The module's own number attributes (flags included: an unknown switch is refused too)."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and isinstance(v, numbers.Number)}


def _own_tensors(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)] + \
        [n for n, _ in module.named_buffers(recurse=False)]


def _neutral(value, neutral) -> bool:
    if neutral is None:
        return value is None
    if isinstance(neutral, list):
        return isinstance(value, (list, tuple)) and len(value) == len(neutral) and \
            all(float(v) == n for v, n in zip(value, neutral))
    return isinstance(value, numbers.Number) and float(value) == neutral


def _attributes(module: nn.Module, reproduced, shape) -> str | None:
    """Why one of the module's number attributes stops the fused layer, or None."""
    name = type(module).__name__
    for attr, value in _numbers(module).items():
        if attr in reproduced or attr in shape:
            continue
        if attr in NEUTRAL:
            if _neutral(value, NEUTRAL[attr]):
                continue
            return (f"{name}.{attr} = {value} (neutral: {NEUTRAL[attr]}) changes the layer's "
                    "computation, which the fused layer does not reproduce; set it to "
                    f"{NEUTRAL[attr]} in the config or train without --mlp-tile/--head-chunk")
        return (f"{name}.{attr} = {value} is not a setting the fused layer knows it reproduces; "
                "train this model without --mlp-tile/--head-chunk")
    return None


def fused_layer_mismatch(layer: nn.Module, config) -> str | None:
    """Why the fused layer would not compute exactly what ``layer`` computes (one line naming
    the module, attribute or config entry), or None when it does."""
    name = type(layer).__name__
    children = {n for n, _ in layer.named_children()}
    if children != LAYER_CHILDREN:
        return (f"max-length mode fuses pre-norm decoder layers (children "
                f"{sorted(LAYER_CHILDREN)}); {name} has {sorted(children)}. Train this model "
                "without --mlp-tile/--head-chunk")
    if _own_tensors(layer):
        return (f"{name} holds its own tensors {_own_tensors(layer)}, which the fused layer "
                "does not use")
    attn = layer.self_attn
    a_name = type(attn).__name__
    a_children = {n for n, _ in attn.named_children()}
    if not ATTN_PROJECTIONS <= a_children or a_children - ATTN_PROJECTIONS - ATTN_NORMS:
        return (f"max-length mode needs separate q_proj/k_proj/v_proj/o_proj linear layers "
                f"(and optional per-head q_norm/k_norm); {a_name} has {sorted(a_children)}")
    # the fused layer reads their weight and bias: a subclass with its own forward (a
    # quantized or adapter layer) would compute something else (FSDP2's classes keep it)
    odd = [n for n in sorted(ATTN_PROJECTIONS) if not isinstance(getattr(attn, n), nn.Linear)
           or type(getattr(attn, n)).forward is not nn.Linear.forward]
    if odd:
        return (f"{a_name}: {', '.join(odd)} must be plain nn.Linear layers (the fused layer "
                f"uses their weight and bias), not {type(getattr(attn, odd[0])).__name__}")
    extra = [n for n in _own_tensors(attn) if n != "sinks"]
    if extra:
        return f"{a_name} holds its own tensors {extra}, which the fused layer does not use"
    if a_name in DIFFERENT_ATTENTION:
        return (f"max-length mode: {a_name}: {DIFFERENT_ATTENTION[a_name]}, which the fused "
                "layer does not reproduce; train this model without --mlp-tile/--head-chunk")
    if not hasattr(attn, "scaling"):
        return f"{a_name} has no scaling attribute (the softmax scale the fused layer hands on)"
    reason = (_attributes(layer, LAYER_REPRODUCED, LAYER_SHAPE)
              or _attributes(attn, ATTN_REPRODUCED, ATTN_SHAPE))
    if reason:
        return f"max-length mode: {reason}"
    if getattr(config, "residual_multiplier", None) not in (None, 1, 1.0) and \
            not hasattr(layer, "residual_multiplier"):
        return (f"max-length mode: config.residual_multiplier = {config.residual_multiplier} but "
                f"{name} has no residual_multiplier attribute the fused layer could apply")
    rope = getattr(config, "rope_parameters", None)
    rope = rope if isinstance(rope, dict) else {}
    for key, neutral in ROPE_NEUTRAL.items():
        if rope.get(key) not in (None, 0, 0.0):
            return (f"max-length mode: config.rope_parameters[{key!r}] = {rope[key]} scales "
                    "the queries inside the attention, which the fused layer does not "
                    "reproduce; train this model without --mlp-tile/--head-chunk")
    for key, neutral in CONFIG_NEUTRAL.items():
        if hasattr(config, key) and not _neutral(getattr(config, key), neutral):
            return (f"max-length mode: config.{key} = {getattr(config, key)} (neutral: {neutral}) "
                    "changes the decoder layer's computation, which the fused layer does not "
                    "reproduce; train this model without --mlp-tile/--head-chunk")
    return None


def state_carrying_layers(module: nn.Module) -> list[str]:
    """The classes of ``module``'s sub-modules that carry a state along the sequence (a
    hybrid's recurrent mixers and convolutions): modules with a layer index, not attention,
    that list kernel functions (as integrations.hf_recurrent.stateful_layers finds them;
    memory sits below integrations). Max-length mode must never take one for attention or for
    a per-token part."""
    return sorted({type(m).__name__ for m in module.modules()
                   if not hasattr(m, "is_causal") and isinstance(getattr(m, "layer_idx", None), int)
                   and isinstance(m.__dict__.get("_kernel_funcs"), dict) and m._kernel_funcs})
