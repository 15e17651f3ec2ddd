"""Max-length mode measured: against DeepSpeed's ALST side by side, and tiled against untiled.

Everything is measured from outside, the same way for every system: the per-rank resident
high-water mark (VmHWM) read from /proc while the command runs (benchmarks/common.py
watch_ranks), on 2 gloo ranks, for the tiny model with Llama-3-8B's proportions (hidden 256,
intermediate 896, 4 layers, 8 query / 2 KV heads, vocabulary 32000), fp32, one random
sequence of L tokens. Step times are each system's own per-step wall time (slowest rank).

1. ``alst``: at each length (2K, 16K, 32K) one run of each system, in an order that rotates
   from one length to the next:
   - alst: benchmarks/alst_step.py (DeepSpeed 0.19.8's Ulysses attention for transformers,
     TiledMLP, TiledFusedLogitsLoss with 64 MiB shards, ZeRO-3, per-layer checkpointing),
     run with MALLOC_MMAP_THRESHOLD_=65536 (as the issue measured it);
   - ours-untiled: ``easy-context train`` (zigzag ring attention, FSDP, full checkpointing);
   - ours-maxlen: the same with --mlp-tile 1024 --head-chunk 4 (one KV head per chunk);
   - ours-maxlen-frugal: --mlp-tile 1024 --head-chunk 1 --keep-every 2 (one query head per
     chunk, one layer input in two kept: the least memory).
   Our runs set nothing in the environment: the trainer sets its allocator up itself.
   Growth = peak at L minus peak at the shortest length (what the issue compares).
2. ``ratio``: at one length, ``--repeats`` round-robin rounds of ours-untiled and ours-maxlen
   (a first round dropped):
   peak per token (above a rank's import baseline) tiled / untiled and the median step time
   tiled / untiled (target <= 1.15).
3. ``fit``: the memory the untiled run needed at that length as a per-rank budget (so that
   length is the longest that fits both ways); the planner's longest tiled length within it
   (easy_context.plan, validated in plan_validation.py --trainer), run once: its measured
   peak against the budget.

    python benchmarks/maxlen.py                      # all three parts -> results/maxlen.json
    python benchmarks/maxlen.py --parts ratio --repeats 5
    python benchmarks/maxlen.py --shape gemma3-tiny --systems alst,ours-maxlen,ours-maxlen-frugal
    python benchmarks/maxlen.py --shape deepseek3-tiny --systems alst,ours-maxlen,ours-maxlen-frugal

``--shape`` runs part 1 for another tiny model of benchmarks/trainer_runs.py (Gemma 3's
sliding + global layers, DeepSeek-V3's MLA and MoE; both run max-length mode's generic path),
written into the file's ``shapes`` entry with its own command, commit and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.trainer_runs import (MODELS, TrainRun, import_baseline, model_dir,  # noqa: E402
                                     predict, run_train)

# the modules whose change makes these results stale: `easy-context train` end to end (its
# imports), the planner for the fit part
MEASURES = ["easy_context/train", "easy_context/parallel", "easy_context/attention",
            "easy_context/memory", "easy_context/integrations", "easy_context/plan",
            "easy_context/utils", "easy_context/launch.py", "easy_context/mesh.py",
            "easy_context/layouts.py", "easy_context/models.py",
            "easy_context/sequence_parallel.py"]
MB = 2**20
TILED = dict(mlp_tile=1024, head_chunk=4)  # one KV head (4 query heads) per chunk
SYSTEMS = {
    "ours-untiled": dict(),
    "ours-maxlen": TILED,
    # the most frugal: one query head per chunk, one layer input in two kept
    "ours-maxlen-frugal": dict(mlp_tile=1024, head_chunk=1, keep_every=2),
}


def run_alst(seq_len: int, world: int = 2, timeout_s: float = 7200,
             model: str = "llama3-tiny") -> dict:
    cmd = [sys.executable, str(Path(__file__).with_name("alst_step.py")), "--model",
           str(model_dir(model)), "--seq-len", str(seq_len), "--nproc", str(world)]
    r = common.watch_ranks(cmd, env=common.bench_env(), timeout_s=timeout_s)
    row = {"system": "alst", "model": model, "seq_len": seq_len, "world": world,
           "ok": r["returncode"] == 0,
           "wall_s": r["wall_s"], "rank_peaks_bytes": r["rank_peaks_bytes"][:world]}
    result = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
    if row["ok"] and result:
        import json

        row.update(json.loads(result[-1][len("RESULT "):]))
    else:
        row.update(ok=False, error=(r["stderr"] or r["stdout"])[-1500:])
    return row


def run_ours(system: str, seq_len: int, world: int = 2, model: str = "llama3-tiny") -> dict:
    row = run_train(TrainRun(model, world, seq_len, **SYSTEMS[system]))
    return {**row, "system": system}


def _peak(row: dict) -> int:
    return max(row["rank_peaks_bytes"])


def part_alst(lengths: list[int], systems: list[str], model: str = "llama3-tiny",
              on_row=None, reused: list[dict] | None = None) -> dict:
    """``on_row(rows)``: called after each run with the rows so far (to save them);
    ``reused``: rows of an earlier run taken as they are (each says so in ``reused_from``),
    their systems not run again."""
    rows = list(reused or [])
    again = {r["system"] for r in rows}
    for i, L in enumerate(lengths):
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        for system in order:
            if system in again:
                continue
            row = (run_alst(L, model=model) if system == "alst"
                   else run_ours(system, L, model=model))
            row["load_average_after"] = common.load_average()
            rows.append(row)
            state = (f"peak {_peak(row) / MB:.0f} MB, step {row['step_s']:.0f} s" if row["ok"]
                     else "FAILED " + row.get("error", "")[-300:])
            print(f"[alst] {model} {system:20s} L={L:6d}: {state}", flush=True)
            if on_row is not None:
                on_row(rows)
    growth, first = {}, {}
    for row in rows:
        if row["ok"] and row["seq_len"] == lengths[0]:
            first[row["system"]] = _peak(row)
    for row in rows:
        if row["ok"] and row["system"] in first and row["seq_len"] != lengths[0]:
            growth.setdefault(row["system"], {})[str(row["seq_len"])] = (
                (_peak(row) - first[row["system"]]) / MB)
    # the growth between the two longest lengths: the per-token cost, free of whatever a
    # system's floor at the shortest length (its loss shards, say) absorbs
    longest = {}
    if len(lengths) > 2:
        peaks = {(r["system"], r["seq_len"]): _peak(r) for r in rows if r["ok"]}
        a, b = lengths[-2], lengths[-1]
        longest = {s: (peaks[(s, b)] - peaks[(s, a)]) / MB for s in systems
                   if (s, a) in peaks and (s, b) in peaks}
    targets = []
    for L in lengths[1:]:
        a = growth.get("alst", {}).get(str(L))
        for s in systems:
            if s.startswith("ours-maxlen") and a is not None and str(L) in growth.get(s, {}):
                g = growth[s][str(L)]
                targets.append({"target": f"{s} peak growth {lengths[0]} -> {L} <= ALST's",
                                "ours_mb": round(g, 1), "alst_mb": round(a, 1),
                                "result": "PASS" if g <= a else "FAIL"})
    times = {(r["system"], r["seq_len"]): r["step_s"] for r in rows if r["ok"]}
    for s in systems:
        if s.startswith("ours-maxlen") and (s, lengths[-1]) in times and ("alst", lengths[-1]) in times:
            ours, alst = times[(s, lengths[-1])], times[("alst", lengths[-1])]
            targets.append({"target": f"{s} step time < ALST's at L={lengths[-1]}",
                            "ours_s": round(ours, 1), "alst_s": round(alst, 1),
                            "result": "PASS" if ours < alst else "FAIL"})
    return {"rows": rows, "growth_mb": growth, "targets": targets,
            "growth_between_longest_mb": longest}


def part_ratio(length: int, repeats: int, baseline: int) -> dict:
    rows = []
    # round-robin, the order alternating by round; round 0 warms up and is dropped
    for i in range(repeats + 1):
        for system in (("ours-untiled", "ours-maxlen") if i % 2 == 0 else
                       ("ours-maxlen", "ours-untiled")):
            row = run_ours(system, length)
            row["load_average_after"] = common.load_average()
            row["dropped"] = i == 0
            rows.append(row)
            print(f"[ratio] {system:14s} L={length}: "
                  + (f"peak {_peak(row) / MB:.0f} MB, step {row['step_s']:.1f} s" if row["ok"]
                     else "FAILED"), flush=True)
    ok = {s: [r for r in rows if r["ok"] and r["system"] == s and not r["dropped"]]
          for s in ("ours-untiled", "ours-maxlen")}
    if not all(ok.values()):
        return {"rows": rows, "error": "a run failed"}
    above = {s: min(_peak(r) for r in rs) - baseline for s, rs in ok.items()}
    step = {s: statistics.median(r["step_s"] for r in rs) for s, rs in ok.items()}
    time_ratio = step["ours-maxlen"] / step["ours-untiled"]
    return {"rows": rows, "length": length, "baseline_mb": baseline / MB,
            "peak_above_baseline_mb": {s: v / MB for s, v in above.items()},
            "peak_per_token_ratio": above["ours-maxlen"] / above["ours-untiled"],
            "median_step_s": step, "time_ratio": time_ratio,
            "per_pair_time_ratios": [ok["ours-maxlen"][i]["step_s"] / ok["ours-untiled"][i]["step_s"]
                                     for i in range(min(len(ok["ours-maxlen"]), len(ok["ours-untiled"])))],
            "targets": [{"target": "step time tiled / untiled <= 1.15", "value": round(time_ratio, 3),
                         "result": "PASS" if time_ratio <= 1.15 else "FAIL"}]}


def part_fit(length: int, budget: int, granularity: int = 1024) -> dict:
    """The planner's longest tiled length within ``budget`` above the baseline, run once."""
    def predicted(L):
        return predict(TrainRun("llama3-tiny", 2, L, **TILED))[1]

    lo = length
    while predicted(lo + granularity) <= budget:
        lo += granularity
    row = run_ours("ours-maxlen", lo)
    print(f"[fit] ours-maxlen L={lo}: " + (f"peak {_peak(row) / MB:.0f} MB" if row["ok"] else
                                           "FAILED"), flush=True)
    return {"budget_above_baseline_mb": budget / MB, "untiled_length": length,
            "tiled_longest_planned": lo, "tiled_predicted_mb": predicted(lo) / MB, "row": row}


