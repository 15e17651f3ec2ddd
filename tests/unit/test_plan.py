"""The memory planner's arithmetic: shapes, monotonicity, offload, method choice, search, CLI."""

import json

import pytest

from easy_context.plan import (
    BUILTIN,
    ModelShape,
    choose_method,
    estimate_memory,
    load_shape,
    max_sequence_length,
    required_multiple,
)
from easy_context.plan.estimate import GIB

LLAMA7 = load_shape("Llama-2-7B")
KW = dict(engine="deepspeed", offload="none", checkpointing="full", dtype="bf16")


@pytest.mark.parametrize("name, billions", [
    ("Llama-2-7B", 6.74), ("Llama-2-13B", 13.0), ("Llama-2-70B", 69.0), ("Llama-3-8B", 8.03),
    ("Llama-3-70B", 70.6), ("Mistral-7B", 7.24), ("Qwen2.5-7B", 7.62), ("Llama-3.2-1B", 1.24),
    ("TinyLlama-1.1B", 1.10), ("Qwen2.5-1.5B", 1.54)])
def test_builtin_parameter_counts(name, billions):
    assert load_shape(name).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_shape_names_and_local_config(tmp_path):
    assert load_shape("meta-llama/Llama-2-7b-hf") is BUILTIN["llama-2-7b"]
    assert load_shape("llama-3.1-8b").vocab == 128256
    with pytest.raises(ValueError, match="unknown model"):
        load_shape("no-such-model")
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=512, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1024, vocab_size=1000, tie_word_embeddings=True
                ).save_pretrained(tmp_path)
    for where in (tmp_path, tmp_path / "config.json"):
        s = load_shape(str(where))
        assert (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab, s.tied_embeddings,
                s.hd) == (512, 3, 8, 2, 1024, 1000, True, 64)


def test_zero3_states_are_16_bytes_per_param_over_n():
    e = estimate_memory(LLAMA7, 8192, 8, "zigzag_ring_attn", **KW)
    states = e.parameters + e.gradients + e.optimizer
    assert states == pytest.approx(16 * LLAMA7.num_params() / 8, rel=1e-6)


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn", "allgather_attn",
                                    "dist_flash_attn", "ring_attn"])
