"""KV-head groups: one KV head per pass against all heads at once, and the groups the buffer
budget picks for real models on a GPU.

Measured (CPU, N=2 gloo ranks, one thread each): forward + backward of causal attention
(B=1, H=8 query heads on 8 KV heads, D=64) with a ring method, its per-group passes forced to
1 KV head (budget 0) and to all 8 (budget unlimited): slowest rank's time, largest rank's peak
memory above the inputs, passes per layer. Planned (no GPU here): for Llama shapes at the
tokens per rank of long-context runs, how many KV heads per pass the default GPU budget
(easy_context.parallel.head_groups.BUDGETS) gives each block method, and its buffers: a GPU
then launches (KV heads / group) x N kernels per layer instead of KV heads x N.

    python benchmarks/head_groups.py                  # L = 8192, fp32, zigzag and ring
Results: benchmarks/results/head_groups.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale (plan/shapes.py: the planned rows'
# model shapes; memory/peak.py: the memory figures)
MEASURES = ["easy_context/parallel", "easy_context/attention", "easy_context/sequence_parallel.py",
            "easy_context/layouts.py", "easy_context/plan/shapes.py",
            "easy_context/memory/peak.py"]
HEADS, KV_HEADS, HEAD_DIM = 8, 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MB = 2**20
PLANNED = [("Llama-3-8B", 65536), ("Llama-2-7B", 65536), ("Llama-3-70B", 32768),
           ("Llama-2-7B", 8192)]


def measure(spec: dict) -> dict:
    """On every rank: one forward + backward under the given buffer budget."""
    import torch.distributed as dist

    import easy_context as ec
    from easy_context.parallel.head_groups import attention_buffer_budget
    from easy_context.memory.peak import PeakMemory

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, spec["L"], h, HEAD_DIM, generator=g).to(DTYPES[spec["dtype"]])
            for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    q, k, v, dout = (ec.shard_sequence(t, spec["method"], rank, world).contiguous() for t in full)
    del full
    for t in (q, k, v):
        t.requires_grad_(True)
    dist.barrier()
    with attention_buffer_budget(spec["budget"]), PeakMemory("cpu") as pm:
        t0 = time.perf_counter()
        ec.sequence_parallel_attention(q, k, v, spec["method"], causal=True).backward(dout)
        t1 = time.perf_counter()
    dist.barrier()
    return {"time_s": t1 - t0, "peak_bytes": pm.peak_bytes}


def planned_rows() -> list[dict]:
    from easy_context.parallel import METHODS
    from easy_context.parallel.head_groups import BUDGETS
    from easy_context.plan.shapes import load_shape

    rows = []
    for model, s in PLANNED:
        dims = load_shape(model).attention_dims()
        for name in ("zigzag_ring_attn", "dist_flash_attn", "allgather_attn"):
            m = METHODS[name]
            g = m.kv_heads_per_group(dims, s, 2, 8, None, BUDGETS["cuda"])
            rows.append({"model": model, "tokens_per_rank": s, "world_size": 8, "method": name,
                         "kv_heads": dims.kv_heads, "kv_heads_per_pass": g,
                         "passes_per_layer": -(-dims.kv_heads // g),
                         "buffers_gib": round(m.buffers(dims, s, 2, 8, None, BUDGETS["cuda"])
                                              / 2**30, 2),
                         "one_head_per_pass_buffers_gib": round(
                             m.group_buffers(dims, s, 2, 8, None, 1) / 2**30, 3)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--methods", default="zigzag_ring_attn,ring_attn")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default=str(common.results_path("head_groups")))
    args = p.parse_args(argv)
    common.setup_env()
    from easy_context.testing import DistPool

    rows, t_start = [], time.time()
    pool = DistPool(2, threads_per_rank=1, timeout_s=3600)
    try:
        for method in [m for m in args.methods.split(",") if m]:
            iters = {0: [], 1 << 50: []}
            # round-robin: each round runs both once; the first round (warm-up) is dropped
            for rnd in range(args.repeats + 1):
                for budget in iters:
                    got = pool.run(measure, {"method": method, "L": args.length,
                                             "dtype": args.dtype, "budget": budget})
                    if rnd:
                        iters[budget].append((max(g["time_s"] for g in got),
                                              max(g["peak_bytes"] for g in got) / MB))
            for budget, its in iters.items():
                rows.append({"method": method, "L": args.length, "dtype": args.dtype,
                             "world_size": 2, "heads": HEADS, "kv_heads": KV_HEADS,
                             "kv_heads_per_pass": 1 if budget == 0 else KV_HEADS,
                             "passes_per_layer": KV_HEADS if budget == 0 else 1,
                             "time_s": round(common.median(t for t, _ in its), 3),
                             "time_s_iters": [round(t, 3) for t, _ in its],
                             "peak_mb": round(common.median(m for _, m in its), 1)})
            print(f"[{time.time() - t_start:5.0f}s] {method} done", file=sys.stderr, flush=True)
    finally:
        pool.close()
    planned = planned_rows()
    payload = {"benchmark": "head_groups", "description": __doc__.split("\n\n")[1],
               "machine": common.machine_info(), "argv": sys.argv[1:] if argv is None else argv,
               "elapsed_s": round(time.time() - t_start, 1), "measured": rows,
               "planned_gpu": planned}
    path = common.write_results(args.output, payload)
    print(common.fmt_table(["method", "L", "KV heads/pass", "passes", "time s", "peak MB"],
                           [[r["method"], r["L"], r["kv_heads_per_pass"], r["passes_per_layer"],
                             r["time_s"], r["peak_mb"]] for r in rows]))
    print(common.fmt_table(["model", "tokens/rank", "method", "KV heads/pass", "passes",
                            "buffers GiB"],
                           [[r["model"], r["tokens_per_rank"], r["method"],
                             r["kv_heads_per_pass"], r["passes_per_layer"], r["buffers_gib"]]
                            for r in planned]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    common.ensure_env()
    sys.exit(main())
