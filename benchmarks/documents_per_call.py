"""What packed documents cost each attention call, before and after the runs are kept per
micro-batch (issue 23 item 5).

Each attention call with ``document_ids`` used to all-gather the ids over its group, copy
them to the host (``.tolist()``) and scan them for runs; every layer and every recompute of a
micro-batch did it again on the same ids. Now the first call of a micro-batch does it and
the others find the result on the ids tensor (easy_context.attention.documents.once_per_ids).

This measures, on 2 gloo ranks, the document part of one attention call: ``before`` builds
the runs afresh (all-gather, host copy, scan: what every call paid), ``after`` asks for them
as a later layer of the same micro-batch does (a cache hit). The two alternate, round-robin
(each repetition runs both; the first round is dropped); medians over the repetitions.

    python benchmarks/documents_per_call.py                 # 32K and 128K tokens, 64 documents
    python benchmarks/documents_per_call.py --quick         # 4K: a smoke run

Results: benchmarks/results/documents_per_call.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale
MEASURES = ["easy_context/attention/documents.py", "easy_context/parallel/blocks.py"]


def _per_call(length: int, documents: int, calls: int, rounds: int) -> dict:
    """On each rank: median seconds per call of each contender (rank 0's report)."""
    import torch
    import torch.distributed as dist

    from easy_context.attention.documents import ShardDocuments
    from easy_context.parallel.blocks import shard_documents
    from easy_context.parallel.comm import gather_shards

    world, rank = dist.get_world_size(), dist.get_rank()
    size = length // documents
    ids = torch.repeat_interleave(torch.arange(documents), size).unsqueeze(0)
    s = length // world
    doc = ids[:, rank * s:(rank + 1) * s].contiguous()

    def before():  # what every call did
        return ShardDocuments.from_ids(gather_shards(doc, None))

    def after():  # a later call of the same micro-batch
        return shard_documents(doc, None)

    shard_documents(doc, None)  # the micro-batch's first call builds them
    times = {"before": [], "after": []}
    for r in range(rounds + 1):
        for name, fn in (("before", before), ("after", after)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = (time.perf_counter() - t0) / calls
            if r:  # the first round warms up
                times[name].append(elapsed)
    return {name: common.median(ts) for name, ts in times.items()} | {"times": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--documents", type=int, default=64)
    p.add_argument("--calls", type=int, default=20, help="calls per timed repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", default="documents_per_call")
    args = p.parse_args(argv)
    lengths = [4096] if args.quick else [int(x) for x in args.lengths.split(",")]
    from easy_context.testing import DistPool

    pool = DistPool(2)
    rows = []
    try:
        for length in lengths:
            r = pool.run(_per_call, length, args.documents, args.calls, args.repeats)[0]
            rows.append({"tokens": length, "ranks": 2, "documents": args.documents,
                         "before_s": r["before"], "after_s": r["after"],
                         "speedup": r["before"] / r["after"] if r["after"] else None,
                         "before_times_s": r["times"]["before"], "after_times_s": r["times"]["after"]})
            print(f"{length:>7} tokens: before {r['before'] * 1e3:8.3f} ms/call, after "
                  f"{r['after'] * 1e6:8.2f} us/call ({rows[-1]['speedup']:.0f}x)")
    finally:
        pool.close()
    payload = {"benchmark": "documents_per_call", "machine": common.machine_info(),
               "measures": MEASURES, "rows": rows,
               "note": "per attention call, the document part only; with checkpointing each "
                       "layer calls attention twice per micro-batch (forward and recompute): "
                       "a 32-layer model 64 calls, of which one now builds the runs"}
    if not args.quick:
        print("wrote", common.write_results(args.output, payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
