"""The attention benchmark runs end to end (--quick, ring_attn only) and writes its JSON."""

import json

import pytest

from benchmarks import common

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
    # fwd+bwd: 1 block on rank 0, 2 on rank 1, each once per KV head (one head group a pass)
    hkv = ring["kv_heads"]
    assert ring["kernel_calls_per_rank"] == [2 * hkv, 4 * hkv]
    assert "ring_attn" in data["table"]


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
