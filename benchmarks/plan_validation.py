"""Check the memory planner (easy_context.plan) against one real training step per rank.

For each point (method, N, L, checkpointing) N fresh gloo ranks (easy_context.testing.DistPool,
MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the OS) each:
  1. import torch/transformers/easy_context and join the process group ("ready");
  2. build a tiny Llama in fp32 (4 layers, hidden 256, 4 heads, 2 KV heads, vocab 32000),
     switch it with apply_sequence_parallel(model, method), enable per-layer
     torch.utils.checkpoint for checkpointing=full, and create AdamW with its states
     (one step on zero gradients), so that the measured step is a steady-state step;
  3. run ONE training step: forward, chunked loss (causal_lm_loss(..., chunked=True)),
     backward, gradient all-reduce over the ranks, AdamW step.
The measured figure is each rank's resident-set high-water mark from "ready" to the end
(easy_context.memory.peak.PeakMemory), i.e. everything the step and the model add to a
process that has only imported its libraries. The prediction is
estimate_memory(...).total for the same setup (engine "replicated": this harness keeps a
full model per rank, as plain data parallelism does) plus ONE runtime constant for the CPU
process (first-use allocations of oneDNN, the autograd engine, gloo), calibrated by the
same harness on a model too small to matter (``--calibrate``), not per configuration.

    python benchmarks/plan_validation.py               # all points -> results/plan_validation.json
    python benchmarks/plan_validation.py --calibrate   # re-measure the runtime constant first
    python benchmarks/plan_validation.py --quick       # two small points, a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale: the planner, the measured step
# (apply_sequence_parallel, the chunked loss, checkpointing) and, for --trainer,
# `easy-context train` end to end
MEASURES = ["easy_context/train", "easy_context/parallel", "easy_context/attention",
            "easy_context/memory", "easy_context/integrations", "easy_context/plan",
            "easy_context/utils", "easy_context/launch.py", "easy_context/mesh.py",
            "easy_context/layouts.py", "easy_context/models.py",
            "easy_context/sequence_parallel.py"]
TOLERANCE = 0.15


@dataclass(frozen=True)
class TinyLlama:
    """The validation model; ``vocab`` is Llama-2's, so the loss chunk is a real term."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 32000

    def build(self, seq_len: int):
        """The model in fp32, training mode, seeded: a transformers LlamaForCausalLM."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                             num_hidden_layers=self.layers, num_attention_heads=self.heads,
                             num_key_value_heads=self.kv_heads,
                             intermediate_size=self.intermediate, max_position_embeddings=seq_len,
                             attention_dropout=0.0, tie_word_embeddings=False)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).float().train()


# The smallest model that still runs every code path: its tensors are a few MB, so what it
# adds to a ready process is the runtime's first-use memory.
PROBE = TinyLlama(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=256)
PROBE_LEN = 256


@dataclass(frozen=True)
class Point:
    method: str
    world_size: int
    seq_len: int
    checkpointing: str  # none | full
    chunk_size: int = 2048

    @property
    def key(self) -> str:
        chunk = "" if self.chunk_size == 2048 else f" chunk={self.chunk_size}"
        return f"{self.method} N={self.world_size} L={self.seq_len} ckpt={self.checkpointing}{chunk}"


POINTS = [
    Point("ring_attn", 1, 8192, "none"),
    Point("ring_attn", 1, 8192, "full"),
    Point("ring_attn", 1, 16384, "full"),
    Point("zigzag_ring_attn", 2, 8192, "none"),
    Point("zigzag_ring_attn", 2, 16384, "full"),
    Point("ring_attn", 2, 16384, "none"),
    Point("ulysses_attn", 2, 8192, "none"),
    Point("ulysses_attn", 2, 16384, "full"),
    Point("allgather_attn", 2, 16384, "full"),
    Point("dist_flash_attn", 2, 8192, "none"),
    # A smaller loss chunk: the last layer's backward, with each method's buffers, is the peak.
    Point("zigzag_ring_attn", 2, 16384, "full", chunk_size=512),
    Point("ulysses_attn", 2, 16384, "full", chunk_size=512),
    Point("allgather_attn", 2, 16384, "full", chunk_size=512),
]
QUICK = [Point("zigzag_ring_attn", 2, 4096, "full"), Point("ring_attn", 1, 4096, "none")]


def model_shape(m: TinyLlama):
    from easy_context.plan import ModelShape

    return ModelShape(name="tiny-llama", hidden=m.hidden, layers=m.layers, heads=m.heads,
                      kv_heads=m.kv_heads, intermediate=m.intermediate, vocab=m.vocab,
                      tied_embeddings=False)


def rank_step(m: TinyLlama, p: Point) -> dict:
    """One steady-state training step on this rank; returns its peak above 'ready'."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401 - imported before "ready" (m.build uses it)

    import easy_context as ec
    from easy_context.memory.peak import PeakMemory, rss_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    ready = rss_bytes()
    t0 = time.perf_counter()
    with PeakMemory("cpu") as pm:
        model = m.build(p.seq_len)
        ec.apply_sequence_parallel(model, p.method,
                                   ring_degree=world if p.method == "usp_attn" else None)
        if p.checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for q in model.parameters():  # create the AdamW states: the step below is steady-state
            q.grad = torch.zeros_like(q)
        opt.step()
        opt.zero_grad(set_to_none=True)

        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, m.vocab, (1, p.seq_len + 1), generator=gen)
        local = ec.prepare_seq_parallel_inputs(p.method, ids[:, :-1], None, ids[:, 1:], rank, world,
                                               "cpu", ring_degree=world if p.method == "usp_attn" else None)
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=True, chunk_size=p.chunk_size)
        loss.backward()
        if world > 1:  # each rank's gradient is its share: the sum is the full gradient
            for q in model.parameters():
                dist.all_reduce(q.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"rank": rank, "ready_rss_bytes": ready, "peak_bytes": pm.peak_bytes,
            "loss": loss.detach().item(), "seconds": time.perf_counter() - t0,
            "threads": torch.get_num_threads()}


