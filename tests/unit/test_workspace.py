"""The attention backward's workspaces (easy_context/attention/workspace.py): hand-derived
sizes, the head groups that keep them inside the budget at run time, and the planner
counting the same."""

from __future__ import annotations

import pytest
import torch

import easy_context as ec
from easy_context.attention.contract import Kernel
from easy_context.attention.kernels import REFERENCE
from easy_context.attention.workspace import backward_workspace, block_workspace
from easy_context.parallel import AttentionDims
from easy_context.parallel.head_groups import attention_buffer_budget, kv_heads_per_group
from easy_context.plan.estimate import estimate_memory, kernel_workspace
from easy_context.plan.shapes import load_shape

from .test_head_groups import ring_group_at_run_time

GIB = 2**30
S = 128 * 1024  # tokens per rank


def test_flash_attn_2_dq_accum_per_deterministic_split():
    # Llama-3-8B, 16 query heads (4 KV heads) a call, 128K tokens, H200 (132 SMs)
    plain = backward_workspace("flash2", 1, S, S, 16, 4, 128, 2)
    dq = S * 16 * 128 * 4  # float32 (B, Sq, Hq, D): 1 GiB
    softmax_d = 16 * S * 4
    expanded = 2 * S * 16 * 128 * 2  # GQA: dK, dV with the query heads, bf16
    assert plain == dq + softmax_d + expanded
    det = backward_workspace("flash2", 1, S, S, 16, 4, 128, 2, deterministic=True, sms=132)
    assert det - plain == 8 * dq  # ceil(132 / 16) = 9 copies: about 9 GiB of dq_accum
    assert 9 * GIB <= det - expanded - softmax_d < 9.1 * GIB
    # rounding: rows up to 128, head dim up to 32 (256 above 192)
    assert backward_workspace("flash2", 1, 100, 100, 1, 1, 72, 2) == 128 * 96 * 4 + 128 * 4
    assert backward_workspace("flash2", 1, 128, 128, 1, 1, 200, 2) == 128 * 256 * 4 + 128 * 4


def test_other_families():
    assert backward_workspace(None, 1, S, S, 32, 8, 128, 2) == 0  # CPU flash op: not counted
    assert backward_workspace("efficient", 1, 10, 20, 4, 1, 8, 4) == 10 * 4 * 8 * 4 + 4 * 20 * 4 * 8 * 4
    assert backward_workspace("flash4", 1, 100, 100, 2, 2, 64, 2) == 2 * 128 * 64 * 4 + 2 * 2 * 128 * 4
    assert backward_workspace("reference", 1, 10, 20, 2, 1, 8, 8) == 3 * 2 * 10 * 20 * 8


def test_nothing_fits_means_the_smallest_footprint_not_one_head():
    # deterministic: fewer heads a call, more splits; 132 SMs, 8 KV heads of 4 query heads
    need = lambda g: backward_workspace("flash2", 1, S, S, 4 * g, g, 128, 2,  # noqa: E731
                                        deterministic=True)
    g = kv_heads_per_group(need, 8, 0)
    assert need(g) == min(need(h) for h in range(1, 9))


def _named(name: str) -> Kernel:
    return Kernel(name, REFERENCE.forward, REFERENCE.backward)


def test_runtime_groups_count_the_kernel_workspace(monkeypatch):
    """The ring engine's head groups count the selected kernel's workspace (a flash-attn 2
    stand-in on CPU tensors), and the planner picks the same group with the same family."""
    import easy_context.parallel.ring as ring

    monkeypatch.setattr(ring, "select_kernel", lambda q: _named("flash_attn"))
    q = torch.randn(1, 4096, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 4, 64, dtype=torch.bfloat16)
    m, dims = ec.METHODS["ring_attn"], AttentionDims(8, 4, 64)
    for budget in (12 * 2**20, 26 * 2**20, 2**30):
        want = m.kv_heads_per_group(dims, 4096, 2, 2, budget=budget,
                                    workspace=kernel_workspace("gpu", 2))
        assert ring_group_at_run_time(monkeypatch, q, k, budget) == want
        assert want <= m.kv_heads_per_group(dims, 4096, 2, 2, budget=budget)
    assert ring_group_at_run_time(monkeypatch, q, k, 2**30) == 4  # a gigabyte holds them all
    # 26 MiB: four KV heads of ring buffers (6.3 MB each) fit, two with the workspace (4.2 MB)
    assert ring_group_at_run_time(monkeypatch, q, k, 26 * 2**20) == 2
    assert m.kv_heads_per_group(dims, 4096, 2, 2, budget=26 * 2**20) == 4


def test_local_attention_runs_head_groups_when_the_workspace_passes_the_budget():
    """One device: the reference kernel's score tensors grow with the heads a call; under a
    small budget the call goes a KV head at a time, with the same result."""
    torch.manual_seed(0)
    q = torch.randn(1, 64, 8, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 64, 2, 16, dtype=torch.float64, requires_grad=True)
    full = ec.local_attention(q, k, k, causal=True)
    need = block_workspace(REFERENCE, q)(64, 64, 4, 1)
    with attention_buffer_budget(need):
        grouped = ec.local_attention(q, k, k, causal=True)
    torch.testing.assert_close(grouped, full, rtol=0, atol=1e-12)


def test_planner_counts_the_workspace_per_kernel_and_deterministic_setting():
    shape = load_shape("Llama-3-8B")
    kw = dict(engine="fsdp", checkpointing="full", dtype="bf16")
    plain = estimate_memory(shape, 8 * S, 8, "zigzag_ring_attn", **kw)
    det = estimate_memory(shape, 8 * S, 8, "zigzag_ring_attn", deterministic=True, **kw)
    cpu = estimate_memory(shape, 8 * S, 8, "zigzag_ring_attn", device="cpu", **kw)
    assert cpu.attention_workspace == 0
    assert plain.attention_workspace > 0 and det.attention_workspace > 8 * GIB
    assert det.attention_layer == (det.attention_backward + det.attention_buffers
                                   + det.attention_workspace)
    assert "attention workspace" in det.table()
    fa4 = estimate_memory(shape, 8 * S, 8, "zigzag_ring_attn", kernel="flash4", **kw)
    assert fa4.attention_workspace != plain.attention_workspace
    with pytest.raises(ValueError, match="unknown kernel family"):
        estimate_memory(shape, 8 * S, 8, "zigzag_ring_attn", kernel="nope", **kw)


def test_plan_cli_and_auto_memory_plan_for_deterministic_backward(capsys):
    from easy_context.cli import main
    from easy_context.plan.auto import Setup

    argv = ["plan", "--model", "Llama-3-8B", "--devices", "8", "--seq-len", "1048576",
            "--method", "zigzag_ring_attn"]
    rows = {}
    for extra in ([], ["--deterministic"], ["--kernel", "flash4"]):
        assert main(argv + extra) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if "attention workspace" in l)
        rows[" ".join(extra)] = float(line.split()[2])
    assert rows["--deterministic"] > 8 > rows[""] > 0 and rows["--kernel flash4"] != rows[""]
    setup = Setup("zigzag_ring_attn", None, "fsdp", "none", "full", deterministic=True)
    assert setup.kw("bf16")["deterministic"] and "--deterministic" in setup.train_flags(8192, 8)
