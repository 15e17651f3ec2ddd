"""Which layers send their latent, and who says so: the structural check of MLA modules, the
log line at apply time, and the planner's figures and table (one process; the exchange
itself: tests/dist/test_mla_latent.py)."""

import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from easy_context.integrations.hf_latent import (HOOKS_ATTR, latent_structure, latent_width,
                                                 route_latent_layers)
from easy_context.plan import choose_method, estimate_memory, shape_from_config
from easy_context.plan.estimate import communication_per_layer

MLA = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, head_dim=4,
           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, n_group=1, topk_group=1)
# families that share DeepSeek's MLA attention module (kv_a_proj_with_mqa, kv_a_layernorm,
# kv_b_proj, expand_kv), with their own q path, RoPE or scalings
FAMILIES = {"deepseek_v3": {}, "deepseek_v2": dict(q_lora_rank=None), "glm4_moe_lite": {},
            "minicpm3": {}}


def _attention(model):
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]


def _model(model_type: str, **extra):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**MLA, **extra}))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mla_families_have_the_structure(family):
    modules = _attention(_model(family, **FAMILIES[family]))
    assert modules and all(latent_structure(m) is None for m in modules)
    assert latent_width(modules[0]) == 16 + 4


def test_other_attention_is_not_mla():
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4))
    assert "no expand_kv" in latent_structure(_attention(llama)[0])


def test_apply_time_says_which_path_mla_takes(caplog):
    modules = _attention(_model("deepseek_v3"))
    with caplog.at_level(logging.INFO, logger="easy_context.integrations.hf_latent"):
        got = route_latent_layers(modules, "allgather_attn", "allgather_attn", world=2)
    assert got == modules and all(getattr(m, HOOKS_ATTR, None) for m in modules)
    assert "2 multi-head latent attention layers (DeepseekV3Attention) send their latent, 20 " \
           "values a token (kv_lora_rank 16 + rope 4) instead of 72 of expanded K/V" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="easy_context.integrations.hf_latent"):
        assert route_latent_layers(modules, "zigzag_ring_attn", "zigzag_ring_attn", 2) == []
    assert "move their expanded K/V" in caplog.text
    assert not any(getattr(m, HOOKS_ATTR, None) or "expand_kv" in vars(m) for m in modules)


def test_a_copy_gathers_for_itself():
    """A deep copy of a switched model (the trainer's reference, EMA copies) expands its own
    latent: its expand_kv is bound to the copy, not to the original's module."""
    model = _model("deepseek_v3")
    route_latent_layers(_attention(model), "allgather_attn", "allgather_attn", world=2)
    twin = copy.deepcopy(model)
    kv_nope, k_rot = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 4)
    for m in _attention(twin):
        with torch.no_grad():
            m.kv_b_proj.weight.add_(1.0)  # the twin's weights, no longer the original's
            got = m.expand_kv(kv_nope, k_rot)  # no forward running: the expanded path
            want = type(m).expand_kv(m, kv_nope, k_rot)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_planner_counts_the_latent():
    shape = shape_from_config(AutoConfig.for_model("deepseek_v3"), "DeepSeek-V3", check=False)
    s, world = 16384, 8
    latent = communication_per_layer(shape, s, 2, "allgather_attn", world)
    assert latent == (world - 1) * s * (512 + 64) * (2 + 4)  # bf16 gather, float32 gradient
    ring = communication_per_layer(shape, s, 2, "zigzag_ring_attn", world)
    assert latent * 20 < ring
    table = estimate_memory(shape, s * world, world, "allgather_attn").table()
    assert "[MLA latent: 576 values a token, not the expanded K/V]" in table
    assert "MLA latent" not in estimate_memory(shape, s * world, world, "zigzag_ring_attn").table()
    choice = choose_method(shape, s * world, world, 10 ** 15, methods=("allgather_attn",))
    assert choice.method == "allgather_attn", choice.reason  # no "no strong GQA" for MLA
