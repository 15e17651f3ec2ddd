"""How many KV heads a block method runs per pass: the buffer budget, and the planner's
buffer formula following the same choice."""

import pytest
import torch

import easy_context as ec
from easy_context.parallel import AttentionDims
from easy_context.parallel.head_groups import (BUDGETS, attention_buffer_budget, buffer_budget,
                                               kv_heads_per_group, kv_head_groups)

LLAMA3_8B = AttentionDims(heads=32, kv_heads=8, head_dim=128)
LLAMA2_7B = AttentionDims(heads=32, kv_heads=32, head_dim=128)


def test_largest_group_that_fits_then_evened_out():
    per_head = lambda g: 10 * g  # noqa: E731
    assert kv_heads_per_group(per_head, 8, 80) == 8      # all at once when they fit
    assert kv_heads_per_group(per_head, 8, 79) == 4      # 7 fit: two groups of 4, not 7 + 1
    assert kv_heads_per_group(per_head, 8, 30) == 3      # three groups: 3, 3, 2
    assert kv_heads_per_group(per_head, 8, 0) == 1       # nothing fits: one at a time
    assert [ks for _, ks in kv_head_groups(8, 8, 3)] == [slice(0, 3), slice(3, 6), slice(6, 8)]


def test_budget_per_device_and_override():
    assert buffer_budget("cuda") == BUDGETS["cuda"] and buffer_budget("cpu") == BUDGETS["cpu"]
    with attention_buffer_budget(123):
        assert buffer_budget("cuda") == 123 and buffer_budget("cpu") == 123
    assert buffer_budget("cpu") == BUDGETS["cpu"]


@pytest.mark.parametrize("method", ["ring_attn", "zigzag_ring_attn", "dist_flash_attn"])
def test_gpu_groups_for_llama_shapes(method):
    m = ec.METHODS[method]
    s = 65536  # tokens per rank (512K over 8 GPUs)
    # Llama-3-8B: all 8 KV heads in one pass for the ring (256 MiB each)
    if method != "dist_flash_attn":
        assert m.kv_heads_per_group(LLAMA3_8B, s, 2, 8) == 8
    # Llama-2-7B: 32 KV heads do not fit 2 GiB at once; a few groups, not 32
    g = m.kv_heads_per_group(LLAMA2_7B, s, 2, 8)
    assert 4 <= g < 32 and -(-32 // g) <= 8
    assert m.buffers(LLAMA2_7B, s, 2, 8) == m.group_buffers(LLAMA2_7B, s, 2, 8, None, g)
    assert m.buffers(LLAMA2_7B, s, 2, 8) <= BUDGETS["cuda"]
    # with flash-attn 2's backward workspace in the budget too (what the GPU run counts)
    from easy_context.plan.estimate import kernel_workspace

    ws = kernel_workspace("gpu", 2)
    g3 = m.kv_heads_per_group(LLAMA3_8B, s, 2, 8, workspace=ws)
    assert g3 < m.kv_heads_per_group(LLAMA3_8B, s, 2, 8)
    assert (m.buffers(LLAMA3_8B, s, 2, 8, workspace=ws)
            + m.call_workspace(LLAMA3_8B, s, 2, 8, workspace=ws)) <= BUDGETS["cuda"]
    if method != "dist_flash_attn":
        assert g3 == 3  # 3 + 3 + 2 KV heads: three passes


def test_cpu_groups_one_head_from_a_few_thousand_tokens():
    m = ec.METHODS["zigzag_ring_attn"]
    dims = AttentionDims(8, 8, 64)  # benchmarks/attention.py's shape
    assert m.kv_heads_per_group(dims, 8192, 2, 2, budget=BUDGETS["cpu"]) == 1
    assert m.kv_heads_per_group(dims, 64, 2, 2, budget=BUDGETS["cpu"]) == 8


def ring_group_at_run_time(monkeypatch, q, k, budget: int) -> int:
    """The KV heads per pass the ring engine picks for q, k (2 ranks) under ``budget``."""
    import easy_context.parallel.ring as ring

    seen = {}

    def spy(algo, *tensors):
        seen["per_group"] = algo.kv_heads_per_group
        raise RuntimeError("stop")

    monkeypatch.setattr(ring, "run_attention", spy)
    monkeypatch.setattr(ring.dist, "get_world_size", lambda group=None: 2)
    with attention_buffer_budget(budget), pytest.raises(RuntimeError, match="stop"):
        ring.run_ring(q, k, k, None, True, None, ring.contiguous_schedule)
    return seen["per_group"]


def test_runtime_and_planner_pick_the_same_groups(monkeypatch):
    """The ring engine asks head_groups with the method's own formula and the tensors'
    sizes: the group it builds is the planner's."""
    q = torch.randn(1, 4096, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 4, 64, dtype=torch.bfloat16)
    for budget in (0, 3 * 2**20, 2**30):
        want = ec.METHODS["ring_attn"].kv_heads_per_group(AttentionDims(8, 4, 64), 4096, 2, 2,
                                                          budget=budget)
        assert ring_group_at_run_time(monkeypatch, q, k, budget) == want
