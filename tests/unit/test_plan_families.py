"""The planner plans every family from its config's layer shapes (issue 42), or refuses it:
tiny configs of Gemma 3 (sliding windows, head_dim != hidden / heads), DeepSeek-V3 (MLA,
experts), Qwen3-Next (gated DeltaNet, experts), Granite 4 hybrid (Mamba-2, experts), Llama 4
(chunked attention, experts in some layers, its dense layers' own MLP width), Phi-3 (fused
projections), Mixtral and LFM2 (its MLP width adjusted from the config) counted as the built
modules hold them; families whose layers it does not model are refused with the reason."""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from easy_context.plan import estimate_memory
from easy_context.plan.recompute import layer_flops_per_token
from easy_context.plan.shapes import load_shape, shape_from_config

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "gemma3_text": (dict(sliding_window=8, layer_types=["sliding_attention"] * 3
                         + ["full_attention"]), (4, 4, 0)),
    "deepseek_v3": (dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=1, topk_group=1, num_key_value_heads=4), (4, 4, 0)),
    "qwen3_next": (dict(layer_types=["linear_attention"] * 3 + ["full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, shared_expert_intermediate_size=16), (4, 1, 3)),
    "granitemoehybrid": (dict(layer_types=["mamba"] * 3 + ["attention"], mamba_n_heads=8,
                              mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
                              num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=64), (4, 1, 3)),
    "llama4_text": (dict(intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                         moe_layers=[1, 3], attention_chunk_size=8, interleave_moe_layer_step=2,
                         layer_types=["chunked_attention"] * 3 + ["full_attention"]), (4, 4, 0)),
    "phi3": (dict(head_dim=None), (4, 4, 0)),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), (4, 4, 0)),
    "lfm2": (dict(layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                  block_auto_adjust_ff_dim=True, block_multiple_of=16), (4, 1, 3)),
}


def _config(model_type: str, extra: dict):
    fields = {k: v for k, v in {**TINY, **extra}.items() if v is not None}
    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parameters_and_layers_as_built(model_type):
    extra, (layers, attention, recurrent) = FAMILIES[model_type]
    config = _config(model_type, extra)
    model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    shape = shape_from_config(config, model_type)
    # Qwen3-Next's attention output gate, q/k norms (Qwen3-Next, LFM2), Gemma's extra norms
    tol = {"qwen3_next": 0.04, "gemma3_text": 0.01, "lfm2": 0.002}.get(model_type, 0.0)
    assert abs(shape.num_params() - real) <= tol * real, (shape.num_params(), real)
    assert (shape.layers, shape.attention_layers, shape.recurrent_layers) == (
        layers, attention, recurrent)
    est = estimate_memory(shape, 64, 2, "zigzag_ring_attn", dtype="fp32", device="cpu")
    assert est.total > est.parameters > 0


def test_full_size_shapes():
    v3 = shape_from_config(AutoConfig.for_model("deepseek_v3"), "DeepSeek-V3", check=False)
    assert v3.num_params() / 1e9 == pytest.approx(671, rel=0.01)  # without the MTP layer
    assert (v3.hd, v3.v_head_dim, v3.kv_lora_rank) == (192, 128, 512)
    gemma = shape_from_config(AutoConfig.for_model("gemma3_text"), "Gemma-3", check=False)
    assert gemma.hd == 256 != gemma.hidden // gemma.heads and gemma.window == 4096
    llama4 = shape_from_config(AutoConfig.for_model("llama4_text"), "Llama-4", check=False)
    assert llama4.attention_chunk == 8192 and llama4.count(lambda k: k.mlp == "moe") == 48
    # chunked layers see their chunk, so attention costs far less than 48 global layers
    f = layer_flops_per_token(llama4, 1 << 20, 8)
    assert f["attention"] < 0.3 * 48 * 2 * (2**20 / 2) * llama4.heads * 2 * llama4.hd


@pytest.mark.parametrize("model_type, extra, match", [
    ("gpt2", None, "reads one intermediate_size"),  # n_embd, n_inner: GPT-2's names
    ("gemma3n_text", dict(), "reads one intermediate_size"),  # a width per layer
    ("gemma4_text", dict(), "cannot read this config's layer shapes"),  # per-layer head dims
    ("gpt_neox", dict(intermediate_size=128), "the planner counts"),  # ungated MLP
    ("zamba2", dict(layers_block_type=["mamba", "hybrid"], num_hidden_layers=2,
                    n_mamba_heads=8, mamba_d_state=8, mamba_ngroups=2,
                    head_dim=16), "the planner counts"),  # shared attention blocks
    ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, num_hidden_layers=2),
     "cannot read the sizes of its"),  # Mamba-1
])
def test_families_it_does_not_model_are_refused(model_type, extra, match):
    fields = (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97) if extra is None else
              {**{k: v for k, v in TINY.items() if k != "head_dim"}, **extra})
    with pytest.raises(ValueError, match=match):
        shape_from_config(AutoConfig.for_model(model_type, **fields), model_type)


def test_cli_refuses_with_the_reason(tmp_path, capsys):
    from easy_context.cli import main

    AutoConfig.for_model("gpt_neox", **{**TINY, "intermediate_size": 128}).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--devices", "2"]) != 0
    err = capsys.readouterr().err
    assert "easy-context plan: error:" in err and "the planner counts" in err
    _config("gemma3_text", FAMILIES["gemma3_text"][0]).save_pretrained(tmp_path / "g")
    assert load_shape(str(tmp_path / "g")).window == 8


def test_training_with_auto_tiles_falls_back_untiled_for_a_refused_family():
    """`train`'s default --mlp-tile/--head-chunk auto asks the planner; a family it refuses
    (here an ungated MLP) trains untiled instead of stopping the run."""
    import torch

    from easy_context.train.config import TrainConfig
    from easy_context.train.memory_mode import apply_memory_mode

    config = AutoConfig.for_model("gpt_neox", **{**TINY, "intermediate_size": 128})
    model = AutoModelForCausalLM.from_config(config)
    train = TrainConfig(model="gpt_neox-tiny", dataset="d", mlp_tile="auto", head_chunk="auto")
    assert apply_memory_mode(model, train, 1, torch.device("cpu")) is False
