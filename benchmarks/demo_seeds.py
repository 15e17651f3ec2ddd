"""The full `easy-context demo` over several seeds: does its story hold for any seed (and so,
by the same token, on any CPU, whose kernels and rounding change a run as a seed does)?

Each seed runs the whole demo from scratch in its own fresh folder, one after the other (a
run takes both cores), as a user would: ``python -m easy_context.cli demo --seed S``. Per
seed it records the needle exact match at the first length and at 4x before and after the
extension, the answer digits right, the perplexity at 4x before and after, wall and CPU
seconds, the idle estimate (CPU seconds / processes per phase) and the load average; then the
median, worst and spread of each, and whether the targets are met:

- needle exact match at 4x after the extension: median >= 80%, worst >= 60%;
- before the extension: <= 20% for every seed (the model fails beyond its trained length);
- the idle estimate <= 10 minutes for every seed.

    python benchmarks/demo_seeds.py                       # seeds 0-4
    python benchmarks/demo_seeds.py --seeds 3 --keep      # one seed, keep its folder
    ATEN_CPU_CAPABILITY=default python benchmarks/demo_seeds.py --seeds 0
                          # another CPU's kernels: an extra row, outside the targets' figures

Writes benchmarks/results/demo_seeds.json (rows of earlier seeds that this call did not run
are kept, so seeds can be run in separate calls).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (REPO, load_average, load_results, machine_info, median,  # noqa: E402
                               merge_rows, now_iso, write_results)
from easy_context.demo.report import (TARGET_AFTER, TARGET_BEFORE, _needle_by_length,  # noqa: E402
                                      _ppl)

NAME = "demo_seeds"
# the modules whose change makes these results stale: the demo runs the package end to end
# (data, tokenizer, training, the evals, the report)
MEASURES = ["easy_context"]
TARGET_WORST = 0.6
BUDGET_S = 600.0


def kernels() -> str:
    """Which CPU kernels this run used: ATEN_CPU_CAPABILITY when set (another CPU's
    instruction set), else "native" (this CPU's best)."""
    return os.environ.get("ATEN_CPU_CAPABILITY") or "native"


def run_seed(seed: int, folder: Path, nproc: int) -> dict:
    """One full demo from scratch in ``folder``; its figures from the files it wrote."""
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "-m", "easy_context.cli", "demo", "--seed", str(seed),
           "--nproc-per-node", str(nproc), "--output", str(folder)]
    load_start, t0 = load_average(), time.perf_counter()
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"seed {seed}: the demo failed\n{run.stderr[-4000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    timings = json.loads((folder / "timings.json").read_text())
    first = summary["first_length"]
    ev = folder / "eval"
    (nb, tb), (na, ta) = (_needle_by_length(ev / f"needle_{x}.json") for x in ("before", "after"))
    pb, pa = _ppl(ev / "ppl_before.csv"), _ppl(ev / "ppl_after.csv")
    chance = json.loads((ev / "needle_after.json").read_text())["chance"]
    far = 4 * first
    return {
        "seed": seed, "kernels": kernels(), "first_length": first, "target_length": far, "chance": chance,
        "needle_first_before": nb[first], "needle_first_after": na[first],
        "needle_4x_before": nb[far], "needle_4x_after": na[far],
        "digits_first_before": tb[first], "digits_4x_before": tb[far], "digits_4x_after": ta[far],
        "needle_by_length_before": nb, "needle_by_length_after": na,
        "ppl_4x_before": pb[far]["ppl"], "ppl_4x_after": pa[far]["ppl"],
        "wall_s": wall, "cpu_s": sum(t["cpu_s"] for t in timings.values()),
        "idle_estimate_s": sum(t["cpu_s"] / t["processes"] for t in timings.values()),
        "load_average_start": load_start, "load_average_end": load_average(),
        "phases": timings, "finished": now_iso(),
        # each run its own record: the file merges runs of several calls (other kernels)
        "machine": machine_info()}


