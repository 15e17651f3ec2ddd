"""The attention benchmark runs end to end (--quick, ring_attn only) and writes its JSON."""

import json

import pytest

from benchmarks import common
from easy_context.parallel import METHODS, AttentionDims
from easy_context.parallel.head_groups import BUDGETS

pytestmark = pytest.mark.slow  # ~10-15 s on 2 cores: three processes import torch/transformers


def test_attention_benchmark_quick(tmp_path):
    out = tmp_path / "attention.json"
    proc = common.run_script(["benchmarks/attention.py", "--quick", "--methods", "ring_attn",
                              "--no-deepspeed", "--output", str(out)], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("machine", "protocol", "rows", "targets", "runs", "table", "deepspeed",
                "skipped_methods"):
        assert key in data, key
    assert data["runs"][-1]["worker_malloc_mmap_threshold"] == common.BENCH_ENV["MALLOC_MMAP_THRESHOLD_"]
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"single", "ring_attn"}
    single, ring = rows["single"], rows["ring_attn"]
    assert single["L"] == ring["L"] == 2048 and single["world_size"] == 1 and ring["world_size"] == 2
    for key in ("time_ms", "peak_mb", "time_ms_per_rank", "peak_mb_per_rank", "kernel_ms_per_rank",
                "time_ratio_vs_single", "mem_ratio_vs_single", "cpu_ratio_vs_single",
                "kernel_imbalance", "schedule_imbalance"):
        assert ring.get(key) is not None, key
    assert ring["time_ms"] > 0 and ring["peak_mb"] > 0 and len(ring["time_ms_per_rank"]) == 2
    # ring_attn's causal schedule: rank 1 computes 3x the score entries of rank 0
    assert ring["schedule_imbalance"] == pytest.approx(3.0, rel=0.01)
    # fwd+bwd: 1 block on rank 0, 2 on rank 1, each once per pass over a group of KV heads
    # (as many heads as the CPU buffer budget allows at this length, easy_context.parallel.
    # head_groups)
    hkv = ring["kv_heads"]
    per_group = METHODS["ring_attn"].kv_heads_per_group(
        AttentionDims(ring["heads"], hkv, ring["head_dim"]), ring["L"] // 2, 2, 2,
        budget=BUDGETS["cpu"])
    passes = -(-hkv // per_group)
    assert ring["kernel_calls_per_rank"] == [2 * passes, 4 * passes]
    assert "ring_attn" in data["table"]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py --cpu --tiny: the GPU check's code, every section, in CI."""
    out = tmp_path / "gpu_check.json"
    proc = common.run_script(["benchmarks/gpu_check.py", "--cpu", "--tiny", "--output", str(out)],
                             timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    kernels, methods, train = (data["sections"][k] for k in ("kernels", "methods", "train"))
    # kernels: every case ran, fp32 at the reference's accuracy, bf16 near the plain error
    assert kernels["failed"] == [] and kernels["kernels"] == ["cpu_flash"]
    for row in kernels["rows"]:
        assert row["shapes_and_dtypes_ok"], row
        if row["dtype"] == "fp32":
            assert max(row["error"].values()) < 1e-5, row
        else:
            assert row["ratio_to_plain"] < 3, row
    assert max(kernels["documents"][0]["error"].values()) < 1e-5
    # every method at one rank and at two ranks on the one device, fp32 on the CPU
    one = methods["one_rank"]
    assert {r["method"] for r in one} == set(METHODS) and all("error" in r for r in one), one
    assert max(max(r["error"].values()) for r in one) < 1e-5
    two = methods["two_ranks_one_device"]
    assert two["ran"] and max(two["worst_error_per_case"].values()) < 1e-5, two
    # training steps at three lengths, with the planner's prediction beside the measurement
    steps = train["steps"]
    assert [s["L"] for s in steps] == [128, 256, 512]
    for s in steps:
        assert s["tokens_per_s"] > 0 and s["predicted_bytes"]["above_weights"] > 0, s
    fused = train["max_length_mode"]
    assert fused["L"] == 512 and fused["max_length_mode"] == {"mlp_tile": 128, "heads_per_chunk": 2}
    assert fused["tokens_per_s"] > 0 and abs(fused["loss"] - steps[-1]["loss"]) < 0.05, fused
    tf = train["attention_tflops"]
    assert tf["easy_context"]["fwd_bwd_s"] > 0 and tf["torch_sdpa"]["fwd_bwd_s"] > 0


def test_maxlen_benchmark_ratio_quick(tmp_path):
    """benchmarks/maxlen.py's tiled/untiled part on a short sequence: two `easy-context train`
    runs watched from outside, their peaks, step times and the ratios."""
    out = tmp_path / "maxlen.json"
    proc = common.run_script(["benchmarks/maxlen.py", "--parts", "ratio", "--ratio-length", "512",
                              "--repeats", "1", "--output", str(out)], timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ratio = json.loads(out.read_text())["ratio"]
    assert {r["system"] for r in ratio["rows"]} == {"ours-untiled", "ours-maxlen"}
    assert all(r["ok"] and len(r["rank_peaks_bytes"]) == 2 for r in ratio["rows"])
    assert ratio["time_ratio"] > 0 and ratio["peak_per_token_ratio"] > 0
    assert ratio["targets"][0]["target"] == "step time tiled / untiled <= 1.15"