def measure(m: TinyLlama, p: Point, timeout_s: float = 900.0) -> list[dict]:
    """Run ``p`` on N fresh ranks (a fresh pool: no point inherits another's runtime state)."""
    from easy_context.testing import DistPool

    saved = {k: os.environ.get(k) for k in common.BENCH_ENV}
    common.setup_env()  # the ranks are spawned below: they start with the mmap threshold
    try:
        with DistPool(p.world_size, threads_per_rank=1, timeout_s=timeout_s) as pool:
            return pool.run(rank_step, m, p)
    finally:  # leave the caller's environment as it was (tests share the process)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def predict(m: TinyLlama, p: Point, runtime_bytes: int):
    from easy_context.plan import estimate_memory

    return estimate_memory(model_shape(m), p.seq_len, p.world_size, p.method, engine="replicated",
                           offload="none", checkpointing=p.checkpointing, dtype="fp32",
                           loss_chunk=p.chunk_size, runtime_bytes=runtime_bytes, device="cpu")


def calibrate() -> dict:
    """The CPU runtime constant: what a model of a few MB adds to a ready process, minus the
    planner's estimate for that model (its tensors)."""
    out = {}
    for n in (1, 2):
        p = Point("zigzag_ring_attn", n, PROBE_LEN, "none", chunk_size=PROBE_LEN)
        ranks = measure(PROBE, p)
        tensors = predict(PROBE, p, runtime_bytes=0).total
        out[n] = max(r["peak_bytes"] for r in ranks) - tensors
    return {"runtime_bytes": int(max(out.values())),
            "per_world_size": {str(k): int(v) for k, v in out.items()},
            "probe": asdict(PROBE), "probe_seq_len": PROBE_LEN}


def compare(m: TinyLlama, p: Point, ranks: list[dict], runtime_bytes: int) -> dict:
    est = predict(m, p, runtime_bytes)
    measured = max(r["peak_bytes"] for r in ranks)  # the rank that runs out first
    above_pred = est.total - runtime_bytes
    return {**asdict(p), "key": p.key,
            "measured_mb": measured / 2**20, "predicted_mb": est.total / 2**20,
            "error": est.total / measured - 1.0,
            "measured_above_runtime_mb": (measured - runtime_bytes) / 2**20,
            "predicted_above_runtime_mb": above_pred / 2**20,
            "error_above_runtime": above_pred / max(1, measured - runtime_bytes) - 1.0,
            "within_tolerance": abs(est.total / measured - 1.0) <= TOLERANCE,
            "per_rank_peak_bytes": [r["peak_bytes"] for r in ranks],
            "per_rank_peak_mb": [r["peak_bytes"] / 2**20 for r in ranks],
            "seconds": max(r["seconds"] for r in ranks),
            "components_mb": {k: v / 2**20 for k, v in est.components().items()}}