def aggregate(rows: list[dict]) -> dict:
    """Median, worst and spread of the figures over the seeds, and the targets."""
    def stats(key: str, worst=min) -> dict:
        xs = [r[key] for r in rows]
        return {"median": median(xs), "worst": worst(xs), "min": min(xs), "max": max(xs)}

    out = {k: stats(k) for k in ("needle_4x_after", "needle_first_before", "needle_first_after",
                                 "digits_4x_before", "digits_4x_after")}
    out["needle_4x_before"] = stats("needle_4x_before", worst=max)
    out["ppl_4x_before"] = stats("ppl_4x_before", worst=min)
    out["ppl_4x_after"] = stats("ppl_4x_after", worst=max)
    for key in ("idle_estimate_s", "cpu_s", "wall_s"):
        out[key] = stats(key, worst=max)
    after, before, idle = out["needle_4x_after"], out["needle_4x_before"], out["idle_estimate_s"]
    out["targets"] = {
        f"median needle at 4x after >= {TARGET_AFTER:.0%}": after["median"] >= TARGET_AFTER,
        f"worst needle at 4x after >= {TARGET_WORST:.0%}": after["worst"] >= TARGET_WORST,
        f"every needle at 4x before <= {TARGET_BEFORE:.0%}": before["worst"] <= TARGET_BEFORE,
        "every ppl at 4x: after < before": all(r["ppl_4x_after"] < r["ppl_4x_before"] for r in rows),
        f"every idle estimate <= {BUDGET_S / 60:.0f} min": idle["worst"] <= BUDGET_S}
    out["seeds"] = [r["seed"] for r in rows]
    return out


def print_table(rows: list[dict], agg: dict) -> None:
    print(f"{'seed':>4} {'4x before':>9} {'4x after':>8} {'first':>11} {'digits 4x':>11} "
          f"{'ppl 4x':>13} {'idle s':>6} {'CPU s':>6} {'wall s':>6} load")
    for r in rows:
        print(f"{r['seed']:>4}{'' if r.get('kernels', 'native') == 'native' else ' ' + r['kernels']} {r['needle_4x_before']:>9.0%} {r['needle_4x_after']:>8.0%} "
              f"{r['needle_first_before']:>4.0%}->{r['needle_first_after']:<4.0%}  "
              f"{r['digits_4x_before']:>4.0%}->{r['digits_4x_after']:<4.0%} "
              f"{r['ppl_4x_before']:>6.3f}>{r['ppl_4x_after']:<6.3f} {r['idle_estimate_s']:>6.0f} "
              f"{r['cpu_s']:>6.0f} {r['wall_s']:>6.0f} {r['load_average_start'][0]:.1f}")
    a = agg["needle_4x_after"]
    print(f"needle at 4x after: median {a['median']:.0%}, worst {a['worst']:.0%}, spread "
          f"{a['min']:.0%}-{a['max']:.0%}; before: worst {agg['needle_4x_before']['worst']:.0%}; "
          f"idle estimate median {agg['idle_estimate_s']['median']:.0f} s, worst "
          f"{agg['idle_estimate_s']['worst']:.0f} s")
    for name, ok in agg["targets"].items():
        print(f"  {'met' if ok else 'NOT MET'}: {name}")


def _key(row: dict) -> tuple:
    return row.get("kernels", "native") != "native", row.get("kernels", "native"), row["seed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--workdir", default=None,
                    help="where the runs' folders go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep each run's folder")
    ap.add_argument("--results", default=NAME)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="demo_seeds_"))
    work.mkdir(parents=True, exist_ok=True)
    old = (load_results(args.results) or {}).get("runs", [])
    new = []
    for seed in args.seeds:
        folder = work / f"seed_{seed}"
        print(f"seed {seed}: {folder}", flush=True)
        new.append(run_seed(seed, folder, args.nproc_per_node))
        print(f"  4x: {new[-1]['needle_4x_before']:.0%} -> {new[-1]['needle_4x_after']:.0%}, "
              f"idle estimate {new[-1]['idle_estimate_s']:.0f} s", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        rows = sorted(merge_rows(old, new, key=_key), key=_key)
        # The targets are over this CPU's own kernels; runs with other kernels are extra rows.
        agg = aggregate([r for r in rows if r.get("kernels", "native") == "native"])
        # Written after every seed: an interrupted benchmark keeps what it measured.
        write_results(args.results, {
            "benchmark": NAME, "command": "python " + " ".join(sys.argv),
            "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")},
            "machine": machine_info(), "aggregate": agg, "runs": rows,
            "notes": "idle_estimate_s: CPU seconds per phase divided by the processes doing it "
                     "(the wall time of an idle machine with that many cores); wall_s is "
                     "inflated when the load average is above the CPU count."})
    print_table(rows, agg)


if __name__ == "__main__":
    main()