@pytest.mark.parametrize("ckpt", ["none", "full", "offload", "attention"])
def test_monotone_in_length_and_devices(method, ckpt):
    kw = dict(KW, checkpointing=ckpt)
    totals = [estimate_memory(LLAMA7, L, 8, method, **kw).total for L in (16384, 65536, 262144)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    per_n = [estimate_memory(LLAMA7, 262144, n, method, **kw).total for n in (2, 4, 8, 16)]
    assert per_n == sorted(per_n, reverse=True) and per_n[0] > per_n[-1]


def test_offload_and_checkpointing_reduce_device_memory():
    args = (LLAMA7, 131072, 8, "zigzag_ring_attn")
    none = estimate_memory(*args, **KW)
    opt = estimate_memory(*args, **dict(KW, offload="optimizer"))
    par = estimate_memory(*args, **dict(KW, offload="params"))
    assert none.total > opt.total > par.total
    assert par.parameters == par.gradients == par.optimizer == 0 and par.host_bytes > opt.host_bytes > 0
    ckpt = {c: estimate_memory(*args, **dict(KW, checkpointing=c)).total
            for c in ("none", "attention", "full", "offload")}
    assert ckpt["none"] > ckpt["attention"] > ckpt["full"] > ckpt["offload"]
    with pytest.raises(ValueError, match="FSDP offloads"):
        estimate_memory(*args, **dict(KW, engine="fsdp", offload="optimizer"))


def test_chunked_loss_is_far_smaller_than_logits():
    chunked = estimate_memory(LLAMA7, 131072, 1, "local", **KW)
    logits = estimate_memory(LLAMA7, 131072, 1, "local", loss_chunk=None, **KW)
    # 131072 x 32000 logits at 14 bytes each: ~55 GiB; a 4096-row chunk: ~0.5 GiB (+ head grad)
    assert logits.loss / GIB == pytest.approx(131072 * 32000 * 14 / GIB, rel=1e-6)
    assert chunked.loss < logits.loss / 20


def test_table_lists_every_component():
    e = estimate_memory(LLAMA7, 65536, 8, "ulysses_attn", **KW)
    text = e.table()
    for name in e.components():
        assert name.replace("_", " ") in text
    assert "total (peak)" in text


def test_total_of_a_hand_counted_step():
    """Every byte of one fp32 step of a 2-layer model in one process, counted by hand from
    what the step holds (the module docstrings of plan/estimate.py and plan/states.py), not
    from the planner's own formulas."""
    shape = ModelShape("t", 64, 2, 4, 4, 128, 256, False)  # H=64, 4 heads of 16, I=128, V=256
    e = estimate_memory(shape, 1024, 1, "local", engine="replicated", checkpointing="none",
                        dtype="fp32", loss_chunk=64, runtime_bytes=0, device="cpu")
    # parameters: a layer has q, k, v, o (4 x 64 x 64 = 16384), gate/up/down (3 x 64 x 128 =
    # 24576) and two norms (128): 41088; two layers, untied embeddings (2 x 256 x 64 = 32768)
    # and the final norm (64): 115008
    p = 115008
    assert e.parameters == e.gradients == e.optimizer_step == 4 * p  # fp32; AdamW's temporary
    assert e.optimizer == 8 * p  # two fp32 moments
    assert e.gradients_in_backward == 4 * (256 * 64 + 41088)  # the head's and one layer's
    # saved per token and layer: two norms (fp32 input 4 + normed 4 + output 4 bytes, x 64 =
    # 768 each); attention: q, k, v, out (4 x 64 x 4 = 1024) and the lse (4 heads x 4 = 16);
    # the MLP's gate, SiLU(gate), up and product (4 x 128 x 4 = 2048): 4624; over 2 layers,
    # plus the final norm's 768 and the RoPE tables (2 x 16 x 4 = 128): 10144 per token
    assert e.stored_activations == 10144 * 1024
    # the last layer's MLP backward: the residual gradient in and out (2 x 64 x 4) and one
    # 128-wide intermediate gradient (128 x 4): 1024 per token. Its attention half (q, k, v,
    # out gradients and a kernel call's: 2304) fits in the 2816 the MLP's saved tensors free
    assert e.mlp_backward == 1024 * 1024 and e.attention_backward == 0
    # the loss: a 64-row block of fp32 logits (64 x 256 x 4), the hidden states' gradient
    # (1024 x 64 x 4), the lse (1024 x 4); in fp32 each chunk's head-gradient product is
    # accumulated inside the GEMM (memory/loss.py add_matmul_), so no (256 x 64) product
    assert e.loss == 65536 + 262144 + 4096 < e.mlp_backward
    # peak in backward: parameters, moments, the first gradients, every stored activation and
    # the MLP backward; the optimizer step (gradients + its temporary) is smaller
    assert e.total == 4 * p + 8 * p + 4 * (256 * 64 + 41088) + 10144 * 1024 + 1024 * 1024
    assert e.total == 13_046_016


def test_choose_method_reasons():
    big = 1000 * GIB
    c = choose_method(LLAMA7, 65536, 8, big, **KW)
    assert c.method == "ulysses_attn" and "Ulysses" in c.reason
    # 64 devices > 32 heads: Ulysses cannot, USP uses Ulysses groups of 32 and a ring of 2
    c = choose_method(LLAMA7, 65536, 64, big, **KW)
    assert c.method == "usp_attn" and c.ring_degree == 2
    assert "divisible" in c.rejected["ulysses_attn"]
    # Qwen2.5-7B: 28 heads, 4 KV heads; on 3 devices only all-gather (strong GQA) or rings
    c = choose_method(load_shape("Qwen2.5-7B"), 65536, 3, big, **KW)
    assert c.method == "allgather_attn" and "GQA" in c.reason
    # Llama-2-7B on 3 devices: no GQA, so zigzag ring, balanced
    c = choose_method(LLAMA7, 65536, 3, big, **KW)
    assert c.method == "zigzag_ring_attn" and "balanced" in c.reason
    assert "heads divisible" in c.rejected["ulysses_attn"] and "GQA" in c.rejected["allgather_attn"]
    c = choose_method(LLAMA7, 65536, 8, 10 * GIB, **KW)
    assert c.method is None and "no method fits" in c.reason
    assert choose_method(LLAMA7, 4096, 1, big, **KW).method == "local"


def test_memory_decides_between_methods():
    # all-gather holds the whole sequence's K/V: at 1M tokens that costs more than a ring
    shape = load_shape("Llama-3-8B")
    kw = dict(KW, offload="params", checkpointing="offload")
    ag = estimate_memory(shape, 1 << 20, 8, "allgather_attn", **kw)
    zz = estimate_memory(shape, 1 << 20, 8, "zigzag_ring_attn", **kw)
    assert ag.attention_buffers > zz.attention_buffers


@pytest.mark.parametrize("method, n", [("zigzag_ring_attn", 8), ("ulysses_attn", 8),
                                       ("usp_attn", 6), ("ring_attn", 3)])
def test_max_sequence_length_is_the_boundary(method, n):
    budget = 76 * GIB
    rd = 2 if method == "usp_attn" else None
    L, m = max_sequence_length(LLAMA7, n, budget, method, rd, **KW)
    step = required_multiple(method, n, rd)
    assert m == method and L > 0 and L % step == 0
    assert estimate_memory(LLAMA7, L, n, method, ring_degree=rd, **KW).total <= budget
    assert estimate_memory(LLAMA7, L + step, n, method, ring_degree=rd, **KW).total > budget


def test_max_sequence_length_auto_and_nothing_fits():
    L, m = max_sequence_length(LLAMA7, 8, 76 * GIB, **KW)
    assert m is not None and L >= max_sequence_length(LLAMA7, 8, 76 * GIB, "ring_attn", **KW)[0]
    assert max_sequence_length(LLAMA7, 1, 10 * GIB, **KW) == (0, None)


def test_tiny_shape_without_gqa_ratio():
    s = ModelShape("t", hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=100)
    assert s.layer_params() == 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64


def test_cli_plan(capsys):
    from easy_context.cli import main

    assert main(["plan", "--model", "Llama-2-7B", "--seq-len", "131072", "--devices", "8",
                 "--offload", "params", "--max-seq-len"]) == 0
    out = capsys.readouterr().out
    assert "method: ulysses_attn" in out and "total (peak)" in out and "longest sequence" in out
    assert main(["plan", "--model", "Llama-3-8B", "--devices", "16", "--json",
                 "--method", "zigzag_ring_attn"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_seq_len"] % 32 == 0 and data["max_seq_len_method"] == "zigzag_ring_attn"
