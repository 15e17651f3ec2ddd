"""The benchmarks run end to end on small inputs (attention --quick, the GPU check on the CPU,
one max-length-mode training run of benchmarks/maxlen.py) and write what the README quotes."""

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
    # the two shorter steps profiled: top operators by self time, largest first
    for s in steps:
        assert ("profile" in s) == (s["L"] != 512), s
    for s in steps[:2]:
        top = s["profile"]["top"]
        assert s["profile"]["clock"] == "self_cpu_time_total" and 0 < len(top) <= 15
        assert [t["self_ms"] for t in top] == sorted((t["self_ms"] for t in top), reverse=True)
        assert any("mm" in t["name"] for t in top), top  # the matmuls are among them
    fused = train["max_length_mode"]
    assert fused["L"] == 512 and fused["max_length_mode"] == {"mlp_tile": 128, "heads_per_chunk": 2}
    # max-length mode ran through the GPU check's train code: the plain step's first loss
    # (bf16, same data and weights). A wiring check, not the exactness test: at random
    # init the loss hardly depends on the layers (an MLP output scaled by 0.999 moved it by
    # 2.6e-6 in fp32), so tests/dist/test_maxlen.py compares gradients (it caught that)
    assert fused["tokens_per_s"] > 0, fused
    assert abs(fused["loss"] - steps[-1]["loss"]) <= 1e-5 * abs(steps[-1]["loss"]), fused
    tf = data["sections"]["attention"]
    assert tf["easy_context"]["fwd_bwd_s"] > 0 and tf["torch_sdpa"]["fwd_bwd_s"] > 0
    # the engine section: every setup took its step in a group made as the trainer makes it,
    # under the strict collective check; the first loss is the model's before any update,
    # the same in every setup but QLoRA's (a quantized base)
    engine = data["sections"]["engine"]["tiny"]
    assert engine["error"] is None, engine["error"]
    rows = {r["setup"]: r for r in engine["rows"]}
    assert len(rows) == 12 and not [r for r in rows.values() if "failed" in r], rows
    ran = [r for r in rows.values() if "skipped" not in r]
    assert all(r["loss_finite"] and r["process_group_backend"] == "gloo" for r in ran)
    plain = rows["fsdp"]["loss"]
    for name, r in rows.items():
        if name != "qlora" and "skipped" not in r:
            assert abs(r["loss"] - plain) <= 1e-5 * plain, (name, r["loss"], plain)
    if "skipped" not in rows["qlora"]:
        assert abs(rows["qlora"]["loss"] - plain) > 1e-6
    if "skipped" not in rows["deepspeed"]:
        assert sum(rows["deepspeed"]["collectives"].values()) > 0
    assert engine["summary"]["offloaded_over_kept_step"] > 0
    # generate: every method's greedy tokens equal transformers' (fp32 on the CPU)
    gen = data["sections"]["generate"]
    for family, rows in gen["tokens"].items():
        assert set(rows) == set(METHODS), (family, rows)
        assert all(r.get("equal") for r in rows.values()), (family, rows)
    speed = gen["speed"]
    assert speed["tokens_agree"] == speed["new_tokens"], speed
    assert speed["easy_context"]["cache_bytes"] > 0, speed
    # record: the planner's longest LoRA setup for a full-depth model (4 layers tiny), one step
    # run at a capped length, its peak beside the plan's total
    record = data["sections"]["record"]
    assert "failed" not in record and "skipped" not in record, record
    assert record["planned_length"] >= record["L"] > 0 and record["loss_finite"], record
    assert record["trainable_parameters"] > 0 and record["planned_total_bytes"] > 0, record
    assert record["setup"]["checkpointing"] in ("attention", "full", "offload"), record


