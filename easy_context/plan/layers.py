"""What each decoder layer of a model is made of, for the planner: its token mixer (global or
sliding-window attention, a recurrent mixer, or both side by side) and its channel mixer (a
dense MLP, a mixture of experts, or none), read from the config.

A plain Llama is ``L`` layers of (global attention, dense MLP); hybrids interleave recurrent
layers (Qwen3-Next's gated DeltaNet, Granite 4 / Bamba / Nemotron-H's Mamba-2, LFM2's short
convolutions), Gemma 3 and Llama 4 window or chunk most of their attention layers, MoE models
swap the MLP of some layers for experts, and Nemotron-H puts the mixer and the MLP in layers
of their own. Counts by kind are what memory and traffic depend on (every layer of a kind
costs the same).

The recurrent layers' own arithmetic (the state each exchanges, its bytes per step) is
easy_context.recurrent.mixer's (``Mixer.dims``, ``Mixer.comm_bytes``); this module only reads
their sizes from the config. A token-mixing layer kind whose sizes it cannot read (Mamba-1,
or a kind it does not know) is refused by name, as training refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer's make-up."""

    attention: str | None = "global"  # "global", "window" (sliding), "chunk" (chunked), None
    recurrent: bool = False  # a recurrent mixer (next to the attention in "hybrid" layers)
    mlp: str | None = "dense"  # "dense", "moe", None (Nemotron-H's mixer-only layers)


LLAMA_LAYER = LayerKind()


