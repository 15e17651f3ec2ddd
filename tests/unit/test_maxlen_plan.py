"""The planner for max-length mode: the fused layer's terms, the --auto search, the CLI."""

import json

import pytest

from easy_context.plan import estimate_memory, load_shape, max_sequence_length
from easy_context.plan.auto import Setup, chunk_choices, fastest_tiling, plan_for_length, plan_longest
from easy_context.plan.estimate import GIB

L3 = load_shape("Llama-3-8B")
OFFLOAD = dict(engine="deepspeed", offload="params", checkpointing="offload", dtype="bf16")


def test_fused_layers_go_further_and_shrink_with_tiles_and_chunks():
    untiled = estimate_memory(L3, 1 << 20, 1, "local", **OFFLOAD)
    fused = estimate_memory(L3, 1 << 20, 1, "local", mlp_tile=4096, heads_per_chunk=4, **OFFLOAD)
    assert fused.total < untiled.total / 3 and fused.mlp_tile == 4096
    assert "max-length mode: MLP tiles of 4096 tokens" in fused.table()
    # smaller tiles and chunks never cost memory; the host keeps every layer input
    t = [estimate_memory(L3, 1 << 20, 1, "local", mlp_tile=tile, heads_per_chunk=c,
                         **OFFLOAD).total for tile, c in ((16384, 32), (16384, 4), (16384, 1),
                                                          (1024, 1))]
    assert t == sorted(t, reverse=True)
    assert fused.host_bytes >= L3.layers * (1 << 20) * L3.hidden * 2


def test_keep_every_trades_host_memory():
    kw = dict(OFFLOAD, mlp_tile=4096, heads_per_chunk=4)
    host = [estimate_memory(L3, 1 << 20, 8, "zigzag_ring_attn", keep_every=k, **kw).host_bytes
            for k in (1, 2, 4)]
    assert host[0] > host[1] > host[2]


@pytest.mark.parametrize("devices,gib,goal", [(1, 80, 1_000_000), (1, 141, 2_000_000)])
def test_issue_goals_on_paper(devices, gib, goal):
    # issue 16: >= 1M tokens of Llama-3-8B on one 80 GB GPU, >= 2M on one 141 GB, host <= 1 TiB
    plan = plan_longest(L3, devices, int(gib * GIB * 0.95), host_bytes=1024 * GIB)
    assert plan.seq_len >= goal and plan.setup.fused
    assert plan.estimate.total <= gib * GIB * 0.95 and plan.estimate.host_bytes <= 1024 * GIB


def test_longest_respects_host_memory():
    budget = int(80 * GIB * 0.95)
    free = plan_longest(L3, 8, budget)
    tight = plan_longest(L3, 8, budget, host_bytes=64 * GIB)
    assert tight.estimate.host_bytes <= 64 * GIB and tight.seq_len <= free.seq_len
    assert max_sequence_length(L3, 8, budget, "zigzag_ring_attn", host_bytes=64 * GIB,
                               **OFFLOAD)[0] <= max_sequence_length(L3, 8, budget,
                                                                    "zigzag_ring_attn", **OFFLOAD)[0]


def test_untiled_when_it_fits_else_the_fastest_tiling():
    base = Setup("zigzag_ring_attn", None, "fsdp", "none", "full")
    big = 1000 * GIB
    setup, _ = fastest_tiling(L3, 65536, 8, base, big, None)
    assert setup == base  # fits untiled: the faster layers
    need = estimate_memory(L3, 1 << 20, 8, "zigzag_ring_attn", engine="fsdp", offload="none",
                           checkpointing="full", dtype="bf16").total
    setup, est = fastest_tiling(L3, 1 << 20, 8, base, need // 2, None)
    assert setup is not None and setup.fused and est.total <= need // 2
    assert fastest_tiling(L3, 1 << 20, 8, base, 4 * GIB, None)[0] is None


def test_chunks_suit_the_method():
    # Ulysses over 8 ranks: 32 query / 8 KV heads; a chunk's query heads must split 8 ways
    uly = Setup("ulysses_attn", None, "fsdp", "none", "full")
    assert chunk_choices(L3, uly, 8) == [32, 16, 8]
    # a ring takes any chunk: whole KV heads (multiples of 4 query heads) or parts of one
    ring = chunk_choices(L3, Setup("zigzag_ring_attn", None, "fsdp", "none", "full"), 8)
    assert ring == [32, 28, 24, 20, 16, 12, 8, 4, 2, 1]


def test_plan_for_length_is_fastest_that_fits():
    plan = plan_for_length(L3, 65536, 8, int(80 * GIB * 0.95))
    assert plan.setup.offload == "none" and not plan.setup.fused
    plan = plan_for_length(L3, 2_000_000, 8, int(80 * GIB * 0.95), host_bytes=256 * GIB)
    assert plan.setup.fused and plan.estimate.total <= 80 * GIB * 0.95
    flags = plan.setup.train_flags(plan.seq_len, 8)
    assert "--mlp-tile" in flags and "--nproc-per-node 8" in flags


def test_cli_auto(capsys):
    from easy_context.cli import main

    assert main(["plan", "--auto", "--model", "Llama-3-8B", "--devices", "1", "--gpu-memory",
                 "80", "--host-memory", "1024"]) == 0
    out = capsys.readouterr().out
    assert "longest sequence that fits:" in out and "easy-context train" in out
    assert "--mlp-tile" in out and "--head-chunk" in out
    assert main(["plan", "--auto", "--model", "Llama-3-8B", "--devices", "8", "--seq-len",
                 "1000000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["for"]["setup"]["mlp_tile"] and "--seq-length" in data["for"]["train_flags"]
