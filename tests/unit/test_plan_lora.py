"""The planner's LoRA option (easy_context/plan/lora.py): adapter counts, states per engine,
what LoRA adds and removes, the CLI flags and the README table."""

from __future__ import annotations

import json

import pytest

from easy_context.plan import estimate_memory, load_shape, max_sequence_length, shape_from_config
from easy_context.plan.estimate import GIB
from easy_context.plan.lora import LINEAR, LoRASpec, adapter_params, nf4_bytes

LLAMA7 = load_shape("Llama-2-7B")
KW = dict(offload="none", checkpointing="full", dtype="bf16")


def test_adapter_count_is_peft_s():
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=48, intermediate_size=80,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)
    for targets in (LINEAR, ("q_proj", "v_proj"), ("down_proj",)):
        model = AutoModelForCausalLM.from_config(config)
        peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=list(targets)), model)
        trainable = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        assert adapter_params(shape_from_config(config), LoRASpec(4, targets)) == trainable
    # Llama-2-7B, rank 16 on every linear layer: the count peft prints for it
    assert adapter_params(LLAMA7, LoRASpec(16)) == 39_976_960


@pytest.mark.parametrize("engine, base_bytes, adapter_bytes", [
    ("fsdp", 4, 16),       # fp32 base (the model is built fp32); fp32 params, grads, moments
    ("deepspeed", 2, 16),  # bf16 base, no master copy; bf16 params and grads, fp32 master + moments
])
def test_states_are_the_frozen_base_plus_the_adapters_states(engine, base_bytes, adapter_bytes):
    spec = LoRASpec(16)
    est = estimate_memory(LLAMA7, 8192, 8, "zigzag_ring_attn", engine=engine, lora=spec, **KW)
    t, p = adapter_params(LLAMA7, spec), LLAMA7.num_params()
    assert est.parameters + est.gradients + est.optimizer == pytest.approx(
        (p * base_bytes + t * adapter_bytes) / 8, rel=1e-6)
    assert est.optimizer == pytest.approx(t * (12 if engine == "deepspeed" else 8) / 8, rel=1e-6)
    assert "LoRA r=16 on all linear" in est.model


def test_lora_keeps_activations_but_drops_gradients_states_and_the_head_gradient():
    full = estimate_memory(LLAMA7, 65536, 8, "zigzag_ring_attn", engine="deepspeed", **KW)
    lora = estimate_memory(LLAMA7, 65536, 8, "zigzag_ring_attn", engine="deepspeed",
                           lora=LoRASpec(16), **KW)
    s, h = 65536 // 8, LLAMA7.hidden
    # full checkpointing keeps the layer inputs either way; the final norm's normalized value
    # only a trainable norm weight needs
    assert full.stored_activations - lora.stored_activations == s * h * 2
    # the recomputed layer saves A x (rank 16 x 2 bytes for 7 modules), not its norms' value
    assert lora.mlp_backward - full.mlp_backward == s * (16 * 2 * 7 - 2 * h * 2)
    assert lora.loss < full.loss and lora.total < full.total
    none = dict(KW, checkpointing="none")
    f = estimate_memory(LLAMA7, 65536, 8, "zigzag_ring_attn", engine="deepspeed", **none)
    r = estimate_memory(LLAMA7, 65536, 8, "zigzag_ring_attn", engine="deepspeed",
                        lora=LoRASpec(16), **none)
    # rank x 2 bytes for each of 7 modules, less the two norms' values, every layer; the final
    # norm's value and the first layer's fp32 norm input
    assert r.stored_activations - f.stored_activations == (
        32 * s * (16 * 2 * 7 - 2 * h * 2) - s * h * 2 - s * h * 4)


def test_4bit_base_is_replicated_half_a_byte_a_weight():
    q = estimate_memory(LLAMA7, 8192, 1, "local", engine="fsdp", lora=LoRASpec(16, base_4bit=True), **KW)
    b = estimate_memory(LLAMA7, 8192, 1, "local", engine="fsdp", lora=LoRASpec(16), **KW)
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert b.parameters - q.parameters == pytest.approx(4 * linear - nf4_bytes(linear), rel=1e-6)
    assert nf4_bytes(linear) == pytest.approx(linear * (0.5 + 4 / 64), rel=1e-6)
    # replicated: more devices do not shrink it, where the sharded base shrinks as 1/N
    q8 = estimate_memory(LLAMA7, 8192, 8, "zigzag_ring_attn", engine="fsdp",
                         lora=LoRASpec(16, base_4bit=True), **KW)
    assert q8.parameters > nf4_bytes(linear)
    with pytest.raises(ValueError, match="fsdp engine only"):
        estimate_memory(LLAMA7, 8192, 8, "zigzag_ring_attn", engine="deepspeed",
                        lora=LoRASpec(16, base_4bit=True), **KW)


def test_lora_reaches_at_least_as_far_as_full_fine_tuning():
    budget = int(80 * GIB * 0.95)
    for name in ("Llama-2-7B", "Llama-3-8B"):
        shape = load_shape(name)
        for n in (1, 8):
            kw = dict(engine="deepspeed", granularity=1024, loss_chunk="auto", **KW)
            full, _ = max_sequence_length(shape, n, budget, **kw)
            lora, _ = max_sequence_length(shape, n, budget, lora=LoRASpec(16), **kw)
            assert lora >= full and lora > 0, (name, n, full, lora)