@dataclass(frozen=True)
class RecurrentShape:
    """The recurrent layers' sizes (every one the same in the families we know)."""

    kind: str
    """a key of easy_context.recurrent.mixer.MIXERS"""
    sizes: tuple[tuple[str, int], ...]
    """keyword arguments of the mixer's ``dims``"""
    projection: int
    """output width of the layer's input projection(s), from the hidden size"""
    inner: int
    """width of the mixed output (out_proj: inner -> hidden)"""
    heads: int
    """recurrent heads (the value heads of the delta rule, Mamba-2's heads; 0 for a conv)"""
    value_width: int
    """per-token value elements through the kernel, over all heads (d_v, Mamba-2's head dim)"""
    key_width: int
    """per head, what the identity block appends to the values to read off the transition
    (d_k of the delta rule, Mamba-2's state size; 0 for a conv)"""
    conv_bias: bool = False
    gated_norm: bool = True  # a (gated) RMSNorm of width ``inner`` before out_proj
    per_head: int = 3  # parameters per head: A_log, dt_bias (and Mamba-2's D)
    proj_bias: bool = False  # biases on the in/out projections (LFM2)
    norm_width: int | None = None  # the gated norm's weight (None: inner; per head: d_v)

    def mixer(self):
        from ..recurrent.mixer import MIXERS

        return MIXERS[self.kind]

    def dims(self):
        """The mixer's MixerDims (easy_context.recurrent.mixer)."""
        return self.mixer().dims(**dict(self.sizes))

    def params(self, hidden: int) -> int:
        """Parameters of one recurrent mixer (projections, conv, per-head decays, norm)."""
        d = self.dims()
        conv = d.conv_channels * d.conv_kernel + (d.conv_channels if self.conv_bias else 0)
        bias = self.projection + hidden if self.proj_bias else 0
        return (hidden * self.projection + conv + self.per_head * self.heads
                + self.inner * hidden + bias
                + ((self.norm_width or self.inner) if self.gated_norm else 0))

    def state_elements(self) -> int:
        """float32 elements of one sequence's recurrent state over all heads (what a
        generation cache keeps): H x d_k x d_v of the delta rule, H x head_dim x d_state of
        Mamba-2; 0 for a conv (its K-1 inputs are in ``halo_elements``)."""
        return self.heads and self.value_width * self.key_width

    def halo_elements(self) -> int:
        """Elements of the causal conv's K-1 previous inputs, per sequence."""
        d = self.dims()
        return d.conv_channels * max(d.conv_kernel - 1, 0)


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP (gated experts, as every family here has)."""

    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # the shared expert(s)' total width (0: none)
    matrices: int = 3  # per expert: gate, up, down (2: Nemotron-H's ungated up, down)

    def params(self, hidden: int) -> int:
        return (self.matrices * hidden * (self.expert_intermediate * self.experts
                                          + self.shared_intermediate) + hidden * self.experts)

    def active_intermediate(self) -> int:
        """Intermediate width each token goes through (its top-k experts and the shared)."""
        return self.top_k * self.expert_intermediate + self.shared_intermediate


def _first(c, *names, default=None):
    for n in names:
        v = getattr(c, n, None)
        if v is not None:
            return v
    return default


def recurrent_from_config(c) -> RecurrentShape | None:
    """The recurrent mixer of text config ``c`` from its fields, or None when it has none
    we know (the caller refuses a token-mixing layer kind then)."""
    h = c.hidden_size
    if getattr(c, "linear_key_head_dim", None):  # gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo)
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        k = getattr(c, "linear_conv_kernel_dim", 4)
        return RecurrentShape("gated_delta_net", (("k_heads", hk), ("v_heads", hv), ("dk", dk),
                                                  ("dv", dv), ("conv_kernel", k)),
                              projection=2 * hk * dk + 2 * hv * dv + 2 * hv, inner=hv * dv,
                              heads=hv, value_width=hv * dv, key_width=dk, per_head=2,
                              norm_width=dv)
    heads = _first(c, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    if heads:  # Mamba-2 (Granite 4, Bamba, Nemotron-H, Falcon-H1, Zamba2)
        state = _first(c, "mamba_d_state", "ssm_state_size")
        groups = _first(c, "mamba_n_groups", "n_groups", "mamba_ngroups", default=1)
        k = _first(c, "mamba_d_conv", "conv_kernel", default=4)
        inner = _first(c, "mamba_d_ssm") or int(_first(c, "mamba_expand", "expand", default=2) * h)
        head_dim = inner // heads
        return RecurrentShape("mamba2", (("heads", heads), ("head_dim", head_dim),
                                         ("groups", groups), ("state", state),
                                         ("conv_kernel", k)),
                              projection=2 * inner + 2 * groups * state + heads, inner=inner,
                              heads=heads, value_width=inner, key_width=state,
                              conv_bias=bool(_first(c, "mamba_conv_bias", "use_conv_bias",
                                                    default=True)),
                              gated_norm=getattr(c, "mamba_rms_norm", True) is not False)
    if getattr(c, "conv_L_cache", None):  # LFM2's gated short convolution
        return RecurrentShape("short_conv", (("channels", h), ("conv_kernel", c.conv_L_cache)),
                              projection=3 * h, inner=h, heads=0, value_width=h, key_width=0,
                              conv_bias=bool(getattr(c, "conv_bias", False)), gated_norm=False,
                              per_head=0, proj_bias=bool(getattr(c, "conv_bias", False)))
    return None


# layer_types entries (transformers 5.25 names them the same across families)
_WINDOW = {"sliding_attention": "window", "chunked_attention": "chunk"}
_GLOBAL = {"full_attention", "attention"}
_HYBRID = {"hybrid"}  # attention and a recurrent mixer in one layer (Falcon-H1, Zamba2)
_FFN_ONLY = {"mlp", "moe"}  # Nemotron-H: channel mixers as layers of their own


def _moe_layers(c, n: int) -> list[bool]:
    """Which of the n layers have experts instead of the dense MLP."""
    experts = _first(c, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return [False] * n
    if getattr(c, "moe_layers", None) is not None:  # Llama 4
        return [i in set(c.moe_layers) for i in range(n)]
    dense = set(getattr(c, "mlp_only_layers", None) or [])  # Qwen MoE
    first = getattr(c, "first_k_dense_replace", None) or 0  # DeepSeek
    step = getattr(c, "decoder_sparse_step", None) or getattr(c, "moe_layer_freq", None) or 1
    period = getattr(c, "expert_layer_period", None)  # Jamba
    offset = getattr(c, "expert_layer_offset", 0) or 0
    out = []
    for i in range(n):
        if period:
            out.append(i % period == offset)
        else:
            out.append(i not in dense and i >= first and (i + 1) % step == 0 if step > 1
                       else i not in dense and i >= first)
    return out


def moe_from_config(c) -> MoEShape | None:
    experts = _first(c, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return None
    inter = _first(c, "moe_intermediate_size", "intermediate_size", default=None)
    shared = _first(c, "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                    "shared_intermediate_size", default=0) or 0
    n_shared = getattr(c, "n_shared_experts", None)
    if n_shared and not getattr(c, "moe_shared_expert_intermediate_size", None):  # DeepSeek
        shared = n_shared * inter
    if getattr(c, "model_type", "").startswith("llama4"):  # one shared expert of the same width
        shared = inter
    return MoEShape(experts, _first(c, "num_experts_per_tok", "top_k", default=1), inter,
                    shared, 3 if gated_mlp(c) else 2)


def gated_mlp(c) -> bool:
    """Whether the MLPs are gated (gate, up, down). Nemotron-H's squared-ReLU MLPs and
    experts are not (up, down only); the config says so by that activation only."""
    return getattr(c, "mlp_hidden_act", None) != "relu2"


def layer_kinds(c, layer_types: list[str]) -> tuple[tuple[LayerKind, int], ...]:
    """(kind, count) of text config ``c``'s layers, from ``layer_types``
    (integrations.hf.config_layer_types); () for every layer a Llama one. Raises a
    ValueError for a token-mixing kind whose sizes are not known here."""
    kinds: dict[LayerKind, int] = {}
    for kind in kind_of_each_layer(c, layer_types):
        kinds[kind] = kinds.get(kind, 0) + 1
    if set(kinds) == {LLAMA_LAYER}:
        return ()
    return tuple(kinds.items())


def kind_of_each_layer(c, layer_types: list[str]) -> list[LayerKind]:
    """The LayerKind of each of text config ``c``'s layers, in order (see :func:`layer_kinds`)."""
    n = c.num_hidden_layers if not layer_types else len(layer_types)
    moe = _moe_layers(c, n)
    types = layer_types or ["full_attention"] * n
    if not layer_types and _first(c, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads"):
        types = ["hybrid"] * n  # Falcon-H1 without layer_types: both in every layer
    own_ffn = any(t in _FFN_ONLY for t in types)
    out = []
    for i, t in enumerate(types):
        mlp = "moe" if moe[i] else "dense"
        if t in _FFN_ONLY:
            kind = LayerKind(None, False, "moe" if t == "moe" else "dense")
        elif t in _GLOBAL or t in _WINDOW:
            kind = LayerKind(_WINDOW.get(t, "global"), False, None if own_ffn else mlp)
        elif t in _HYBRID:
            kind = LayerKind("global", True, None if own_ffn else mlp)
        else:  # a token-mixing layer that is not attention
            kind = LayerKind(None, True, None if own_ffn else mlp)
        out.append(kind)
    return out


__all__ = ["LLAMA_LAYER", "LayerKind", "MoEShape", "RecurrentShape", "kind_of_each_layer", "layer_kinds",
           "moe_from_config", "recurrent_from_config"]
