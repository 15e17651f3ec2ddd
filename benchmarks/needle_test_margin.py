"""The trained needle test's margin: its figures over seeds, thread counts and instruction sets.

tests/unit/test_eval_needle.py::test_trained_tiny_model_beats_chance trains a tiny model and
asserts a floor on its needle scores. Training depends on the CPU (kernels, reduction order),
so the floor must hold with room on any x86-64 machine, not just on the one it was tuned on.
This script trains the test's model (tests/unit/eval_fixtures.train_needle_model) once per
setting, each in a fresh process (ATEN_CPU_CAPABILITY and the thread count are read at start),
and records every run; the test's threshold is set below the worst with room.

    python benchmarks/needle_test_margin.py                 # seeds 0-4 x 1, 2 threads -> results
    python benchmarks/needle_test_margin.py --capabilities default avx2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

# the code whose change makes these results stale: the test's training fixture and what
# it calls (the synthetic haystack, the tokenizer, the needle eval and its sharding)
MEASURES = ["tests/unit/eval_fixtures.py", "easy_context/data/synthetic.py",
            "easy_context/data/tokenizer.py", "easy_context/eval/needle.py",
            "easy_context/eval/sharding.py", "easy_context/sequence_parallel.py",
            "easy_context/layouts.py", "easy_context/models.py"]


def run_one(seed: int, threads: int, capability: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(common.REPO)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, "-m", "tests.unit.eval_fixtures", "--seeds", str(seed)],
                          cwd=common.REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return {"seed": seed, "threads": threads, "ATEN_CPU_CAPABILITY": capability,
                "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--capabilities", nargs="+", default=[""],
                    help="ATEN_CPU_CAPABILITY values ('' = the machine's best)")
    ap.add_argument("--output", default=str(common.RESULTS_DIR / "needle_test_margin.json"))
    args = ap.parse_args()
    old = common.load_results(args.output) or {}
    rows = []
    for cap in args.capabilities:
        for threads in args.threads:
            for seed in args.seeds:
                row = run_one(seed, threads, cap or None)
                print(json.dumps(row), flush=True)
                rows.append(row)
                key = lambda r: (r["seed"], r["threads"], r.get("ATEN_CPU_CAPABILITY"))  # noqa: E731
                merged = common.merge_rows(old.get("rows", []), rows, key=key)
                ok = [r for r in merged if "error" not in r]
                common.write_results(args.output, {
                    "what": "trained needle test (tests/unit/test_eval_needle.py): answer-digit "
                            "accuracy and exact match of the tiny model, per seed / threads / "
                            "ATEN_CPU_CAPABILITY, each trained in a fresh process",
                    "machine": common.machine_info(), "date": common.now_iso(), "rows": merged,
                    "worst_token_accuracy": min((r["token_accuracy"] for r in ok), default=None),
                    "worst_exact": min((r["exact"] for r in ok), default=None)})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