def test_cli_plan_lora(capsys):
    from easy_context.cli import main

    assert main(["plan", "--model", "Llama-2-7B", "--seq-len", "131072", "--devices", "8",
                 "--lora-rank", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "LoRA r=16" in data["estimate"]["model"] and data["estimate"]["optimizer"] < GIB
    assert main(["plan", "--model", "Llama-2-7B", "--devices", "1", "--engine", "fsdp",
                 "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--lora-4bit"]) == 0
    assert "longest sequence that fits" in capsys.readouterr().out
    for argv, message in ((["--lora-4bit"], "add --lora-rank"),
                          (["--lora-rank", "8", "--lora-4bit"], "add --engine fsdp"),
                          (["--lora-rank", "8", "--lora-targets", "lm_head"], "must be among")):
        assert main(["plan", *argv]) == 2
        assert message in capsys.readouterr().err


def test_report_table_has_the_lora_tables():
    from easy_context.plan.report import LORA_TABLE_SETUPS, lora_how_far_markdown

    text = lora_how_far_markdown()
    assert text.count("| model |") == len(LORA_TABLE_SETUPS)
    assert "| Llama-2-7B |" in text and "QLoRA" in text


def _auto(capsys, *argv: str) -> dict:
    """``easy-context plan --auto`` on one 80 GiB GPU for Llama-3-8B, its JSON answer."""
    from easy_context.cli import main

    assert main(["plan", "--auto", "--model", "Llama-3-8B", "--devices", "1", "--gpu-memory",
                 "80", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _train_config(flags: str):
    """The printed flags as ``easy-context train`` reads them (its own refusals included)."""
    import argparse

    from easy_context.train.config import add_train_args, config_from_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(["--model", "m", "--dataset", "d", *flags.split()]))


def test_auto_carries_the_adapters_into_every_candidate(capsys):
    """Issue 45: --auto --lora-rank 16 gave full fine-tuning's length and flags. With 64 GiB
    of host memory full fine-tuning of an 8B model fits nothing on one 80 GiB GPU (its AdamW
    states alone are 128 GB, on the device or the host); LoRA, whose base has no gradients or
    optimizer states, fits; its flags are LoRA's (max-length mode's tiles with them: the
    generic path runs the adapters) and train accepts them."""
    full = _auto(capsys, "--host-memory", "64")
    lora = _auto(capsys, "--host-memory", "64", "--lora-rank", "16")
    assert full["max_seq_len"] == 0 and lora["max_seq_len"] > 100_000, (full, lora)
    flags = lora["longest"]["train_flags"]
    assert "--lora-rank 16" in flags and "--mlp-tile off" not in flags, flags
    assert "LoRA r=16" in lora["longest"]["estimate"]["model"]
    config = _train_config(flags)
    assert config.lora_rank == 16 and not config.lora_4bit


def test_auto_lora_is_longer_than_full_fine_tuning_in_the_same_setup(capsys):
    """Host memory not limited: LoRA's longest (tiled: max-length mode's generic path runs
    the adapters) beats full fine-tuning's in the same engine, offload and checkpointing."""
    from easy_context.cli import main

    lora = _auto(capsys, "--lora-rank", "16")["longest"]
    s = lora["setup"]
    assert s["mlp_tile"] is not None and s["lora"]["rank"] == 16, s
    assert main(["plan", "--model", "Llama-3-8B", "--devices", "1", "--gpu-memory", "80",
                 "--max-seq-len", "--json", "--engine", s["engine"], "--offload", s["offload"],
                 "--checkpointing", s["checkpointing"]]) == 0  # full fine-tuning, untiled
    same_setup_full = json.loads(capsys.readouterr().out)["max_seq_len"]
    assert lora["seq_len"] > same_setup_full > 0, (lora["seq_len"], same_setup_full)
    targets = _auto(capsys, "--lora-rank", "8", "--lora-targets", "q_proj,v_proj")["longest"]
    assert "--lora-rank 8 --lora-targets q_proj,v_proj" in targets["train_flags"]
    assert "LoRA r=8 on q_proj,v_proj" in targets["estimate"]["model"]  # in the estimate too


def test_auto_lora_4bit_picks_fsdp(capsys):
    """--auto chooses the engine, so --lora-4bit picks FSDP instead of asking for
    --engine fsdp (ZeRO-3 cannot hold a 4-bit base)."""
    for argv in ((), ("--seq-len", "65536", "--max-seq-len")):
        data = _auto(capsys, "--lora-rank", "16", "--lora-4bit", *argv)
        for kind in ("longest", "for") if argv else ("longest",):
            plan = data[kind]
            assert plan["setup"]["engine"] == "fsdp", plan["setup"]
            assert "--engine fsdp" in plan["train_flags"] and "--lora-4bit" in plan["train_flags"]
            assert "4-bit base" in plan["estimate"]["model"]
            assert _train_config(plan["train_flags"]).lora_4bit
