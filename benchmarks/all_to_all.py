"""Ulysses' all-to-alls alone: ours against DeepSpeed's, on N gloo ranks, round-robin.

What one Ulysses forward + backward moves, without the attention in between: q, k and v
from sequence shards to head shards and the output back (forward), the output's gradient to
heads and dq, dk, dv back (backward); B=1, H=8 query and KV heads, D=64, bf16, one thread
per rank. Contenders, each run once per round in the same ranks on the same tensors (the
first round dropped, medians and min/max over the rest):

- ``ours``: easy_context.parallel.ulysses (point-to-point sends of each peer's chunk, the own
  chunk copied while they travel, receives in place);
- ``deepspeed``: DeepSpeed's ``single_all_to_all`` (what ``DistributedAttention`` calls: a
  permute-and-copy of the whole tensor, ``all_to_all_single``, a copy back);
- ``fused``: one ``all_to_all_single`` per tensor on a heads-major packed copy, no unpack
  (a floor for the collective itself on this backend, not a usable exchange).

    python benchmarks/all_to_all.py                      # 16K and 32K -> results/all_to_all.json
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/all_to_all.py --output all_to_all_avx2

Also recorded: each contender's time inside the transfers' waits (``wait_ms``), so the rest
is copies and Python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

MEASURES = ["easy_context/parallel/ulysses.py", "easy_context/parallel/comm.py"]
HEADS, HEAD_DIM = 8, 64
CONTENDERS = ("ours", "deepspeed", "fused")


def _deepspeed():
    import deepspeed

    if not deepspeed.comm.is_initialized():
        import deepspeed.comm.torch  # noqa: F401 (skip its shared-memory op build: unused here)

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from deepspeed.sequence.layer import single_all_to_all

    return single_all_to_all


def _rounds(length: int, rounds: int, contenders: list[str]) -> dict:
    from easy_context.parallel import ulysses

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, length // world, HEADS, HEAD_DIM, generator=g,
                           dtype=torch.bfloat16) for _ in range(3))
    waits = [0.0]
    real_wait = ulysses.Exchange.wait

    def timed_wait(self):
        t0 = time.perf_counter()
        real_wait(self)
        waits[0] += time.perf_counter() - t0

    def ours():
        qh, kh, vh = ulysses._seq_to_heads([q, k, v], [1, 1, 1], group, world)
        out = ulysses._heads_to_seq([qh], [1], group, world)[0]
        ulysses._seq_to_heads([out], [1], group, world)
        ulysses._heads_to_seq([qh, kh, vh], [1, 1, 1], group, world)

    fns = {"ours": ours}
    if "deepspeed" in contenders:
        a2a = _deepspeed()

        def deepspeed():
            heads = [a2a(x, 2, 1, 0, group) for x in (q, k, v)]
            out = a2a(heads[0], 1, 2, 0, group)
            a2a(out, 2, 1, 0, group)
            for x in heads:
                a2a(x, 1, 2, 0, group)
        fns["deepspeed"] = deepspeed

    def fused():
        for x in (q, k, v, q, q, k, v, q):  # as many tensors as the two above move
            packed = x.unflatten(2, (world, -1)).movedim(2, 0).contiguous()
            dist.all_to_all_single(torch.empty_like(packed), packed, group=group)
    fns["fused"] = fused

    times = {c: [] for c in contenders}
    wait_ms = {c: [] for c in contenders}
    ulysses.Exchange.wait = timed_wait
    try:
        for _ in range(rounds):
            for c in contenders:
                dist.barrier()
                waits[0] = 0.0
                t0 = time.perf_counter()
                fns[c]()
                dist.barrier()
                times[c].append((time.perf_counter() - t0) * 1000)
                wait_ms[c].append(waits[0] * 1000)
    finally:
        ulysses.Exchange.wait = real_wait
    return {"times_ms": times, "wait_ms": wait_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--rounds", type=int, default=12, help="rounds, the first dropped")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--output", default="all_to_all")
    args = p.parse_args(argv)
    common.setup_env()
    from easy_context.testing import DistPool

    contenders = [c for c in CONTENDERS if c != "deepspeed" or
                  common._package_version("deepspeed") is not None]
    rows = []
    pool = DistPool(args.world_size, threads_per_rank=1, timeout_s=1800)
    try:
        for length in (int(x) for x in args.lengths.split(",")):
            reports = pool.run(_rounds, length, args.rounds, contenders)
            for c in contenders:
                # per round the slowest rank; the first round dropped
                per_round = [max(r["times_ms"][c][i] for r in reports)
                             for i in range(1, args.rounds)]
                waits = [max(r["wait_ms"][c][i] for r in reports) for i in range(1, args.rounds)]
                rows.append({"contender": c, "L": length, "time_ms": round(statistics.median(per_round), 1),
                             "time_ms_spread": common.spread(per_round),
                             "wait_ms": round(statistics.median(waits), 1) if c == "ours" else None,
                             "rounds": args.rounds - 1})
                print(f"L={length:6d} {c:10s} {rows[-1]['time_ms']:8.1f} ms "
                      f"({rows[-1]['time_ms_spread']['min']:.1f}-{rows[-1]['time_ms_spread']['max']:.1f})",
                      flush=True)
    finally:
        pool.close()
    ours = {r["L"]: r["time_ms"] for r in rows if r["contender"] == "ours"}
    for r in rows:
        r["ratio_to_ours"] = round(r["time_ms"] / ours[r["L"]], 3)
    payload = {"benchmark": "all_to_all", "argv": sys.argv[1:] if argv is None else argv,
               "machine": common.machine_info(),
               "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
               "protocol": "round-robin: each round runs every contender once in the same ranks "
                           "on the same tensors; the first round dropped; per round the slowest "
                           "rank; medians and min/max over the rest",
               "rows": rows}
    path = common.write_results(common.results_path(args.output), payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