# ---------------------------------------------------------------------------- the trainer
# ``easy-context train`` itself, measured from outside (benchmarks/trainer_runs.py): each mode
# of max-length mode and the untiled layers, at three lengths, on 1 and 2 ranks.
TRAINER_TOLERANCE = 0.10


def trainer_points():
    from benchmarks.trainer_runs import TrainRun

    lengths = (4096, 8192, 16384)
    tiled = dict(mlp_tile=1024, head_chunk=4)  # one KV head (4 query heads) per chunk
    # every mode on 2 ranks; on one rank (two threads, slow on this shared machine) the two
    # main ones
    modes = [dict(), tiled, dict(tiled, checkpointing="attention"),
             dict(tiled, checkpointing="offload"),
             dict(mlp_tile=1024, head_chunk=1, keep_every=2),  # the most frugal: nested
             dict(mlp_tile=1024), dict(head_chunk=1)]  # each mechanism alone
    pts = [TrainRun("llama3-tiny", 1, L, **mode) for mode in modes[:2] for L in lengths]
    pts += [TrainRun("llama3-tiny", 2, L, **mode) for mode in modes for L in lengths]
    pts += [TrainRun("llama3-tiny", 2, L, method="ulysses_attn", **tiled) for L in lengths]
    # the case: a Qwen2-shaped model, glibc's default allocator against ours
    pts += [TrainRun("qwen2-tiny", 2, L, allocator=a) for a in ("glibc", "ours") for L in (8192, 16384)]
    return pts


def trainer_compare(run, row: dict, baseline: int) -> dict:
    from benchmarks.trainer_runs import predict

    est, predicted = predict(run)
    measured = max(row["rank_peaks_bytes"]) - baseline
    return {**row, "baseline_mb": baseline / 2**20, "measured_mb": measured / 2**20,
            "predicted_mb": predicted / 2**20, "error": predicted / measured - 1.0,
            "within_tolerance": abs(predicted / measured - 1.0) <= TRAINER_TOLERANCE,
            "components_mb": {k: v / 2**20 for k, v in est.components().items()},
            "host_mb": est.host_bytes / 2**20}


def trainer_growth(rows: list[dict]) -> list[dict]:
    """Measured against predicted growth of the peak between consecutive lengths."""
    out, by = [], {}
    for r in rows:
        if r.get("ok"):
            by.setdefault(r["key"].rsplit(" L=", 1)[0] + " " + r["key"].split(" L=")[1].split(" ", 1)[1], []).append(r)
    for group, rs in by.items():
        rs.sort(key=lambda r: r["seq_len"])
        for a, b in zip(rs, rs[1:]):
            m, p = b["measured_mb"] - a["measured_mb"], b["predicted_mb"] - a["predicted_mb"]
            out.append({"what": group, "from": a["seq_len"], "to": b["seq_len"],
                        "measured_growth_mb": m, "predicted_growth_mb": p,
                        "error": p / m - 1.0 if m else None})
    return out


