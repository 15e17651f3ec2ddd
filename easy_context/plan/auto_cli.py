"""The output of ``easy-context plan --auto`` (easy_context.plan.auto does the search)."""

from __future__ import annotations

import json

from .auto import plan_for_length, plan_longest
from .estimate import GIB


def _describe(setup) -> str:
    tiling = (f"max-length mode: MLP tiles of {setup.mlp_tile} tokens, "
              f"{setup.heads_per_chunk} query head(s) per attention chunk"
              + (f", one layer input in {setup.keep_every} kept (nested recompute)"
                 if setup.keep_every > 1 else "") if setup.fused else "untiled layers")
    return (f"{setup.method}" + (f" (ring_degree {setup.ring_degree})" if setup.ring_degree else "")
            + f", {setup.engine}, offload={setup.offload}, checkpointing={setup.checkpointing}, "
            + tiling)


def run_auto(args, shape, budget: int) -> int:
    n = args.devices
    host = None if args.host_memory is None else int(args.host_memory * GIB)
    head = (f"{shape.name}: {shape.num_params() / 1e9:.2f}B parameters on {n} x "
            f"{args.gpu_memory:g} GiB (planning with {budget / GIB:.1f} GiB each)"
            + (f", {args.host_memory:g} GiB host memory per device" if host else
               ", host memory not limited (--host-memory)"))
    lines, result = [head], {"model": shape.name, "devices": n, "budget_gib": budget / GIB,
                            "host_gib": args.host_memory}
    plans = []
    if args.seq_len:
        plans.append(("for", plan_for_length(shape, args.seq_len, n, budget, host, args.dtype)))
    if args.max_seq_len or not args.seq_len:
        plans.append(("longest", plan_longest(shape, n, budget, host, args.dtype,
                                              args.granularity)))
    for kind, plan in plans:
        if plan.setup is None:
            lines.append(f"{'setup for ' + format(plan.seq_len, ',') + ' tokens' if kind == 'for' else 'longest'}: "
                         f"{plan.reason}")
            result[kind] = None
            if kind == "longest":
                lines.append("longest sequence that fits: 0 tokens (not even one step fits)")
            continue
        s, est = plan.setup, plan.estimate
        what = f"setup for {plan.seq_len:,} tokens" if kind == "for" else "longest-context setup"
        lines += [f"{what}: {_describe(s)} ({plan.reason})", est.table(),
                  f"  host memory per device   {est.host_bytes / GIB:10.2f} GiB",
                  "train with: easy-context train --model ... --dataset ... "
                  + s.train_flags(plan.seq_len, n, args.dtype)]
        if kind == "longest":
            lines.append(f"longest sequence that fits: {plan.seq_len:,} tokens with {s.method}")
        result[kind] = {"seq_len": plan.seq_len, "setup": s.__dict__,
                        "train_flags": s.train_flags(plan.seq_len, n, args.dtype),
                        "estimate": est.to_dict(), "reason": plan.reason}
    if any(k == "longest" for k, _ in plans):
        result["max_seq_len"] = (result.get("longest") or {}).get("seq_len", 0)
    print(json.dumps(result, indent=1) if args.json else "\n".join(lines))
    return 0
