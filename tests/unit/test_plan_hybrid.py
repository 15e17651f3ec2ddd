"""The planner on hybrid models (issue 41): recurrent layers read from the config, their
parameters counted as the real modules hold them, their state exchange from
recurrent.mixer's arithmetic, next to the attention layers' traffic; a mixer it cannot size
is refused by name. (The state exchange against one measured step: tests/dist/test_plan_hybrid.py.)"""

import pytest
from transformers import AutoConfig

from easy_context.plan import estimate_memory
from easy_context.plan.cli import build_args, run_plan
from easy_context.plan.shapes import load_shape, shape_from_config
from easy_context.recurrent.mixer import MIXERS
from tests.dist.hf_cases import COMMON
from tests.dist.hf_recurrent_cases import QWEN3_NEXT, tiny_hybrid, tiny_qwen3_next


@pytest.mark.parametrize("family", ["granite_hybrid", "bamba", "nemotron_h", "falcon_h1",
                                    "olmo_hybrid", "lfm2", "qwen3_next"])
def test_parameters_as_the_modules_hold_them(family):
    model = tiny_qwen3_next() if family == "qwen3_next" else tiny_hybrid(family)
    real = sum(p.numel() for p in model.parameters())
    planned = shape_from_config(model.config, family).num_params()
    # Qwen3-Next's attention gates its output from a doubled q_proj and norms q and k, which
    # no config field says (1,040 of 27,392 here; 0.1% of the full model); OLMo's and LFM2's
    # q/k norms (under 0.2%)
    tol = 0.04 if family == "qwen3_next" else 0.002
    assert abs(planned - real) <= tol * real, (planned, real)


def test_qwen3_next_layers_and_state_exchange():
    shape = shape_from_config(AutoConfig.for_model("qwen3_next"), "Qwen3-Next")
    assert (shape.layers, shape.attention_layers, shape.recurrent_layers) == (48, 12, 36)
    assert shape.recurrent.kind == "gated_delta_net" and shape.moe.experts == 512
    assert shape.num_params() / 1e9 == pytest.approx(80, rel=0.03)  # Qwen3-Next-80B-A3B
    d = shape.recurrent.dims()
    # 32 value heads of 128 x (128 + 128) float32 (A, B); conv over 2*16*128 + 32*128 channels
    assert (d.state, d.conv_channels, d.conv_kernel) == (32 * 128 * 256, 8192, 4)
    est = {L: estimate_memory(shape, L, 8, "zigzag_ring_attn", checkpointing="full")
           for L in (32768, 262144)}
    for L, e in est.items():  # two zigzag pieces per rank, through Mixer.comm_bytes
        assert e.state_communication_per_layer == MIXERS["gated_delta_net"].comm_bytes(d, 2, 2, 8)
        assert e.communication_per_step == (12 * e.communication_per_layer
                                             + 36 * e.state_communication_per_layer)
        assert e.state_bytes_per_layer == 8 * 2 * d.state * 4
    # the state exchange does not grow with the sequence; the attention layers' traffic does
    a, b = est[32768], est[262144]
    assert a.state_communication_per_layer == b.state_communication_per_layer
    assert b.communication_per_layer == 8 * a.communication_per_layer
    assert "state exchange per layer" in b.table()


def test_recurrent_layers_cost_activations_and_states():
    """A hybrid's stored activations count its recurrent layers' own tensors and, sequence-
    parallel, the gathered states; a layer swapped for attention changes the count."""
    hybrid = shape_from_config(tiny_qwen3_next().config, "hybrid")
    kw = dict(engine="replicated", dtype="fp32", checkpointing="none", device="cpu")
    one = estimate_memory(hybrid, 64, 1, "local", **kw)
    two = estimate_memory(hybrid, 128, 2, "zigzag_ring_attn", **kw)
    assert one.state_bytes_per_layer == 0 and two.state_bytes_per_layer > 0
    # 2 ranks x 2 pieces x (A, B) of 4 heads x 8 x 16, float32
    assert two.state_bytes_per_layer == 2 * 2 * 4 * 8 * 16 * 4
    attention_only = shape_from_config(AutoConfig.for_model("qwen3_next", **{
        **COMMON, **QWEN3_NEXT, "layer_types": ["full_attention", "full_attention"]}), "attn",
        check=False)  # at this size the gated q_proj no config field names is 8% of it
    assert attention_only.recurrent_layers == 0
    assert (estimate_memory(attention_only, 64, 1, "local", **kw).stored_activations
            != one.stored_activations)


