"""Model shapes for the memory planner: a built-in table of common models, or a local config.

Only what memory depends on is kept: widths, depth, heads, vocabulary, whether the output
head shares the embedding's weights, and biases. The built-in values are copied from the
models' public ``config.json`` files (Hugging Face Hub), so the planner works offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer with Llama-style blocks (RMSNorm, RoPE, gated MLP)."""

    name: str
    hidden: int
    """hidden_size"""
    layers: int
    """num_hidden_layers"""
    heads: int
    """num_attention_heads (query heads)"""
    kv_heads: int
    """num_key_value_heads (GQA: fewer than heads)"""
    intermediate: int
    """intermediate_size of the gated MLP (gate, up, down projections)"""
    vocab: int
    """vocab_size"""
    tied_embeddings: bool = False
    """tie_word_embeddings: the lm_head is the embedding matrix (one copy of V x hidden)"""
    head_dim: int | None = None
    """per-head width; None means hidden // heads"""
    qkv_bias: bool = False
    """biases on the q/k/v projections (Qwen2)"""
    v_head_dim: int | None = None
    """the value head width where it differs from the query/key one (multi-head latent
    attention: DeepSeek-V3's 192 / 128); None: head_dim"""
    kinds: tuple = ()
    """((plan.layers.LayerKind, count), ...) of the layers; (): every layer a Llama one (global
    attention, dense MLP)"""
    recurrent: object = None
    """plan.layers.RecurrentShape of the recurrent layers (None: there are none)"""
    moe: object = None
    """plan.layers.MoEShape of the MoE layers' experts (None: none)"""
    window: int | None = None
    """tokens a sliding-window layer's query sees at most (sliding_window)"""
    attention_chunk: int | None = None
    """tokens of a chunked-attention layer's chunks (Llama 4's attention_chunk_size)"""
    q_lora_rank: int | None = None
    """multi-head latent attention (DeepSeek-V2/V3): the query's low-rank width (None: a
    full q_proj)"""
    kv_lora_rank: int | None = None
    """multi-head latent attention: the compressed key/value width (None: not MLA)"""
    rope_head_dim: int | None = None
    """multi-head latent attention: the RoPE part of the query/key head (shared by the heads
    in the compressed projection)"""
    gated_mlp: bool = True
    """gate, up and down projections (False: up and down only, Nemotron-H)"""
    layer_paths: tuple = ()
    """((LayerKind, path), ...): how max-length mode runs each kind of layer, as
    easy_context.memory.maxlen.path_for decides it on the model built from the config (on the
    meta device): "fused", "generic", or the reason it refuses; (): not read from a model
    (:meth:`maxlen_path` decides from the shape)"""
    layer_norms: int = 2
    """normalisations directly in a decoder layer (Gemma 2/3's sandwich norms: 4)"""
    qk_norm: bool = False
    """per-head norms of q and k (Gemma 3, Qwen 3)"""

    def maxlen_path(self, kind) -> str:
        """How max-length mode runs a layer of ``kind``: "fused", "generic" or a reason it
        refuses: from :attr:`layer_paths` (read from the built model), else the fused layer
        for Llama-shaped layers of a fusable shape, the generic one for others (recurrent
        mixers included: the generic path runs them whole, plan/generic.py prices them)."""
        for k, path in self.layer_paths:
            if k == kind:
                return path
        return "fused" if self.fusable and self.layer_norms == 2 else "generic"

    def maxlen_paths(self) -> list[tuple[object, str]]:
        """[(LayerKind, path)] of every kind of layer (:meth:`maxlen_path`)."""
        return [(k, self.maxlen_path(k)) for k, _ in self.layer_counts()]

    def describe_paths(self) -> str:
        """One line: the path max-length mode takes for each kind of layer."""
        def name(k) -> str:
            parts = [{"global": "attention", "window": "sliding-window attention",
                      "chunk": "chunked attention"}.get(k.attention, "")]
            parts += ["recurrent" if k.recurrent else "", {"dense": "MLP", "moe": "experts"}
                      .get(k.mlp, "")]
            return " + ".join(p for p in parts if p)

        def say(p: str) -> str:
            return p if p in ("fused", "generic") else f"not run ({p})"

        return "max-length mode's layers: " + "; ".join(
            f"{name(k)}: {say(p)}" for k, p in self.maxlen_paths())

    @property
    def tileable(self) -> bool:
        """Whether max-length mode runs (and the planner plans) every layer, on either path."""
        return all(p in ("fused", "generic") for _, p in self.maxlen_paths())

    def layer_counts(self) -> list[tuple[object, int]]:
        """[(LayerKind, count)] over the layers (plan/layers.py)."""
        from .layers import LLAMA_LAYER

        return list(self.kinds) or [(LLAMA_LAYER, self.layers)]

    def count(self, what) -> int:
        """Layers of which ``what(kind)`` holds."""
        return sum(n for k, n in self.layer_counts() if what(k))

    @property
    def fusable(self) -> bool:
        """Whether max-length mode's fused layers (plan/fused.py: attention, then a dense gated
        MLP, in every layer) describe this model: not for recurrent layers, experts, MLA or
        MLP-only layers, which the fused layer does not run."""
        return self.kv_lora_rank is None and self.gated_mlp and all(
            k.attention is not None and not k.recurrent and k.mlp == "dense"
            for k, _ in self.layer_counts())

    @property
    def attention_layers(self) -> int:
        return self.count(lambda k: k.attention is not None)

    @property
    def recurrent_layers(self) -> int:
        return self.count(lambda k: k.recurrent)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def attention_dims(self):
        """(heads, kv_heads, head_dim), as the methods' cost functions take them. With a value
        head dim of its own, the mean of the two: every saved or sent pair (q and the output,
        k and v) is then counted exactly, as (heads or kv_heads) x (qk + v head dims)."""
        from ..parallel import AttentionDims

        hd = self.hd if self.v_head_dim in (None, self.hd) else (self.hd + self.v_head_dim) // 2
        return AttentionDims(self.heads, self.kv_heads, hd)

    def attention_params(self) -> int:
        """Parameters of one attention block: q/k/v/o projections (and q/k/v biases); with
        multi-head latent attention, its low-rank projections and their norms."""
        h, hd = self.hidden, self.hd
        vd = self.v_head_dim or hd
        if self.kv_lora_rank:  # MLA: q (low rank or not), kv_a (latent + rope), kv_b, o
            r, rope = self.kv_lora_rank, self.rope_head_dim or 0
            q = (h * self.heads * hd if not self.q_lora_rank else
                 self.q_lora_rank * (h + 1 + self.heads * hd))
            return (q + h * (r + rope) + r + r * self.heads * (hd - rope + vd)
                    + self.heads * vd * h)
        attn = h * self.heads * hd + h * self.kv_heads * (hd + vd) + self.heads * vd * h
        if self.qkv_bias:
            attn += self.heads * hd + self.kv_heads * (hd + vd)
        return attn

    def kind_params(self, kind) -> int:
        """Parameters of one layer of ``kind`` (plan.layers.LayerKind): its mixers, MLP or
        experts, and one RMSNorm per block."""
        h = self.hidden
        p = self.attention_params() if kind.attention else 0
        if kind.recurrent:
            p += self.recurrent.params(h)
        if kind.mlp == "dense":
            p += (3 if self.gated_mlp else 2) * h * self.intermediate
        elif kind.mlp == "moe":
            p += self.moe.params(h)
        return p + h * (bool(kind.attention or kind.recurrent) + bool(kind.mlp))

    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what a sharded engine gathers at once);
        a Llama layer: q/k/v/o projections, gated MLP, two RMSNorms."""
        return max(self.kind_params(k) for k, _ in self.layer_counts())

    def embedding_params(self) -> int:
        """Input embedding plus the output head (once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def num_params(self) -> int:
        layers = sum(n * self.kind_params(k) for k, n in self.layer_counts())
        return layers + self.embedding_params() + self.hidden  # final norm



def linear_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear module of a decoder layer."""
    h, q, kv, i = shape.hidden, shape.heads * shape.hd, shape.kv_heads * shape.hd, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

def _s(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied=False, **kw) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, **kw)


BUILTIN: dict[str, ModelShape] = {s.name.lower(): s for s in (
    _s("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000),
    _s("Llama-2-13B", 5120, 40, 40, 40, 13824, 32000),
    _s("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000),
    _s("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256),
    _s("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256),
    _s("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, tied=True, head_dim=64),
    _s("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, tied=True, head_dim=128),
    _s("Mistral-7B", 4096, 32, 32, 8, 14336, 32000),
    _s("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, tied=True, qkv_bias=True),
    _s("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    _s("Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, qkv_bias=True),
    _s("Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, qkv_bias=True),
    _s("TinyLlama-1.1B", 2048, 22, 32, 4, 5632, 32000),
)}
# Names people type for the same shapes (Llama 3.1 has Llama 3's shapes).
_ALIASES = {"llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b",
            "meta-llama-3-8b": "llama-3-8b", "meta-llama-3-70b": "llama-3-70b",
            "meta-llama-3.1-8b": "llama-3-8b", "meta-llama-3.1-70b": "llama-3-70b",
            "mistral-7b-v0.1": "mistral-7b", "qwen2.5-7b-instruct": "qwen2.5-7b"}


def _key(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1]  # drop "meta-llama/"
    for suffix in ("-hf", "-chat", "-instruct"):
        if key.endswith(suffix) and key[: -len(suffix)] in BUILTIN:
            key = key[: -len(suffix)]
    return _ALIASES.get(key, key)


# how far the planner's parameter count may be from the model's own before the planner refuses
# it: its layer model (Llama-style attention, gated MLPs, the mixers of plan/layers.py) leaves
# out small terms (q/k norms, routers' biases, Qwen3-Next's output gate: under 1% on the
# full-size configs); a larger gap means layers it does not model (ungated MLPs, shared blocks)
PARAM_TOLERANCE = 0.05


def shape_from_config(config, name: str = "config", check: bool = True) -> ModelShape:
    """A ModelShape from a transformers config object (its text part for multimodal ones):
    its layers by kind (plan/layers.py: attention, sliding-window, recurrent, experts).

    Raises a ValueError, saying why, when the planner cannot plan the family: a config
    without the fields its layer model reads (GPT-2-style ``n_embd``, per-layer head dims),
    a layer kind whose sizes it cannot read, or (``check``) a model whose parameters, counted
    on the meta device (no memory), are more than PARAM_TOLERANCE from the planner's count."""
    try:
        shape = _read_config(config, name)
        shape.num_params()  # every size a number
    except ValueError as e:
        if str(e).startswith(f"{name}:"):  # the planner's own refusal
            raise
        raise ValueError(f"{name}: the planner cannot read this config's layer shapes ({e})") from e
    except Exception as e:  # noqa: BLE001 - AttributeError, TypeError, transformers' per-layer errors
        raise ValueError(
            f"{name}: the planner cannot read this config's layer shapes ({type(e).__name__}: "
            f"{str(e)[:160]}); it plans decoders with Llama-style fields (hidden_size, "
            "num_attention_heads, intermediate_size, ...) and one size per layer kind") from e
    if check:
        check_against_model(config, shape)
        shape = with_model_facts(config, shape)
    return shape


def _meta_model(config):
    """``config``'s causal LM built on the meta device (no memory), or None where transformers
    cannot build it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an unknown or broken family: nothing to read from it
        return None


def _rank(path: str) -> int:
    return {"fused": 0, "generic": 1}.get(path, 2)


def with_model_facts(config, shape: ModelShape) -> ModelShape:
    """``shape`` with what the built model tells and the config does not: each layer kind's
    max-length path (easy_context.memory.maxlen.path_for, the structural part of its decision:
    the numerical probe needs weights) and the norms in a layer."""
    from ..memory.maxlen import decoder_layers, path_for
    from .layers import kind_of_each_layer

    model = _meta_model(config)
    if model is None:
        return shape
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = [str(t) for t in (getattr(c, "layer_types", None)
                              or getattr(c, "layers_block_type", None) or [])]
    try:
        layers = decoder_layers(model)
        kinds = kind_of_each_layer(c, types)
    except (ValueError, AttributeError):
        return shape
    if len(kinds) != len(layers):
        return shape
    paths: dict = {}
    for kind, layer in zip(kinds, layers):
        try:
            path = path_for(layer)
        except Exception as e:  # noqa: BLE001 - a layer the structural checks cannot read
            path = f"max-length mode cannot read {type(layer).__name__}: {e}"
        # a kind takes the generic path if any of its layers does; a refusal wins
        if _rank(path) > _rank(paths.get(kind, "fused")) or kind not in paths:
            paths[kind] = path
    norms = max(sum(1 for m in layer.children() if "norm" in type(m).__name__.lower())
                for layer in layers)
    qk = any(getattr(getattr(layer, "self_attn", None), "q_norm", None) is not None
             for layer in layers)
    return replace(shape, layer_paths=tuple(paths.items()), layer_norms=norms or 2, qk_norm=qk)


def model_parameters(config) -> int | None:
    """Parameters of ``config``'s decoder and output head, counted on the meta device (no
    memory), or None where transformers cannot build it."""
    from ..utils.decoder import decoder_of

    model = _meta_model(config)
    if model is None:
        return None
    n = sum(p.numel() for p in decoder_of(model).parameters())
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and (embed is None or head.weight is not embed.weight):
        n += head.weight.numel()
    return n


def check_against_model(config, shape: ModelShape) -> None:
    """Refuse a family whose parameters the planner counts more than PARAM_TOLERANCE off the
    model's own (its layers are not what the planner models, so its memory would be too)."""
    real = model_parameters(config)
    if real is None or not real:
        return
    planned = shape.num_params()
    if abs(planned - real) > PARAM_TOLERANCE * real:
        raise ValueError(
            f"{shape.name}: the planner counts {planned / 1e6:,.1f}M parameters where the model "
            f"has {real / 1e6:,.1f}M ({planned / real - 1:+.0%}): its layers are not what the "
            "planner models (Llama-style attention or MLA, gated MLPs or experts, gated "
            "DeltaNet / Mamba-2 / short-conv mixers), so its memory estimate would be wrong too")


