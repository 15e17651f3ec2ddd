"""One command that checks EasyContext on one GPU and writes what it found.

    python benchmarks/gpu_check.py                 # one H100/H200: under 8 minutes
    python benchmarks/gpu_check.py --cpu --tiny    # the same code on the CPU, small shapes (CI)
    python benchmarks/gpu_check.py --sections attention,record --record-until-s 560
                                                   # the record step with a call to itself

Sections (each item records its error instead of stopping the run):
1. kernels (gpu_check_kernels.py): torch's flash and efficient ops and every installed
   flash-attn adapter against the fp32 reference, forward and backward, bf16/fp16/fp32
   (where the kernel allows), GQA, non-contiguous views, lengths not a multiple of 8, head
   dims 64/128/256, packed documents; each error next to the plain computation's.
2. methods: every method end to end at N=1 on the device; at N=2 on the one device when a
   backend allows it: gloo with device tensors is tried (two processes on one GPU), and NCCL
   with two ranks on one GPU is probed and its answer recorded.
3. attention (gpu_check_train.py): TFLOP/s at 32K, easy_context's kernel against torch's
   scaled_dot_product_attention (its default and each backend forced), and aten's cuDNN op
   with its log-sum-exp probed against the flash op (a candidate kernel).
   train (gpu_check_train.py): one step of a Llama-3-8B-shaped model (2 layers, bf16) at
   128K, 256K and 512K tokens: peak memory against the planner, tokens/s, MFU; at 128K and
   256K a second step under torch.profiler, its top kernels by GPU time.
4. engine (gpu_check_engine.py): one step of the trainer's model and engine at one rank,
   started as ``easy-context train`` starts it (NCCL + gloo group) under the strict
   collective check, for each engine, offload setting, checkpointing kind, LoRA, QLoRA and
   max-length mode (with and without offloaded inputs): a tiny model, and with the full run
   a 2-layer model of Llama-3-8B's widths at 16K tokens.
5. generate (gpu_check_generate.py): easy_context.generate's tokens against transformers'
   greedy generate for every method (tiny llama, gemma2, gpt_oss, fp32), and a 2-layer
   Llama-3-8B-shaped model with a 32K prompt: prefill and decode time, cache and peak memory.
6. record (gpu_check_record.py): a full-depth Llama-3-8B-shaped model (32 layers, random
   weights built on the device) fine-tuned with LoRA in max-length mode at the longest length
   the planner gives for this device and this machine's host memory (or, when that step
   would not end before --record-until-s, the longest that would): its time and its peak
   against the plan.
Writes benchmarks/results/gpu_check.json (with --cpu: gpu_check_cpu.json). Imports nothing
that the lent GPU machine lacks (no datasets, deepspeed or flash-attn needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale: its sections together (kernels, every
# method, the training step and the planner, the trainer's engines, generate)
MEASURES = ["easy_context/attention", "easy_context/parallel", "easy_context/memory",
            "easy_context/plan", "easy_context/train", "easy_context/generation",
            "easy_context/integrations", "easy_context/utils", "easy_context/launch.py",
            "easy_context/mesh.py", "easy_context/layouts.py", "easy_context/models.py",
            "easy_context/sequence_parallel.py"]
TRAIN_LENGTHS = (131072, 262144, 524288)
TINY_TRAIN_LENGTHS = (128, 256, 512)


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def method_case(method: str, device: str, tiny: bool, packed: bool, ring_degree=None) -> dict:
    """One method on this rank's shard (bf16 on a GPU, fp32 on the CPU), against float64
    attention (per document when packed) on the whole sequence. Runs on every rank."""
    import easy_context as ec
    from easy_context.attention import reference_attention

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    b, hq, hkv, d = 1, 8, 2, (64 if tiny else 128)
    length = 2 * world * (25 if tiny else 1027)  # shards not a multiple of 8 long
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, length, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    cuts = [0, length // 3 + 1, length // 2 + 3, length] if packed else [0, length]
    doc = torch.zeros(b, length, dtype=torch.long)
    for c in cuts[1:-1]:
        doc[:, c:] += 1
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.cat([reference_attention(*(t[:, a:z] for t in refs), causal=True)
                     for a, z in zip(cuts, cuts[1:])], 1)
    ref.backward(do.double())
    want = {"out": ref.detach(), "dq": refs[0].grad, "dk": refs[1].grad, "dv": refs[2].grad}
    shard = lambda t: ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)  # noqa: E731
    ins = [shard(t).to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    out = ec.get_method(method).attention(
        *ins, causal=True, ring_degree=ring_degree,
        document_ids=shard(doc).to(device) if packed else None)
    out.backward(shard(do).to(device=device, dtype=dtype))
    got = {"out": out, "dq": ins[0].grad, "dk": ins[1].grad, "dv": ins[2].grad}
    return {n: _rel(got[n].cpu(), shard(want[n])) for n in want}


def _methods():
    import easy_context as ec

    return [(m, 1 if m == "usp_attn" else None) for m in sorted(ec.METHODS)]


def methods_one_rank(device: str, tiny: bool) -> list[dict]:
    rows = []
    for method, rd in _methods():
        for packed in (False, True):
            row = {"method": method, "world_size": 1, "packed": packed}
            try:
                row["error"] = method_case(method, device, tiny, packed, rd)
            except Exception as e:  # noqa: BLE001 - recorded, the check goes on
                row["failed"] = f"{type(e).__name__}: {e}"[:500]
                row["traceback"] = traceback.format_exc(limit=5)[-1500:]
            rows.append(row)
    return rows


def _two_rank_cases(device: str, tiny: bool, only: str | None = None) -> dict:
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    out = {}
    for method, _ in _methods():
        if only is not None and method != only:
            continue
        rd = 2 if method == "usp_attn" else None
        for packed in (True,) if tiny else (False, True):
            out[f"{method} packed={packed}"] = method_case(method, device, tiny, packed, rd)
    return out


def methods_two_ranks(device: str, tiny: bool) -> dict:
    """Both ranks on this one device over gloo (CPU only: see below)."""
    from easy_context.testing import DistError, DistPool

    if device.startswith("cuda"):
        # Tried on an H200 (torch 2.11): the first ring exchange failed ("Connection closed by
        # peer"): gloo has no point-to-point for CUDA tensors, and NCCL refuses two ranks on one
        # GPU (nccl_probe). Two ranks need two GPUs there.
        return {"backend": "gloo", "ran": False,
                "skipped": "gloo has no send/recv for CUDA tensors; two ranks need two GPUs"}

    pool = DistPool(2, threads_per_rank=1, timeout_s=300)
    try:
        # one method first, briefly: device tensors over gloo may fail (or hang) at once
        pool.run(_two_rank_cases, device, tiny, "zigzag_ring_attn", timeout_s=120)
        reports = pool.run(_two_rank_cases, device, tiny, timeout_s=300)
        worst = {case: max(r[case][n] for r in reports for n in r[case]) for case in reports[0]}
        return {"backend": "gloo", "ran": True, "worst_error_per_case": worst}
    except DistError as e:
        return {"backend": "gloo", "ran": False, "error": str(e)[-2000:]}
    finally:
        pool.close()


def _nccl_rank(rank: int, port: int, results) -> None:
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        t = torch.ones(4, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        results.put((rank, "ok", t[0].item()))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the answer is what we record
        results.put((rank, "error", f"{type(e).__name__}: {e}"[:800]))


def nccl_probe(timeout_s: float = 90) -> dict:
    """Two NCCL ranks on one GPU: what NCCL answers (expected: it refuses duplicate GPUs)."""
    import torch.multiprocessing as mp

    from easy_context.testing import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got, deadline = [], time.time() + timeout_s
    while len(got) < 2 and time.time() < deadline:
        try:
            got.append(results.get(timeout=max(0.1, deadline - time.time())))
        except Exception:  # noqa: BLE001 - queue.Empty at the deadline
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return {"answers": sorted(got), "timed_out": len(got) < 2}


def machine(device: torch.device) -> dict:
    info = common.machine_info()
    for pkg in ("transformers", "flash-attn", "flash-attn-4", "triton"):
        info[pkg] = common._package_version(pkg)
    if device.type == "cuda":
        info.update({"gpu": torch.cuda.get_device_name(device),
                     "capability": list(torch.cuda.get_device_capability(device)),
                     "cuda_runtime": torch.version.cuda,
                     "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory})
    return info


def _init_one_rank() -> None:
    if not dist.is_initialized():
        from easy_context.testing import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (CI: with --tiny)")
    p.add_argument("--tiny", action="store_true", help="small shapes: the same code in seconds")
    p.add_argument("--sections", default="kernels,methods,attention,train,engine,generate,record",
                   help="comma-separated: kernels, methods, attention, train, engine, generate, "
                        "record")
    p.add_argument("--budget-s", type=float, default=450,
                   help="stop starting training lengths after this many seconds")
    p.add_argument("--record-until-s", type=float, default=470,
                   help="the record step (last) is sized to end before this many seconds")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda:0")
    output = args.output or common.results_path(
        "gpu_check" if device.type == "cuda" else "gpu_check_cpu")
    sections = [s for s in args.sections.split(",") if s]
    t_start, report = time.time(), {"benchmark": "gpu_check", "device": str(device),
                                    "tiny": args.tiny, "argv": sys.argv[1:] if argv is None else argv,
                                    "machine": machine(device), "sections": {}, "seconds": {}}
    log = lambda msg: print(f"[{time.time() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    def save():
        report["elapsed_s"] = round(time.time() - t_start, 1)
        common.write_results(output, report)

    os.environ.update(common.BENCH_ENV)  # spawned ranks return freed memory to the OS
    _init_one_rank()
    if "kernels" in sections:
        from benchmarks import gpu_check_kernels

        t0 = time.time()
        report["sections"]["kernels"] = gpu_check_kernels.run(device, args.tiny, log)
        report["seconds"]["kernels"] = round(time.time() - t0, 1)
        save()
    if "methods" in sections:
        t0 = time.time()
        sec = {"one_rank": methods_one_rank(str(device), args.tiny)}
        log("methods: one rank done")
        sec["two_ranks_one_device"] = methods_two_ranks(str(device), args.tiny)
        if device.type == "cuda":
            sec["nccl_two_ranks_one_gpu"] = nccl_probe()
        report["sections"]["methods"] = sec
        report["seconds"]["methods"] = round(time.time() - t0, 1)
        log("methods: two ranks done")
        save()
    if "attention" in sections:
        from benchmarks import gpu_check_train

        t0 = time.time()
        report["sections"]["attention"] = gpu_check_train.attention_tflops(device, args.tiny)
        report["seconds"]["attention"] = round(time.time() - t0, 1)
        log("attention: TFLOP/s done")
        save()
    if "train" in sections:
        from benchmarks import gpu_check_train

        t0 = time.time()
        sec = {"steps": []}
        for length in TINY_TRAIN_LENGTHS if args.tiny else TRAIN_LENGTHS:
            if time.time() - t_start > args.budget_s:
                sec["steps"].append({"L": length, "skipped": f"time budget {args.budget_s} s"})
                continue
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            try:
                # the two shorter steps profiled (top kernels): where their time goes
                profile = length in (TINY_TRAIN_LENGTHS if args.tiny else TRAIN_LENGTHS)[:2]
                sec["steps"].append(gpu_check_train.train_step(length, device, args.tiny, free,
                                                               profile=profile))
            except Exception as e:  # noqa: BLE001 - an OOM is a finding, not a crash
                sec["steps"].append({"L": length, "failed": f"{type(e).__name__}: {e}"[:800]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            log(f"train: L={length} done")
            report["sections"]["train"] = sec
            save()
        # max-length mode at the longest length: tiles of 16K tokens (128 for --tiny), one KV
        # head's query heads per attention chunk
        length = (TINY_TRAIN_LENGTHS if args.tiny else TRAIN_LENGTHS)[-1]
        maxlen = {"mlp_tile": 128 if args.tiny else 16384, "heads_per_chunk": 2 if args.tiny else 4}
        if time.time() - t_start > args.budget_s:
            sec["max_length_mode"] = {"L": length, "skipped": f"time budget {args.budget_s} s"}
        else:
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            try:
                sec["max_length_mode"] = gpu_check_train.train_step(length, device, args.tiny,
                                                                    free, maxlen)
            except Exception as e:  # noqa: BLE001 - an OOM is a finding, not a crash
                sec["max_length_mode"] = {"L": length, "failed": f"{type(e).__name__}: {e}"[:800]}
            log(f"train: max-length mode L={length} done")
        report["sections"]["train"] = sec
        report["seconds"]["train"] = round(time.time() - t0, 1)
        save()
    if "engine" in sections:
        from benchmarks import gpu_check_engine

        t0 = time.time()
        sec = {"tiny": gpu_check_engine.run(device, True, log)}
        if not args.tiny and device.type == "cuda":
            if time.time() - t_start > args.budget_s:
                sec["full_width"] = {"skipped": f"time budget {args.budget_s} s"}
            else:
                sec["full_width"] = gpu_check_engine.run(device, False, log)
        report["sections"]["engine"] = sec
        report["seconds"]["engine"] = round(time.time() - t0, 1)
        save()
    if "generate" in sections:
        from benchmarks import gpu_check_generate

        t0 = time.time()
        report["sections"]["generate"] = gpu_check_generate.run(device, args.tiny, log)
        report["seconds"]["generate"] = round(time.time() - t0, 1)
        save()
    if "record" in sections:
        from benchmarks import gpu_check_record

        t0 = time.time()
        left = args.record_until_s - (t0 - t_start)
        ours = report["sections"].get("attention", {}).get("easy_context", {})
        if left < 60 and not args.tiny:
            report["sections"]["record"] = {"skipped": f"{left:.0f} s left of --record-until-s"}
        else:
            try:
                report["sections"]["record"] = gpu_check_record.run(
                    device, args.tiny, log, left, ours.get("tflops_per_s"))
            except Exception as e:  # noqa: BLE001 - an OOM is a finding, not a crash
                report["sections"]["record"] = {"failed": f"{type(e).__name__}: {e}"[:800]}
        report["seconds"]["record"] = round(time.time() - t0, 1)
    save()
    print(json.dumps({"elapsed_s": report["elapsed_s"], "seconds": report["seconds"],
                      "output": str(output)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
