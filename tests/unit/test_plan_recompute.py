"""What each checkpointing choice costs (issue 43, plan/recompute.py): attention-saving
checkpointing keeps each attention layer's output and lse and skips re-running attention;
`plan` and `plan --auto` say so, and --auto picks it whenever it fits."""

import json

import pytest
from transformers import AutoConfig

from easy_context.plan import estimate_memory, load_shape
from easy_context.plan.auto import plan_for_length
from easy_context.plan.cli import build_args, run_plan
from easy_context.plan.estimate import GIB
from easy_context.plan.recompute import checkpointing_costs, layer_flops_per_token, mean_context
from easy_context.plan.shapes import shape_from_config

LLAMA8 = load_shape("Llama-3-8B")


def test_mean_context():
    assert mean_context(4) == 2.5  # 1 + 2 + 3 + 4 keys over 4 queries
    assert mean_context(4, 2) == (1 + 2 + 2 + 2) / 4
    assert mean_context(4, 8) == 2.5


def test_attention_saving_costs_its_outputs_and_saves_the_attention_recompute():
    L, n = 131072, 8
    costs = {c.checkpointing: c for c in checkpointing_costs(LLAMA8, L, n, "zigzag_ring_attn")}
    s = L // n
    # the extra memory: every layer's attention output (bf16) and lse (fp32)
    assert (costs["attention"].stored_bytes - costs["full"].stored_bytes
            == LLAMA8.layers * s * (LLAMA8.heads * LLAMA8.hd * 2 + LLAMA8.heads * 4))
    f = layer_flops_per_token(LLAMA8, L, n)
    # full re-runs every layer's forward; attention-saving all of it but the attention kernels
    assert costs["full"].recompute_flops == s * (f["linear"] + f["attention"])
    assert costs["attention"].recompute_flops == s * f["linear"]
    assert costs["none"].recompute_flops == 0 and costs["none"].recompute_share == 0
    assert costs["offload"].recompute_flops == costs["full"].recompute_flops
    # at 128K tokens attention is most of the recompute; its share of the step as counted
    saved = costs["full"].attention_recompute_share
    assert saved == pytest.approx(s * f["attention"] / costs["full"].step_flops)
    assert 0.1 < saved < costs["full"].recompute_share < 0.25 + 1e-9
    # the share attention takes grows with the length
    short = {c.checkpointing: c for c in checkpointing_costs(LLAMA8, 4096, n, "zigzag_ring_attn")}
    assert short["full"].attention_recompute_share < saved


def test_hybrid_and_window_layers_recompute_less_attention():
    """Only attention layers keep outputs; window layers' kernels cost their window."""
    qwen = shape_from_config(AutoConfig.for_model("qwen3_next"), "Qwen3-Next")
    costs = {c.checkpointing: c for c in checkpointing_costs(qwen, 65536, 8, "zigzag_ring_attn")}
    a = qwen.heads * (qwen.v_head_dim or qwen.hd) * 2 + qwen.heads * 4
    assert costs["attention"].stored_bytes - costs["full"].stored_bytes == 12 * 8192 * a
    gemma = shape_from_config(AutoConfig.for_model("gemma3_text"), "Gemma-3")
    windowed = layer_flops_per_token(gemma, 131072, 8)["attention"]
    all_global = layer_flops_per_token(
        shape_from_config(AutoConfig.for_model("gemma3_text", layer_types=["full_attention"] * 26),
                          "g"), 131072, 8)["attention"]
    assert windowed < 0.25 * all_global  # 22 of 26 layers see 4,096 keys, not 65K on average


def test_auto_picks_attention_saving_whenever_it_fits():
    L, n = 131072, 8
    kw = dict(engine="fsdp", offload="none", dtype="bf16")
    need = {c: estimate_memory(LLAMA8, L, n, "ulysses_attn", checkpointing=c, **kw).total
            for c in ("attention", "full")}
    assert need["attention"] > need["full"]
    for budget, want in ((need["attention"] + GIB, "attention"),
                         ((need["attention"] + need["full"]) // 2, "full")):
        plan = plan_for_length(LLAMA8, L, n, budget, host_bytes=None)
        assert plan.setup.checkpointing == want, (budget / GIB, plan.setup)


def test_cli_reports_each_choice(capsys):
    assert run_plan(build_args(model="Llama-3-8B", seq_len=131072, devices=8)) == 0
    out = capsys.readouterr().out
    assert "checkpointing choices" in out and "saves recomputing attention" in out
    assert run_plan(build_args(model="Llama-3-8B", seq_len=131072, devices=8, auto=True,
                               json=True)) == 0
    result = json.loads(capsys.readouterr().out)
    costs = {c["checkpointing"]: c for c in result["for"]["checkpointing_costs"]}
    assert result["for"]["setup"]["checkpointing"] == "attention" and costs["attention"]["fits"]
