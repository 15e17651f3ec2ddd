"""Check the planner's LoRA option against one real LoRA training step per rank (CPU, fp32).

The harness of benchmarks/plan_validation.py (its tiny Llama: 4 layers, hidden 256, vocab
32000; fresh gloo ranks with MALLOC_MMAP_THRESHOLD_=65536; each rank's resident-set peak
from "ready" to the end; its calibrated CPU runtime constant), with peft's LoRA adapters on
every linear layer of the decoder layers (rank 16, the base frozen, AdamW over the adapters
only, its states created by a first step) and the same full fine-tuning points beside it
for the difference. The prediction is estimate_memory(..., engine="replicated",
lora=LoRASpec(16)).total, as this harness keeps a whole model per rank.

    python benchmarks/lora_memory.py             # -> results/lora_memory.json
    python benchmarks/lora_memory.py --quick     # one small point, a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, plan_validation as pv  # noqa: E402

# the modules whose change makes these results stale: the planner's predictions and the
# measured step (plan_validation.py's harness with train/lora.py's adapters)
MEASURES = ["easy_context/plan", "easy_context/train/lora.py", "easy_context/train/config.py",
            "easy_context/integrations", "easy_context/parallel", "easy_context/attention",
            "easy_context/memory", "easy_context/sequence_parallel.py", "easy_context/layouts.py"]
RANK = 16
POINTS = [
    pv.Point("ring_attn", 1, 8192, "none"),
    pv.Point("ring_attn", 1, 8192, "full"),
    pv.Point("zigzag_ring_attn", 2, 8192, "none"),
    pv.Point("zigzag_ring_attn", 2, 16384, "full"),
]
QUICK = [pv.Point("zigzag_ring_attn", 2, 2048, "full")]


def lora_rank_step(m: pv.TinyLlama, p: pv.Point) -> dict:
    """One steady-state LoRA step on this rank (plan_validation.rank_step with adapters)."""
    import peft  # noqa: F401 - before "ready": importing it (and bitsandbytes, which it
    import torch  # imports when installed) adds ~50 MB of libraries, not the step's memory
    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401 - imported before "ready" (m.build uses it)

    import easy_context as ec
    from easy_context.train.config import TrainConfig
    from easy_context.train.lora import inject_lora, peft_config
    from easy_context.memory.peak import PeakMemory, rss_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    ready = rss_bytes()
    t0 = time.perf_counter()
    with PeakMemory("cpu") as pm:
        model = m.build(p.seq_len)
        inject_lora(model, peft_config(TrainConfig(model="tiny", dataset="-", lora_rank=RANK)))
        ec.apply_sequence_parallel(model, p.method)
        if p.checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainable = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4)
        for q in trainable:  # create the AdamW states: the step below is steady-state
            q.grad = torch.zeros_like(q)
        opt.step()
        opt.zero_grad(set_to_none=True)

        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, m.vocab, (1, p.seq_len + 1), generator=gen)
        local = ec.prepare_seq_parallel_inputs(p.method, ids[:, :-1], None, ids[:, 1:], rank,
                                               world, "cpu")
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=True, chunk_size=p.chunk_size)
        loss.backward()
        if world > 1:
            for q in trainable:
                dist.all_reduce(q.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"rank": rank, "ready_rss_bytes": ready, "peak_bytes": pm.peak_bytes,
            "loss": loss.detach().item(), "seconds": time.perf_counter() - t0}


def measure(m: pv.TinyLlama, p: pv.Point, fn, timeout_s: float = 900.0) -> list[dict]:
    import os

    from easy_context.testing import DistPool

    saved = {k: os.environ.get(k) for k in common.BENCH_ENV}
    common.setup_env()
    try:
        with DistPool(p.world_size, threads_per_rank=1, timeout_s=timeout_s) as pool:
            return pool.run(fn, m, p)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def predict(m: pv.TinyLlama, p: pv.Point, runtime_bytes: int, lora: bool):
    from easy_context.plan import estimate_memory
    from easy_context.plan.lora import LoRASpec

    return estimate_memory(pv.model_shape(m), p.seq_len, p.world_size, p.method,
                           engine="replicated", offload="none", checkpointing=p.checkpointing,
                           dtype="fp32", loss_chunk=p.chunk_size, runtime_bytes=runtime_bytes,
                           lora=LoRASpec(RANK) if lora else None, device="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small point only")
    ap.add_argument("--recompute", action="store_true",
                    help="measure nothing: re-predict the stored rows with the current planner")
    ap.add_argument("--output", default=None,
                    help="JSON file (default: results/lora_memory.json; --quick writes none)")
    args = ap.parse_args()
    output = args.output or (None if args.quick else str(common.RESULTS_DIR / "lora_memory.json"))
    stored = {r["key"]: r for r in (common.load_results(output) or {}).get("rows", [])} if output else {}

    calib = (common.load_results(common.RESULTS_DIR / "plan_validation.json") or {}).get("calibration")
    if not calib:
        from easy_context.plan.estimate import CPU_RUNTIME_BYTES

        calib = {"runtime_bytes": CPU_RUNTIME_BYTES}
    runtime = calib["runtime_bytes"]
    m, rows = pv.TinyLlama(), []
    points = [p for p in POINTS if p.key in stored] if args.recompute else QUICK if args.quick else POINTS
    for p in points:
        row = {**asdict(p), "key": p.key, "lora_rank": RANK}
        for kind, fn in (("lora", lora_rank_step), ("full", pv.rank_step)):
            if args.recompute:
                old = stored[p.key][kind]
                ranks = [{"peak_bytes": round(mb * 2**20), "seconds": old["seconds"]}
                         for mb in old["per_rank_peak_mb"]]
            else:
                ranks = measure(m, p, fn)
            measured = max(r["peak_bytes"] for r in ranks)
            est = predict(m, p, runtime, lora=kind == "lora")
            row[kind] = {"measured_mb": measured / 2**20, "predicted_mb": est.total / 2**20,
                         "error": est.total / measured - 1.0,
                         "per_rank_peak_mb": [r["peak_bytes"] / 2**20 for r in ranks],
                         "seconds": max(r["seconds"] for r in ranks),
                         "components_mb": {k: v / 2**20 for k, v in est.components().items()}}
        row["within_tolerance"] = all(abs(row[k]["error"]) <= pv.TOLERANCE for k in ("lora", "full"))
        rows.append(row)
        print(f"{p.key:40s} LoRA measured {row['lora']['measured_mb']:7.1f} MB predicted "
              f"{row['lora']['predicted_mb']:7.1f} MB ({100 * row['lora']['error']:+5.1f}%) | full "
              f"measured {row['full']['measured_mb']:7.1f} MB predicted {row['full']['predicted_mb']:7.1f}"
              f" MB ({100 * row['full']['error']:+5.1f}%)", flush=True)
    if output is None:
        return
    payload = {"what": "per-rank peak RSS of one steady-state fp32 step, LoRA (rank 16, every "
                       "linear layer) and full fine-tuning, vs the planner",
               "model": asdict(m), "tolerance": pv.TOLERANCE, "calibration": calib,
               "machine": common.machine_info(), "date": common.now_iso(), "rows": rows,
               "max_abs_error": max(abs(r[k]["error"]) for r in rows for k in ("lora", "full"))}
    print(f"wrote {common.write_results(output, payload)}")


if __name__ == "__main__":
    main()
