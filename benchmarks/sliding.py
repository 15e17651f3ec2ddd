"""A sliding-window layer's step time against a global layer's: 16K tokens, a 1K window, 2 ranks.

Forward + backward of one attention layer (B=1, H=8, D=64, bf16, causal) for zigzag and
plain ring attention on 2 gloo ranks (one thread each), the sliding layer (transformers'
``sliding_window=1024``) run in alternation with the global one in the same ranks on the same
inputs, round-robin (benchmarks/attention.py's protocol and rows: ``<method>@window=1024``
has ``time_ratio_vs_global``). The single process (2 threads) runs beside them. Added here:
what each layer sends per rank (easy_context.parallel.window_cost.window_traffic, the figures the
ring engine's transfers follow, checked element for element in
tests/dist/test_attention_variants.py) and the target: the sliding layer under 0.35x the
global layer's time for zigzag.

    OMP_NUM_THREADS=1 python benchmarks/sliding.py            # writes benchmarks/results/sliding.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import attention, common  # noqa: E402
from easy_context.parallel.method import AttentionDims  # noqa: E402
from easy_context.parallel.window_cost import window_traffic  # noqa: E402

# What the figures measure: a results file older than the last change to these is stale.
MEASURES = ["easy_context/parallel", "easy_context/attention"]

LENGTH, WINDOW, WORLD = 16384, 1024, 2
METHODS = ("zigzag_ring_attn", "ring_attn")
TARGET = 0.35  # the sliding layer's time over the global layer's, zigzag


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="rounds kept (one more is dropped)")
    p.add_argument("--output", default=str(common.results_path("sliding")))
    args = p.parse_args(argv)
    common.setup_env()
    rc = attention.main(["--lengths", str(LENGTH), "--sliding-window", str(WINDOW),
                         "--methods", ",".join(METHODS), "--no-deepspeed", "--gqa-lengths", "",
                         "--repeats", str(args.repeats), "--world-size", str(WORLD),
                         "--output", args.output, "--fresh"])
    data = json.loads(Path(args.output).read_text())
    data["benchmark"] = "sliding"
    dims = AttentionDims(attention.HEADS, attention.HEADS, attention.HEAD_DIM)
    data["traffic"] = {
        m: {"window": window_traffic(m, dims, LENGTH, WORLD, WINDOW, a=2),
            "what": "busiest rank's bytes sent per layer (bf16), forward and backward; "
                    "global_*: the same layer without a window"}
        for m in METHODS}
    rows = {r["method"]: r for r in data["rows"]}
    # wall time is what the target is about; on a shared machine CPU time says more about the
    # work: every process's CPU time (gloo's threads included), and the kernel's thread time
    data["cpu_ratio_vs_global"] = {
        m: {"process_cpu": _ratio(rows, m, "process_cpu_ms_total"),
            "kernel_thread_cpu": _ratio(rows, m, "kernel_thread_cpu_ms_per_rank")}
        for m in ("single",) + METHODS}
    zig = rows.get(f"zigzag_ring_attn@window={WINDOW}", {})
    ratio = zig.get("time_ratio_vs_global")
    data["sliding_target"] = {
        "target": f"zigzag_ring_attn sliding (window {WINDOW}) / global time @ L={LENGTH}, "
                  f"{WORLD} ranks",
        "value": ratio, "limit": TARGET,
        "status": None if ratio is None else ("PASS" if ratio < TARGET else "MISS")}
    common.write_results(args.output, data)
    print(json.dumps(data["sliding_target"]), json.dumps(data["traffic"], indent=1))
    return rc


def _ratio(rows: dict, method: str, key: str) -> float | None:
    """The sliding row's figure over the global row's (per-rank lists: their sums)."""
    g, w = rows.get(method, {}).get(key), rows.get(f"{method}@window={WINDOW}", {}).get(key)
    if g is None or w is None:
        return None
    g, w = (sum(x) if isinstance(x, list) else x for x in (g, w))
    return round(w / g, 3) if g else None


if __name__ == "__main__":
    common.ensure_env()
    raise SystemExit(main())