def test_mamba1_layers_are_refused_by_name():
    config = AutoConfig.for_model("jamba", num_hidden_layers=2, attn_layer_period=2,
                                  attn_layer_offset=1, hidden_size=32, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=97)
    with pytest.raises(ValueError, match="cannot read the sizes of its"):
        shape_from_config(config, "jamba")


def test_cli_plans_a_hybrid_config(tmp_path, capsys):
    tiny_qwen3_next().config.save_pretrained(tmp_path)
    assert run_plan(build_args(model=str(tmp_path), seq_len=4096, devices=2,
                               method="zigzag_ring_attn")) == 0
    out = capsys.readouterr().out
    assert "state exchange per layer" in out and "each of 1 recurrent layers" in out
    shape = load_shape(str(tmp_path))
    assert shape.recurrent_layers == 1 and shape.attention_layers == 1


def _saved_bytes_per_token(module, run, length: int) -> float:
    """Bytes of the distinct tensors autograd saves while ``module`` runs forward, per token."""
    import torch

    seen, total, on = set(), [0], [False]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if on[0] and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    hooks = [module.register_forward_pre_hook(lambda *a: on.__setitem__(0, True)),
             module.register_forward_hook(lambda *a: on.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    return total[0] / length


@pytest.mark.parametrize("over", [{}, dict(linear_key_head_dim=32, linear_value_head_dim=32),
                                  dict(linear_num_value_heads=8, linear_num_key_heads=4)])
def test_delta_rule_layer_saves_what_the_planner_counts(over):
    """A gated DeltaNet layer's saved tensors (transformers' torch kernel, one process),
    measured with saved-tensor hooks, within 2% of the planner's bytes per token on a CPU
    (a GPU's flash-linear-attention kernel keeps less: not measured here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.hybrid import CONFIG
    from easy_context.plan.estimate import recurrent_saved_per_token

    config = AutoConfig.for_model("qwen3_next", **{**CONFIG, **over})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, config.vocab_size, (1, 512))
    measured = _saved_bytes_per_token(model.model.layers[0].linear_attn,
                                      lambda: model.model(input_ids=ids, use_cache=False), 512)
    planned = recurrent_saved_per_token(shape_from_config(config, "q", check=False), 4, 1,
                                        device="cpu")
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


def test_growth_matches_the_measured_benchmark():
    """benchmarks/results/hybrid.json measured each rank's peak rise at 16K and 32K tokens;
    the planner's growth between them (same model, fp32, no checkpointing, full-logits loss)
    is within 10% of the measured growth, one process and 2 ranks."""
    import json
    from pathlib import Path

    from benchmarks.hybrid import CONFIG

    d = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                    / "hybrid.json").read_text())
    shape = shape_from_config(AutoConfig.for_model("qwen3_next", **CONFIG), "bench", check=False)
    kw = dict(engine="replicated", checkpointing="none", dtype="fp32", device="cpu",
              loss_chunk=None)
    for method, world in (("local", 1), ("zigzag_ring_attn", 2), ("ulysses_attn", 2)):
        est = {L: estimate_memory(shape, L, world, method, **kw).total for L in (16384, 32768)}
        planned = est[32768] - est[16384]
        if method == "local":
            measured = (d["runs"]["local"]["32768"]["peak_rise_bytes"]
                        - d["runs"]["local"]["16384"]["peak_rise_bytes"])
        else:
            measured = d["growth"][method]["growth_mb_per_rank"] * 2**20
        assert abs(planned - measured) <= 0.10 * measured, (method, planned / 2**20,
                                                             measured / 2**20)


def test_auto_tiles_hybrids_on_the_generic_path():
    """Max-length mode runs a hybrid's recurrent layers on its generic path (the mixer whole,
    the MLP or experts in tiles), and the planner prices them there (plan/generic.py; issue
    42: it used to refuse, "no max-length terms for recurrent mixers", and --auto planned
    hybrids untiled only). --auto now tiles Qwen3-Next past what fits untiled, and an
    explicit tiled estimate is planned, below the untiled one at a long length. (The terms
    against measurement: tests/unit/test_plan_generic.py, tests/dist/test_plan_hybrid.py.)"""
    from dataclasses import replace

    from easy_context.plan.auto import plan_for_length, plan_longest
    from easy_context.plan.estimate import GIB

    qwen = shape_from_config(AutoConfig.for_model("qwen3_next"), "Qwen3-Next", check=False)
    assert not qwen.fusable and load_shape("Llama-3-8B").fusable
    assert qwen.tileable and {p for _, p in qwen.maxlen_paths()} == {"generic"}
    kw = dict(host_bytes=256 * GIB, granularity=65536)
    longest = plan_longest(qwen, 8, 80 * GIB, **kw)
    # the same search with max-length mode ruled out: what --auto planned before
    untiled = plan_longest(replace(qwen, layer_paths=tuple(
        (k, "not run") for k, _ in qwen.maxlen_paths())), 8, 80 * GIB, **kw)
    assert longest.setup.fused and not untiled.setup.fused, (longest.setup, untiled.setup)
    assert longest.seq_len > untiled.seq_len and longest.estimate.total <= 80 * GIB
    plan = plan_for_length(qwen, longest.seq_len, 8, 80 * GIB, host_bytes=256 * GIB)
    assert plan.setup is not None and plan.setup.fused, plan.setup
    # with the layers' own paths read from the (meta-built) model, as `plan` and `train` read
    # them: the tiny Qwen3-Next's recurrent and attention layers both take the generic path
    built = shape_from_config(tiny_qwen3_next().config, "tiny Qwen3-Next")
    assert built.tileable and {p for _, p in built.layer_paths} == {"generic"}
    assert "recurrent + MLP: generic" in built.describe_paths()
    tiled = estimate_memory(built, 65536, 2, "zigzag_ring_attn", mlp_tile=256)
    whole = estimate_memory(built, 65536, 2, "zigzag_ring_attn")
    assert tiled.mlp_tile == 256 and tiled.total < whole.total
    # a layer max-length mode does not run still refuses the tiled estimate, by its reason
    refused = replace(built, layer_paths=tuple((k, "its MLP is inside a shared block")
                                               for k, _ in built.layer_paths))
    with pytest.raises(ValueError, match="shared block.*plan it untiled"):
        estimate_memory(refused, 4096, 2, "zigzag_ring_attn", mlp_tile=256)


def test_gpu_delta_rule_kernel_keeps_its_chunk_matrix_only():
    """On a GPU the planner counts flash-linear-attention's saved set (inputs and one
    chunk-wide float32 row per value head, its A); on a CPU transformers' torch kernel's."""
    from easy_context.plan.estimate import recurrent_saved_per_token

    shape = shape_from_config(AutoConfig.for_model("qwen3_next"), "Qwen3-Next", check=False)
    cpu, gpu = (recurrent_saved_per_token(shape, 2, 8, device=d) for d in ("cpu", "gpu"))
    # projections (2*16*128 + 2*32*128 + 2*32), conv in/out/act (3 x 8192 channels), values in
    # and out with the identity block (2 x 32 x (128 + 128)) in bf16; the gated norm
    # (4096 x (4 + 2 x 2)); the kernel's A: 32 heads x 64 float32
    base = 2 * (12352 + 3 * 8192 + 2 * 8192) + 4096 * 8
    assert gpu == base + 4 * 32 * 64
    # the torch kernel's: 5.25 chunk rows and 6 x (d_k + widened d_v) per head, float32
    assert cpu == base + int(4 * 32 * (5.25 * 64 + 6 * (128 + 256)))
    est = {d: estimate_memory(shape, 262144, 8, "zigzag_ring_attn", engine="fsdp",
                              checkpointing="none", device=d).stored_activations
           for d in ("cpu", "gpu")}
    assert est["gpu"] < est["cpu"]