def test_maxlen_benchmark_runs_and_ratios(monkeypatch):
    """benchmarks/maxlen.py: one real `easy-context train` run in max-length mode, watched
    from outside as the benchmark does (launch, per-rank peaks from /proc, the metrics it
    reads back), and the tiled/untiled ratio part on rows of known figures (its runs
    stubbed: two real runs here cost a minute more and test nothing more)."""
    import math

    from benchmarks import maxlen
    from benchmarks.trainer_runs import TrainRun, run_train

    row = run_train(TrainRun("llama3-tiny", 2, 512, mlp_tile=128, head_chunk=4))
    assert row["ok"], row.get("error")
    assert len(row["rank_peaks_bytes"]) == 2 and min(row["rank_peaks_bytes"]) > 0, row
    assert row["step_s"] > 0 and math.isfinite(row["loss"]), row

    MB = maxlen.MB
    # (peak MB, step s) per run; the first round warms up and must not count
    figures = {"ours-untiled": iter([(999, 9.0), (400, 2.0), (420, 2.4)]),
               "ours-maxlen": iter([(999, 9.0), (250, 2.2), (260, 2.2)])}

    def run_ours(system, length):
        peak, step = next(figures[system])
        return {"system": system, "seq_len": length, "ok": True, "step_s": step,
                "rank_peaks_bytes": [peak * MB, peak * MB - 1]}

    monkeypatch.setattr(maxlen, "run_ours", run_ours)
    ratio = maxlen.part_ratio(512, repeats=2, baseline=100 * MB)
    assert [(r["system"], r["dropped"]) for r in ratio["rows"]] == [
        ("ours-untiled", True), ("ours-maxlen", True), ("ours-maxlen", False),
        ("ours-untiled", False), ("ours-untiled", False), ("ours-maxlen", False)]
    # the lower peak of each system above the baseline; the median step times
    assert ratio["peak_above_baseline_mb"] == {"ours-untiled": 300, "ours-maxlen": 150}
    assert ratio["peak_per_token_ratio"] == 0.5
    assert ratio["median_step_s"] == {"ours-untiled": 2.2, "ours-maxlen": 2.2}
    assert math.isclose(ratio["time_ratio"], 1.0)
    assert ratio["targets"] == [{"target": "step time tiled / untiled <= 1.15", "value": 1.0,
                                 "result": "PASS"}]


def test_hf_trainer_summary_drops_the_first_round_and_takes_medians():
    """benchmarks/hf_trainer.py's figures from its rows (the runs themselves take minutes):
    round 0 is warm-up, medians of the rest, growth from the shortest length, targets."""
    from benchmarks import hf_trainer

    mb = hf_trainer.MB

    def row(system, L, repeat, step, peak_mb, ok=True):
        return {"system": system, "seq_len": L, "repeat": repeat, "ok": ok, "step_s": step,
                "rank_peaks_bytes": [peak_mb * mb, peak_mb * mb - 1], "loss": 1.0}

    rows = [row("ours-maxlen", 2048, 0, 50.0, 900),  # warm-up: neither its time nor its peak
            row("ours-maxlen", 2048, 1, 4.0, 100), row("ours-maxlen", 2048, 2, 6.0, 102),
            row("ours-maxlen", 2048, 3, 5.0, 104),
            row("ec-train-maxlen", 2048, 1, 4.0, 90), row("ec-train-maxlen", 2048, 2, 5.0, 90),
            row("ours-maxlen", 4096, 1, 9.0, 150), row("ours-maxlen", 4096, 2, 9.0, 150),
            row("accelerate-ulysses", 2048, 1, 7.0, 200), row("accelerate-ulysses", 4096, 1, 9.0, 260),
            {"system": "accelerate-cp", "seq_len": 2048, "repeat": 1, "ok": False,
             "error": "ValueError: no CPU\ntail"}]
    s = hf_trainer.summarise(rows, [2048, 4096])
    m = {(r["system"], r["seq_len"]): r for r in s["measured"]}
    got = m[("ours-maxlen", 2048)]
    assert (got["step_s"], got["step_s_min"], got["step_s_max"], got["runs"]) == (5.0, 4.0, 6.0, 3)
    assert got["peak_bytes"] == 102 * mb
    assert s["growth_mb"]["ours-maxlen"]["4096"] == 48 and s["growth_mb"]["accelerate-ulysses"]["4096"] == 60
    targets = {t["target"]: t for t in s["targets"]}
    assert targets["ours-maxlen peak growth 2048 -> 4096 <= accelerate-ulysses's"]["result"] == "PASS"
    step = targets["ours-maxlen step time <= 1.1x ec-train-maxlen's at L=2048"]
    assert step["ratio"] == round(5.0 / 4.5, 3) and step["result"] == "FAIL"
    assert s["did_not_run"] == {"accelerate-cp": "ValueError: no CPU"}
    table = hf_trainer.table({**s, "rows": rows, "world": 2, "date": "2026-12-03T00:00",
                              "machine": {"cpu_description": "a CPU", "git_commit": "abc"}})
    assert "| ours-maxlen | 2048 | 102 |  | 5.00 (4.00-6.00) | 1.111x |" in table
    assert "| accelerate-cp | 2048 | did not run | | | |" in table
    assert "median of 3 rounds" in table and "accelerate-cp did not run: ValueError: no CPU" in table
    # a failed torchrun run is recorded with its rank's exception, not torchrun's own
    out = ("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: needs FSDP2\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert hf_trainer._first_error(out).splitlines()[0] == "[rank1]: ValueError: needs FSDP2"