def run_shape(args, old: dict, argv: list[str]) -> int:
    """The alst part for another shape, merged into the file under ``shapes.<shape>`` with its
    own command, machine record (commit, load) and date; the rest of the file as it was."""
    started, load_before = time.perf_counter(), common.load_average()

    def save(part: dict) -> str:
        part.update(command="python benchmarks/maxlen.py " + " ".join(argv),
                    model=f"{args.shape} (benchmarks/trainer_runs.py)", world=2,
                    machine=common.machine_info(), load_average_before=load_before,
                    load_average_after=common.load_average(), date=common.now_iso(),
                    total_s=time.perf_counter() - started)
        now = common.load_results(args.output) or old  # another shape's run may have written
        payload = {**now, "shapes": {**now.get("shapes", {}), args.shape: part}}
        return common.write_results(args.output, payload)

    lengths = [int(x) for x in args.lengths.split(",")]
    reused = []
    if args.reuse:  # rows of systems whose code did not change, from the file's last run
        before = old.get("shapes", {}).get(args.shape, {})
        source = {"date": before.get("date"), "commit": before.get("machine", {}).get("git_commit"),
                  "load_average_before": before.get("load_average_before")}
        reused = [{**r, "reused_from": r.get("reused_from", source)}
                  for r in before.get("rows", []) if r["system"] in args.reuse.split(",")
                  and r["seq_len"] in lengths]
    part = part_alst(lengths, args.systems.split(","), model=args.shape,
                     on_row=lambda rows: save({"rows": rows, "partial": True}), reused=reused)
    print(f"wrote {save(part)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="alst,ratio,fit")
    ap.add_argument("--lengths", default="2048,16384,32768")
    ap.add_argument("--systems", default="alst,ours-untiled,ours-maxlen,ours-maxlen-frugal")
    ap.add_argument("--reuse", default="",
                    help="with --shape: systems whose rows are taken from the file's last run "
                         "of that shape instead of run again (e.g. alst, whose code is not ours)")
    ap.add_argument("--ratio-length", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=str(common.RESULTS_DIR / "maxlen.json"))
    ap.add_argument("--shape", default="llama3-tiny", choices=sorted(MODELS),
                    help="the tiny model (benchmarks/trainer_runs.py MODELS); any other than "
                         "llama3-tiny runs the alst part only, into the file's `shapes` entry")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    old = common.load_results(args.output) or {}
    if args.shape != "llama3-tiny":
        return run_shape(args, old, argv if argv is not None else sys.argv[1:])
    started, load_before = time.perf_counter(), common.load_average()
    payload = {**old, "benchmark": "maxlen", "command": "python benchmarks/maxlen.py "
               + " ".join(argv if argv is not None else sys.argv[1:]),
               "model": "llama3-tiny (benchmarks/trainer_runs.py)", "world": 2}
    baseline = import_baseline(2)
    payload["rank_baseline_mb"] = baseline / MB

    def save():  # after each part: a stopped run keeps what it measured
        payload.update(machine=common.machine_info(), load_average_before=load_before,
                       load_average_after=common.load_average(), date=common.now_iso(),
                       total_s=time.perf_counter() - started, cpus=os.cpu_count())
        return common.write_results(args.output, payload)

    if "alst" in parts:
        payload["alst"] = part_alst([int(x) for x in args.lengths.split(",")],
                                    args.systems.split(","))
        save()
    if "ratio" in parts:
        payload["ratio"] = part_ratio(args.ratio_length, args.repeats, baseline)
        save()
    if "fit" in parts:
        ratio = payload.get("ratio") or {}
        if "peak_above_baseline_mb" not in ratio:
            ratio = part_ratio(args.ratio_length, 1, baseline)
        budget = int(ratio["peak_above_baseline_mb"]["ours-untiled"] * MB)
        payload["fit"] = part_fit(args.ratio_length, budget)
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