def run_trainer_validation(args) -> None:
    from benchmarks.trainer_runs import import_baseline, run_train

    old = common.load_results(args.output) or {}
    points = trainer_points()
    if args.only:
        points = [p for p in points if any(s in p.key for s in args.only)]
    if args.recompute:  # measure nothing: the stored rows against the current planner
        stored = {r["key"]: r for r in old.get("trainer_rows", []) if r.get("ok")}
        baselines = {int(n): mb * 2**20 for n, mb in old["trainer_baselines_mb"].items()}
        points = [p for p in points if p.key in stored]
    else:
        baselines = {n: import_baseline(n) for n in sorted({p.world for p in points})}
    print("rank baseline before the model (imports, process group): "
          + ", ".join(f"N={n}: {b / 2**20:.0f} MB" for n, b in baselines.items()), flush=True)
    rows = []

    def write():  # after every point: a long run that is stopped keeps what it measured
        merged = common.merge_rows(old.get("trainer_rows", []), rows, key=lambda r: r["key"])
        ok = [r for r in merged if r.get("ok")]
        payload = {**old, "trainer_rows": merged, "trainer_growth": trainer_growth(ok),
                   "trainer_tolerance": TRAINER_TOLERANCE,
                   "trainer_baselines_mb": {str(n): b / 2**20 for n, b in baselines.items()},
                   "trainer_what": "per-rank VmHWM of `easy-context train` (two fp32 FSDP steps, "
                                   "the second steady-state) read from /proc, minus a probe "
                                   "rank's (imports + process group), vs the planner's total "
                                   "(+ host bytes: the same memory on a CPU)",
                   **({"trainer_predictions_recomputed": common.now_iso()} if args.recompute else
                      {"trainer_machine": common.machine_info(), "trainer_date": common.now_iso()}),
                   "trainer_max_abs_error": max(abs(r["error"]) for r in ok) if ok else None,
                   "trainer_all_within_tolerance": all(r["within_tolerance"] for r in ok)}
        return common.write_results(args.output, payload)

    for p in points:
        row = stored[p.key] if args.recompute else run_train(p)
        if row["ok"]:
            row = trainer_compare(p, row, baselines[p.world])
            print(f"{p.key:80s} measured {row['measured_mb']:7.1f} MB  predicted "
                  f"{row['predicted_mb']:7.1f} MB  error {100 * row['error']:+5.1f}%  "
                  f"step {row['step_s']:.0f} s", flush=True)
        else:
            print(f"{p.key}: FAILED {row['error'][-300:]}", flush=True)
        rows.append(row)
        path = write()
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="re-measure the CPU runtime constant")
    ap.add_argument("--quick", action="store_true", help="two small points only")
    ap.add_argument("--only", nargs="*", help="keys (or substrings) of the points to run")
    ap.add_argument("--recompute", action="store_true",
                    help="measure nothing: re-predict the stored rows with the current planner")
    ap.add_argument("--output", default=str(common.RESULTS_DIR / "plan_validation.json"))
    ap.add_argument("--trainer", action="store_true",
                    help="validate against `easy-context train` itself, measured from outside")
    args = ap.parse_args()
    if args.trainer:
        return run_trainer_validation(args)

    from easy_context.plan.estimate import CPU_RUNTIME_BYTES

    old = common.load_results(args.output) or {}
    calib = calibrate() if args.calibrate else old.get("calibration") or {
        "runtime_bytes": CPU_RUNTIME_BYTES, "note": "easy_context.plan.estimate.CPU_RUNTIME_BYTES"}
    runtime = calib["runtime_bytes"]
    print(f"CPU runtime constant: {runtime / 2**20:.1f} MiB")
    points = QUICK if args.quick else POINTS
    if args.only:
        points = [p for p in points if any(s in p.key for s in args.only)]
    m, rows = TinyLlama(), []
    if args.recompute:
        stored = {r["key"]: r for r in old.get("rows", [])}
        points = [p for p in POINTS if p.key in stored]
    for p in points:
        if args.recompute:
            r = stored[p.key]
            peaks = r.get("per_rank_peak_bytes") or [round(mb * 2**20) for mb in r["per_rank_peak_mb"]]
            ranks = [{"peak_bytes": b, "seconds": r["seconds"]} for b in peaks]
        else:
            ranks = measure(m, p)
        row = compare(m, p, ranks, runtime)
        rows.append(row)
        print(f"{p.key:45s} measured {row['measured_mb']:8.1f} MB  predicted {row['predicted_mb']:8.1f} MB"
              f"  error {100 * row['error']:+6.1f}%  (above runtime {100 * row['error_above_runtime']:+6.1f}%)"
              f"  {row['seconds']:.0f} s", flush=True)
    rows = common.merge_rows(old.get("rows", []), rows, key=lambda r: r["key"])
    # **old: the --trainer run's keys (trainer_*) stay as that run wrote them
    payload = {**old, "what": "per-rank peak RSS of one steady-state fp32 training step vs the planner",
               "model": asdict(m), "tolerance": TOLERANCE, "calibration": calib,
               "machine": common.machine_info(), "date": common.now_iso(), "rows": rows,
               "max_abs_error": max(abs(r["error"]) for r in rows),
               "all_within_tolerance": all(r["within_tolerance"] for r in rows)}
    if not args.quick:
        print(f"wrote {common.write_results(args.output, payload)}")


if __name__ == "__main__":
    main()