def _read_config(config, name: str) -> ModelShape:
    from .layers import gated_mlp, layer_kinds, moe_from_config, recurrent_from_config

    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2): head_dim names the RoPE part only;
    # the attention runs on qk_nope + qk_rope wide queries/keys and v_head_dim wide values
    mla = getattr(c, "qk_nope_head_dim", None) is not None and getattr(c, "v_head_dim", None)
    types = [str(t) for t in (getattr(c, "layer_types", None)
                              or getattr(c, "layers_block_type", None) or [])]
    kinds = layer_kinds(c, types)
    recurrent = None
    if any(k.recurrent for k, _ in kinds):
        recurrent = recurrent_from_config(c)
        if recurrent is None:
            other = sorted(set(types) - {"full_attention", "sliding_attention", "attention",
                                         "chunked_attention", "mlp", "moe"})
            raise ValueError(
                f"{name}: the planner cannot read the sizes of its {', '.join(other) or 'recurrent'} "
                "layers: it plans attention (full, sliding-window, chunked, MLA) and gated "
                "DeltaNet, Mamba-2 and short-conv layers, not Mamba-1, sparse-indexed or other "
                "mixers")
    moe = moe_from_config(c) if any(k.mlp == "moe" for k, _ in kinds) else None
    window = chunk = None
    if any(k.attention == "window" for k, _ in kinds):
        window = getattr(c, "sliding_window", None)
    if any(k.attention == "chunk" for k, _ in kinds):
        chunk = getattr(c, "attention_chunk_size", None)
    # Llama 4: the dense layers' MLP is intermediate_size_mlp (intermediate_size: experts')
    intermediate = (getattr(c, "intermediate_size_mlp", None)
                    or getattr(c, "intermediate_size", None))
    if intermediate is None and moe is not None and all(k.mlp != "dense" for k, _ in kinds):
        intermediate = 0  # experts in every layer: no dense MLP
    if not isinstance(intermediate, int):  # None (GPT-Neo: 4 x hidden), a list per layer
        raise ValueError(f"{name}: the planner reads one intermediate_size for the dense MLPs; "
                         f"this config gives {intermediate!r}")
    if getattr(c, "block_auto_adjust_ff_dim", False):  # LFM2 sizes its MLP from this
        intermediate = int(2 * intermediate / 3)
        if getattr(c, "block_ffn_dim_multiplier", None):
            intermediate = int(c.block_ffn_dim_multiplier * intermediate)
        m = getattr(c, "block_multiple_of", 1) or 1
        intermediate = m * -(-intermediate // m)
    n_layers = len(types) if types else c.num_hidden_layers
    return ModelShape(
        name=name, hidden=c.hidden_size, layers=n_layers, heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        intermediate=intermediate, vocab=c.vocab_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=(c.qk_nope_head_dim + c.qk_rope_head_dim) if mla else getattr(c, "head_dim", None),
        v_head_dim=c.v_head_dim if mla else None,
        # Qwen2 puts biases on q/k/v without a config flag; others say attention_bias.
        qkv_bias=bool(getattr(c, "attention_bias", False)) or getattr(c, "model_type", "") == "qwen2",
        kinds=kinds, recurrent=recurrent, moe=moe, window=window, attention_chunk=chunk,
        gated_mlp=gated_mlp(c),
        q_lora_rank=getattr(c, "q_lora_rank", None) if mla else None,
        kv_lora_rank=getattr(c, "kv_lora_rank", None) if mla else None,
        rope_head_dim=c.qk_rope_head_dim if mla else None)


def load_shape(name_or_path: str) -> ModelShape:
    """A built-in shape by name (case-insensitive, "meta-llama/Llama-2-7b-hf" works), or the
    shape of a local Hugging Face model folder / config.json (read offline)."""
    if os.path.isdir(name_or_path) and not os.path.exists(os.path.join(name_or_path, "config.json")):
        raise FileNotFoundError(f"model folder {name_or_path} has no config.json")
    if os.path.exists(name_or_path):
        from transformers import AutoConfig

        path = name_or_path
        if os.path.isfile(path):  # a bare config.json: AutoConfig wants its folder
            path = os.path.dirname(os.path.abspath(path))
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError):  # an unknown model_type: read the fields directly
            with open(os.path.join(path, "config.json")) as f:
                from types import SimpleNamespace
                config = SimpleNamespace(**json.load(f))
        return shape_from_config(config, name=os.path.basename(os.path.normpath(path)))
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model folder {name_or_path} does not exist")
    key = _key(name_or_path)
    if key not in BUILTIN:
        known = ", ".join(s.name for s in BUILTIN.values())
        raise ValueError(f"unknown model {name_or_path!r}: not a local folder or config.json, "
                         f"and not a built-in shape ({known})")
    return BUILTIN[key]


def with_overrides(shape: ModelShape, **kw) -> ModelShape:
    """The same shape with some fields changed (None values are ignored)."""
    return replace(shape, **{k: v for k, v in kw.items() if v is not None})
