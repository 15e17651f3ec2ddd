"""A hybrid whose recurrent layers are not routed (MiniMax: lightning attention, a linear
attention written inline in its forward, no kernel functions) is refused by name, before any
collective, with a message that names what does run (hf_recurrent.RUNS)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from easy_context.integrations.hf import check_model_supported
from easy_context.integrations.hf_recurrent import RUNS, VERIFIED


def test_unrouted_linear_attention_hybrid_refused_by_name():
    config = AutoConfig.for_model(
        "minimax", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], num_local_experts=2,
        num_experts_per_tok=1, block_size=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as info:
        check_model_supported(model)
    message = str(info.value)
    assert "MiniMaxForCausalLM has layers that are not attention" in message
    assert "layers [0]" in message and RUNS in message


@pytest.mark.parametrize("model_type,overrides", [
    ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, num_experts=2, mamba_d_state=8)),
    ("kimi_linear", dict(layer_types=["linear_attention", "full_attention"],
                         mlp_layer_types=["dense", "dense"], linear_num_heads=4,
                         linear_head_dim=8, num_key_value_heads=4, kv_lora_rank=16,
                         qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2))])
def test_mamba1_and_kda_hybrids_run(model_type, overrides):
    # Jamba (Mamba-1) and Kimi Linear (KDA) were refused by name before easy_context.recurrent
    # ran them (selective_scan.py; KDA through the gated delta rule's scan)
    config = AutoConfig.for_model(
        model_type, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, **{"num_key_value_heads": 2, **overrides})
    check_model_supported(AutoModelForCausalLM.from_config(config))


def test_runs_names_every_verified_family():
    # the refusal names what runs: every verified layer class's family is in RUNS
    families = {"Qwen3Next": "Qwen3-Next", "Qwen3_5": "Qwen3.5", "OlmoHybrid": "OLMo hybrid",
                "Lfm2Moe": "LFM2-MoE", "Lfm2": "LFM2", "Lfm3": "LFM3",
                "GraniteMoeHybrid": "Granite 4", "Bamba": "Bamba", "NemotronH": "Nemotron-H", "FalconH1": "Falcon-H1",
                "Zamba2": "Zamba2", "KimiLinear": "Kimi Linear", "Jamba": "Jamba"}
    for name in VERIFIED:
        prefix = max((p for p in families if name.startswith(p)), key=len, default=None)
        assert prefix is not None and families[prefix] in RUNS, name


def test_layer_forward_replaced_by_a_hub_kernel_is_refused():
    # kernelize (use_kernels=True) sets a hub layer's forward on the instance, bypassing the
    # kernel functions easy_context routes: refused, not run per shard
    from types import MethodType

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    model = AutoModelForCausalLM.from_config(config)
    check_model_supported(model)  # as built: runs
    layer = model.model.layers[0].linear_attn
    layer.forward = MethodType(type(layer).forward, layer)  # the class's own: still runs
    check_model_supported(model)

    def hub_forward(self, hidden_states, **kwargs):  # stands in for a hub layer's forward
        return hidden_states

    layer.forward = MethodType(hub_forward, layer)  # what kernelize does
    with pytest.raises(ValueError, match="Qwen3_5GatedDeltaNet \\(layer 0\\) has its forward "
                                         "replaced"):
        check_model_supported(model)


def _saved_and_loaded_qwen3_5(tmp_path):
    # from_pretrained turns transformers' hub kernels on (use_kernels, transformers 5.25)
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.use_kernels
    return model


def _routed(layer) -> bool:
    return all(getattr(w.__dict__.get("forward"), "_easy_context_routed", False)
               for w in layer._kernel_funcs.values())


def test_routing_survives_train_and_eval_and_a_later_kernelize_is_refused(tmp_path):
    # model.train() / eval() re-kernelize a kernelized model, which gave every kernel function
    # wrapper its own forward back: the recurrent layers then ran unrouted, on each shard as
    # if it were the whole sequence (a Trainer run 1e-3 off at 2 ranks: tests/dist/
    # test_hf_trainer.py's hybrid cases). Now the kernels are off once routed, and a kernelize
    # after apply_sequence_parallel is refused at the layer's next call
    import easy_context as ec

    model = _saved_and_loaded_qwen3_5(tmp_path)
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")
    layer = model.model.layers[0].linear_attn
    model.train()
    model.eval()
    # (the old code: each wrapper lost its instance forward here, back to transformers' own)
    assert all("forward" in w.__dict__ for w in layer._kernel_funcs.values())
    assert _routed(layer)
    ids = torch.randint(0, 97, (1, 8))
    model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False)
    model.set_use_kernels(True)  # a kernelize after apply_sequence_parallel
    assert not _routed(layer)
    with pytest.raises(ValueError, match="replaced after apply_sequence_parallel"):
        model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False)
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")  # what the message says: runs again
    assert _routed(layer)
    model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False)
