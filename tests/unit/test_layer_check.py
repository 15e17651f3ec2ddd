"""Max-length mode verifies each decoder layer's shape and settings (easy_context.memory.
layer_check) and refuses, naming the module, attribute or config entry, what the fused layer
does not reproduce. Exactness of what it accepts: tests/dist/test_maxlen.py."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from easy_context.memory.layer_check import fused_layer_mismatch
from easy_context.memory.maxlen import (apply_max_length, final_norm, layer_paths, path_for,
                                       unsupported_reason)
from easy_context.utils.decoder import decoder_of

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=128, attention_dropout=0.0)


def _model(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _paths(model, path: str = "auto") -> list[str]:
    return [path_for(layer, model, path) for layer in model.model.layers]


def _fused_reason(model) -> str | None:
    """Why the fused layer does not fit (the first layer it refuses), or None."""
    return next((p for p in _paths(model, "fused") if p != "fused"), None)


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}), ("granite", dict(residual_multiplier=0.5, attention_multiplier=0.1)),
    ("smollm3", dict(no_rope_layers=[1, 0], pad_token_id=0)), ("qwen3", {})])
def test_llama_shaped_layers_are_accepted(model_type, overrides):
    model = _model(model_type, **overrides)
    assert unsupported_reason(model) is None
    assert set(_paths(model)) == {"fused"}


# generic: the layer's own forward runs them (max-length mode's generic path; Falcon-H1's
# Mamba-2 mixer whole, beside its head-chunked attention); refused: what the generic path
# cannot redo either (dropout drawn again in the recompute)
REFUSED_TOO = {"seed_oss": "dropout"}
# the final norm under another name than ``norm``: refused by layer_paths, whatever the layers
OTHER_FINAL_NORM = "applies the decoder's final norm"


@pytest.mark.parametrize("model_type,overrides,named", [
    # Cohere's parallel block: attention and MLP both read one norm of x (no second norm)
    ("cohere", {}, "CohereDecoderLayer has ['input_layernorm', 'mlp', 'self_attn']"),
    ("olmo", dict(clip_qkv=8.0), "config.clip_qkv = 8.0"),  # OLMo clamps q, k and v
    # Seed-OSS drops out of both branches (its defaults: 0.1)
    ("seed_oss", dict(attention_dropout=0.1, residual_dropout=0.1), "attention_dropout = 0.1"),
    ("falcon_h1", {}, "FalconH1Mixer"),  # a Mamba-2 mixer beside attention (recurrent_reason)
    ("gemma2", {}, "pre_feedforward_layernorm"),  # Gemma 2's extra norms
    # its global layers skip RoPE and drop the window: told by is_sliding, unknown here
    ("exaone_moe", dict(sliding_window=4, pad_token_id=0), "ExaoneMoeAttention.s"),
    ("flint", dict(sliding_window=4), "skip RoPE"),  # full-attention layers are NoPE
    ("ministral3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                         "llama_4_scaling_beta": 0.1,
                                         "original_max_position_embeddings": 16}),
     "llama_4_scaling_beta"),
])
def test_layers_the_fused_layer_does_not_reproduce_are_refused(model_type, overrides, named):
    model = _model(model_type, **overrides)
    reason = _fused_reason(model)
    assert reason is not None and named in reason, reason
    with pytest.raises(ValueError, match="fuse|max-length mode"):
        apply_max_length(model, 4, 2, path="fused")
    # without the fused layer: the generic path, or a refusal of its own
    auto = unsupported_reason(model)
    if model_type in REFUSED_TOO:
        assert auto is not None and REFUSED_TOO[model_type] in auto, auto
    else:
        assert set(_paths(model)) == {"generic"}, _paths(model)
        assert auto is None or OTHER_FINAL_NORM in auto, auto


def test_an_unknown_child_module_is_refused():
    model = _model("llama")
    model.model.layers[1].extra_norm = nn.LayerNorm(32)
    reason = _fused_reason(model)
    assert reason is not None and "extra_norm" in reason


def test_an_unknown_child_of_the_attention_is_refused():
    model = _model("llama")
    model.model.layers[0].self_attn.gate = nn.Linear(32, 4)
    reason = _fused_reason(model)
    assert reason is not None and "gate" in reason


@pytest.mark.parametrize("where,attr,value,named", [
    ("layer", "scale_depth", 1.4, "LlamaDecoderLayer.scale_depth = 1.4"),  # MiniCPM-style
    ("layer", "mlp_beta_factor", 2.0, "mlp_beta_factor = 2.0 (neutral: 1.0)"),  # MiniMax
    ("attn", "v_scale", 0.7, "v_scale = 0.7"),  # MiMo-V2
    ("attn", "attn_temperature_tuning", True, "attn_temperature_tuning = True"),
])
def test_unknown_or_non_neutral_settings_are_refused_by_name(where, attr, value, named):
    model = _model("llama")
    layer = model.model.layers[0]
    setattr(layer if where == "layer" else layer.self_attn, attr, value)
    reason = fused_layer_mismatch(layer, model.config)
    assert reason is not None and named in reason, reason


def test_neutral_settings_and_own_parameters():
    model = _model("llama")
    layer = model.model.layers[0]
    layer.mlp_alpha_factor = 1  # neutral: computes the plain shape
    assert fused_layer_mismatch(layer, model.config) is None
    layer.register_buffer("layer_scale", torch.ones(32))
    assert "layer_scale" in fused_layer_mismatch(layer, model.config)


def test_a_projection_with_its_own_forward_is_refused():
    class Scaled(nn.Linear):  # e.g. a quantized or adapter layer: weight and bias are not all
        def forward(self, x):
            return super().forward(x) * 2

    model = _model("llama")
    attn = model.model.layers[0].self_attn
    old = attn.v_proj
    attn.v_proj = Scaled(old.in_features, old.out_features, bias=False)
    reason = _fused_reason(model)
    assert reason is not None and "v_proj" in reason and "Scaled" in reason


def test_a_layer_that_computes_something_else_is_refused_by_the_probe():
    """No attribute, child or config entry shows it: the layer's own forward on a few tokens
    against the fused computation does."""
    model = _model("llama")
    layer = model.model.layers[1]
    plain = layer.forward

    def forward(hidden_states, *args, **kwargs):  # a branch the fused layer does not know
        return plain(hidden_states, *args, **kwargs) + 0.05 * hidden_states.tanh()

    layer.forward = forward
    assert fused_layer_mismatch(layer, model.config) is None  # the structure looks right
    reason = _fused_reason(model)
    assert reason is not None and "LlamaDecoderLayer's own forward and the fused layer differ" \
        in reason, reason
    with pytest.raises(ValueError, match="differ by"):
        apply_max_length(model, 4, 2, path="fused")
    assert _paths(model) == ["fused", "generic"]  # the generic path runs that forward


@pytest.mark.parametrize("model_type,overrides,layer", [
    ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8), "Qwen3NextGatedDeltaNet"),
    ("granitemoehybrid", dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8,
                              mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
                              num_local_experts=0, shared_intermediate_size=64),
     "GraniteMoeHybridMambaLayer"),
    ("lfm2", dict(layer_types=["conv", "full_attention"], conv_L_cache=4,
                  block_auto_adjust_ff_dim=False), "Lfm2ShortConv"),
])
def test_recurrent_layers_take_the_generic_path(model_type, overrides, layer):
    # a hybrid's recurrent mixer is never fused or tiled as if it were attention or per-token:
    # its layer takes the generic path (the mixer whole, the MLP tiled: exactness in
    # tests/dist/test_maxlen_hybrid.py); the fused layer, forced, refuses it by name
    model = _model(model_type, **overrides)
    assert set(_paths(model)) == {"generic"}, _paths(model)
    auto = unsupported_reason(model)
    assert auto is None or OTHER_FINAL_NORM in auto, auto  # LFM2's is embedding_norm
    reason = _fused_reason(model)
    assert reason is not None and layer in reason and "carry state along the sequence" in reason
    with pytest.raises(ValueError, match=f"carry state along the sequence|{OTHER_FINAL_NORM}"):
        apply_max_length(model, 4, 2, path="fused")


def test_layers_reusing_another_layers_kv_take_the_generic_path():
    """Gemma 4's per-layer inputs go through the generic path's recompute (inputs of it), and
    so do the K/V a layer stores for later layers (num_kv_shared_layers > 0): outputs of the
    storing layer's autograd function and inputs of the reading layers' (they were refused;
    tests/dist/test_maxlen.py::test_layers_sharing_kv checks the gradients)."""
    assert unsupported_reason(_model("gemma4_text", pad_token_id=0, hidden_size_per_layer_input=8,
                                     vocab_size_per_layer_input=97)) is None
    model = _model("gemma4_text", pad_token_id=0, num_kv_shared_layers=1, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "full_attention"])
    assert unsupported_reason(model) is None
    assert layer_paths(model) == ["generic"] * 3


def test_a_layer_reusing_kv_handed_no_mapping_is_refused():
    """A layer that reads another layer's K/V but is called without the mapping holding them
    (shared_kv_states) has nothing whose gradient max-length mode could route: a ValueError
    naming the layer, not a KeyError or a silent gradient loss."""
    model = _model("gemma4_text", pad_token_id=0, num_kv_shared_layers=1, num_hidden_layers=2,
                   layer_types=["full_attention", "full_attention"])
    apply_max_length(model, 4, 2)
    layer = model.model.layers[1]
    x = torch.randn(1, 6, model.config.hidden_size, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(6)[None], "full_attention")
    with pytest.raises(ValueError, match="reuses another layer's keys and values"):
        layer(x, None, position_embeddings=cos_sin, attention_mask=None)


@pytest.mark.parametrize("model_type,norm,overrides", [
    ("phi", "final_layernorm", {}), ("llama", "norm", {}),
    ("gpt2", "ln_f", dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))])
def test_the_final_norm_is_found_by_what_it_is(model_type, norm, overrides):
    """Max-length mode applies the decoder's final norm inside the loss, whatever its name
    (it refused every decoder whose norm was not called ``norm``)."""
    model = _model(model_type, pad_token_id=0, **overrides)
    assert unsupported_reason(model) is None
    assert final_norm(model) is getattr(decoder_of(model), norm)


def test_a_final_norm_with_weights_after_it_is_not_folded():
    """OPT projects the normed states out (project_out) before the head: nothing is folded,
    the decoder applies its own norm and projection, and the loss takes their output."""
    model = _model("opt", pad_token_id=0, word_embed_proj_dim=16)
    assert decoder_of(model).project_out is not None and final_norm(model) is None


def test_a_decoder_that_changes_its_final_norms_output_is_refused():
    """The loss applies the folded final norm to what the decoder returns: a decoder that
    does more after that norm (here a hook doubling its output) would have the norm applied
    to the changed states (the old code did so silently); it is refused at the step."""
    import easy_context as ec
    from transformers.modeling_outputs import BaseModelOutputWithPast

    model = _model("llama")
    ec.apply_sequence_parallel(model, "local")
    apply_max_length(model, 4, 2)
    ids = torch.randint(0, 97, (1, 8))
    pos = torch.arange(8)[None]
    ec.causal_lm_loss(model, ids, pos, ids, chunked=True)  # as it is: runs
    decoder_of(model).register_forward_hook(
        lambda m, a, out: BaseModelOutputWithPast(last_hidden_state=out.last_hidden_state * 2))
    with pytest.raises(ValueError, match="changes the output of its final norm"):
        ec.causal_lm_loss(model, ids, pos, ids, chunked=True)
