"""Sequence-parallel attention against single-process flash attention: time, memory, balance.

For each method at N ranks (default 2), forward + backward of causal attention on a sequence
of L tokens (B=1, H=8 query heads, D=64, bf16), sharded with the method's own layout, versus
the same kernel on the whole sequence in one process with the same total number of threads
(one process with N threads vs. N ranks with one thread each).

    python benchmarks/attention.py                       # L = 4K, 16K, 32K, every method
    python benchmarks/attention.py --quick               # L = 2K, one repeat: a smoke run
    python benchmarks/attention.py --lengths 16384 --methods zigzag_ring_attn,ulysses_attn

Per row (method, L, KV heads):
- protocol: round-robin. Each round runs every contender once (the single process, each
  method, DeepSpeed's Ulysses beside ours), the first ``--warmup`` rounds are dropped, and a
  row is the median over the other rounds with its min and max (``time_ms_spread``): drift
  of a shared machine falls on all contenders alike. The CPU (model, vector extensions) is
  recorded with the results;
- time: wall time of one forward + backward; every rank times its own call between two
  barriers, the row takes the slowest rank per iteration, then the median over iterations;
- peak memory: resident-set high-water mark of each rank during forward + backward, above
  what it held before (its inputs); the row reports the largest rank. On the CPU that
  counts everything the process touched: communication buffers too;
- kernel / merge / comm: time spent inside the attention kernel (forward and backward), in
  the partial-result merge and waiting on communication, from timers that this script wraps
  around the library's functions in the benchmark processes only; the rest is copies,
  accumulation and Python. Kernel time per rank gives the compute balance (max / min);
  for ring-shaped methods the schedule's work per rank is also counted analytically;
- DeepSpeed's Ulysses ``DistributedAttention`` (if deepspeed imports) runs side by side with
  ``ulysses_attn`` -- alternating iterations in the same ranks, same inputs, same local
  kernel -- so the ratio isolates the all-to-all implementation.
- ``--sliding-window W``: every method (and the single process) also runs a sliding-window
  layer (transformers' ``sliding_window=W``) in alternation with its global layer, same
  ranks, same inputs; the row ``<method>@window=W`` has ``time_ratio_vs_global``, and
  ``computed_fraction``: the score entries its kernel calls cover against the global
  layer's, from the plan (attention/documents.py).

    python benchmarks/attention.py --lengths 16384 --sliding-window 1024

Results go to benchmarks/results/attention.json (rows merged by (method, L, KV heads) with
what is there, unless --fresh), which the README quotes.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import easy_context as ec  # noqa: E402
from benchmarks import common  # noqa: E402
from easy_context import layouts  # noqa: E402
from easy_context.parallel import SEQUENCE_PARALLEL  # noqa: E402
from easy_context.attention.variants import Variant  # noqa: E402
from easy_context.parallel.local import local_attention  # noqa: E402
from easy_context.memory.peak import PeakMemory  # noqa: E402

# What the figures measure: a results file older than the last change to these is stale.
MEASURES = ["easy_context/parallel", "easy_context/attention"]
DEFAULT_LENGTHS = (4096, 16384, 32768)
HEADS, HEAD_DIM, BATCH = 8, 64, 1
DTYPE = torch.bfloat16
SINGLE = "single"  # single-process flash attention on the whole sequence
DEEPSPEED = "deepspeed_ulysses"
TARGET_L = 16384
TARGETS = {"time_ratio_max": 1.15, "mem_ratio_max": 0.6, "zigzag_imbalance_max": 1.05,
           "ulysses_vs_deepspeed_max": 1.0}
MB = 2**20


# =========================================================================== rank side
# Everything below up to the "driver" section runs inside the DistPool ranks.

_COUNTERS: dict[str, float] = defaultdict(float)
_PATCHED: dict[str, Any] = {}


def _timed(fn: Callable, counter: str) -> Callable:
    def wrapper(*args, **kwargs):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _COUNTERS[counter] += time.perf_counter() - t0
            # CPU time of the calling thread: all of the kernel's work when the rank runs one
            # thread, and unlike wall time not inflated when the OS runs something else.
            _COUNTERS[counter + "_cpu"] += time.thread_time() - c0
            _COUNTERS[counter + "_calls"] += 1
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapper


_COMM_FUNCS = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_reduce", "broadcast", "send", "recv")


def _instrument() -> None:
    """Wrap, in this process only, the attention kernels, the merge and the communication
    calls with timers. Idempotent; call again after importing a method (to catch the merge
    functions that its module imported by name)."""
    import importlib

    kernels = importlib.import_module("easy_context.attention.kernels")
    merge_mod = importlib.import_module("easy_context.attention.merge")  # the package exports a
    comm = importlib.import_module("easy_context.parallel.comm")  # function called merge too

    if "kernels" not in _PATCHED:
        # Kernel is a frozen dataclass: every method (and local_attention) calls the same
        # object's forward/backward, so patching its fields times them all.
        for kern in {id(k): k for k in kernels.KERNELS.values()}.values():
            object.__setattr__(kern, "forward", _timed(kern.forward, "kernel_fwd"))
            object.__setattr__(kern, "backward", _timed(kern.backward, "kernel_bwd"))
        comm.Exchange.wait = _timed(comm.Exchange.wait, "comm_wait")
        for name in _COMM_FUNCS:  # blocking collectives, reached as dist.<name> at call time
            if hasattr(dist, name):
                setattr(dist, name, _timed(getattr(dist, name), "comm_wait"))
        _PATCHED["kernels"] = True
        _PATCHED["merge_originals"] = {merge_mod.merge_into: _timed(merge_mod.merge_into, "merge"),
                                       merge_mod.merge: _timed(merge_mod.merge, "merge")}
    # merge_into/merge as imported by name into the method modules (not inside merge.py, so
    # that merge() -> merge_into() is not counted twice).
    originals = _PATCHED["merge_originals"]
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("easy_context.") or mod is merge_mod or mod is None:
            continue
        for attr in ("merge_into", "merge"):
            fn = getattr(mod, attr, None)
            if fn in originals:
                setattr(mod, attr, originals[fn])


def _counters() -> dict[str, float]:
    c = dict(_COUNTERS)
    kernel = c.get("kernel_fwd", 0.0) + c.get("kernel_bwd", 0.0)
    return {"kernel_s": kernel, "kernel_fwd_s": c.get("kernel_fwd", 0.0),
            "kernel_bwd_s": c.get("kernel_bwd", 0.0),
            "kernel_thread_cpu_s": c.get("kernel_fwd_cpu", 0.0) + c.get("kernel_bwd_cpu", 0.0),
            "kernel_calls": int(c.get("kernel_fwd_calls", 0) + c.get("kernel_bwd_calls", 0)),
            "merge_s": c.get("merge", 0.0), "comm_wait_s": c.get("comm_wait", 0.0)}


_DS_STATE: dict[str, Any] = {}


def _deepspeed_attention():
    if "da" not in _DS_STATE:
        import logging

        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        if not deepspeed.comm.is_initialized():
            # init_distributed JIT-compiles a shared-memory all-reduce op for CPU (minutes on a
            # 2-core machine, the first time). DistributedAttention does not use it: its
            # all-to-alls go to torch.distributed.all_to_all_single. Skip the build.
            import deepspeed.comm.torch  # noqa: F401  (the attribute is shadowed by torch)

            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)

        def local_attn(q, k, v, *args, **kwargs):  # (B, S, H/N, D): the same kernel as ours
            return local_attention(q, k, v, causal=True)

        # (B, S/N, H, D) in: scatter heads (dim 2), gather sequence (dim 1); batch_dim_idx=0.
        _DS_STATE["da"] = DistributedAttention(local_attn, dist.group.WORLD, scatter_idx=2,
                                               gather_idx=1)
        _instrument()
    da = _DS_STATE["da"]
    return lambda q, k, v: da(q, k, v, 0)


WINDOW_TAG = "@window="


def split_window(name: str) -> tuple[str, int | None]:
    """("zigzag_ring_attn", 1024) from "zigzag_ring_attn@window=1024"; (name, None) without."""
    base, tag, window = name.partition(WINDOW_TAG)
    return base, int(window) if tag else None


STAGES_TAG = "@stages="


def _with_stages(attn: Callable, stages: int) -> Callable:
    """``attn`` with Ulysses' stage limit set to ``stages`` for the call (the pipeline of one
    call is fixed in its forward)."""
    from easy_context.parallel import ulysses

    def staged(q, k, v):
        saved = dict(ulysses.STAGES)
        ulysses.STAGES.update({kind: stages for kind in saved})
        try:
            return attn(q, k, v)
        finally:
            ulysses.STAGES.update(saved)
    return staged


def _variant(name: str, ring_degree: int | None, rank: int, world: int):
    """(shard function for a full (B, L, H, D) tensor, attention function on the shards)."""
    name, window = split_window(name)
    name, tag, stages = name.partition(STAGES_TAG)
    if tag:
        shard, attn = _variant(name, ring_degree, rank, world)
        return shard, _with_stages(attn, int(stages))
    if name == SINGLE:
        return (lambda x: x), (lambda q, k, v: local_attention(
            q, k, v, causal=True, variant=None if window is None else Variant(window)))
    if name == DEEPSPEED:
        fn = _deepspeed_attention()
        return (lambda x: layouts.shard(x, "contiguous", rank, world, 1)), fn
    ec.METHODS[name].attention  # import the module now (not inside the timed region)
    _instrument()

    def shard(x):
        return ec.shard_sequence(x, name, rank, world, dim=1, ring_degree=ring_degree)

    def attn(q, k, v):
        return ec.sequence_parallel_attention(q, k, v, name, causal=True, ring_degree=ring_degree,
                                              sliding_window=window)

    return shard, attn


def _inputs(length: int, kv_heads: int, seed: int, shard: Callable):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(BATCH, length, h, HEAD_DIM, generator=gen, dtype=DTYPE)
            for h in (HEADS, kv_heads, kv_heads, HEADS)]
    q, k, v, dout = (shard(t).contiguous().clone() for t in full)
    del full
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, dout


def _one_call(fn, q, k, v, dout, barrier: Callable[[], None]) -> dict[str, Any]:
    for t in (q, k, v):
        t.grad = None
    barrier()
    _COUNTERS.clear()
    with PeakMemory("cpu") as pm:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(q, k, v)
        t1 = time.perf_counter()
        out.backward(dout)
        t2, c2 = time.perf_counter(), time.process_time()
    del out
    res = {"time_s": t2 - t0, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "process_cpu_s": c2 - c0,
           "peak_bytes": pm.peak_bytes}
    res.update(_counters())
    barrier()
    return res


def bench_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Run on every rank of the pool. spec: variants [(name, ring_degree)], length, kv_heads,
    warmup, warmup_length, repeats, seed, threads. Variants are measured in alternation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    single = spec["variants"][0][0] == SINGLE
    if single:
        if rank != 0:
            return None  # the other ranks sit idle in the pool while rank 0 measures
        rank, world = 0, 1
        barrier = lambda: None  # noqa: E731
    else:
        barrier = dist.barrier
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(spec["threads"])
    _instrument()
    try:
        variants = []
        for name, rd in spec["variants"]:
            try:
                shard, fn = _variant(name, rd, rank, world)
            except Exception:
                if name != DEEPSPEED:
                    raise
                variants.append((name, None, None, traceback.format_exc(limit=3)))
                continue
            variants.append((name, shard, fn, None))
        live = [v for v in variants if v[1] is not None]
        results: dict[str, Any] = {name: {"iters": [], "error": err} for name, _, _, err in variants}
        # warm-up: first calls pay for lazy imports, thread pools, gloo pair setup
        for _ in range(spec["warmup"]):
            for name, shard, fn, _ in live:
                q, k, v, dout = _inputs(spec["warmup_length"], spec["kv_heads"], spec["seed"], shard)
                _one_call(fn, q, k, v, dout, barrier)
                del q, k, v, dout
        inputs = {name: _inputs(spec["length"], spec["kv_heads"], spec["seed"], shard)
                  for name, shard, _, _ in live}
        gc.collect()
        for _ in range(spec["repeats"]):
            for name, _, fn, _ in live:
                results[name]["iters"].append(_one_call(fn, *inputs[name], barrier))
        return {"rank": rank, "threads": torch.get_num_threads(), "results": results,
                "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    finally:
        torch.set_num_threads(threads_before)


# =========================================================================== driver
def _median(xs):
    xs = [x for x in xs if x is not None]
    return common.median(xs) if xs else None


def _r(x, nd=1):
    return None if x is None else round(x, nd)


def schedule_work(method: str, world: int, length: int) -> list[float] | None:
    """Score entries each rank computes under a causal mask, from the method's schedule
    (ring-shaped methods only): a diagonal causal block of n rows counts n(n+1)/2."""
    try:
        if method == "ring_attn":
            from easy_context.parallel.ring import contiguous_schedule as schedule
        elif method == "zigzag_ring_attn":
            from easy_context.parallel.zigzag import zigzag_schedule as schedule
        else:
            return None
    except ImportError:
        return None
    local = length // world
    work = []
    for rank in range(world):
        area = 0.0
        for src in range(world):
            for blk in schedule(src, rank, local, True):
                nq = len(range(local)[blk.q])
                nk = len(range(local)[blk.kv])
                area += nq * (nq + 1) / 2 if blk.causal else nq * nk
        work.append(area)
    return work


def computed_fraction(method: str, world: int, length: int, window: int,
                      ring_degree: int | None = None) -> float:
    """Score entries the plan's kernel calls see for a sliding layer, summed over ranks,
    against the global layer's (causal: L (L + 1) / 2): what a kernel with a window computes,
    up to its tile granularity (flash-attn's blocks; the CPU tiling of bands.py)."""
    from easy_context.attention.documents import Geometry, ShardDocuments

    if method in (SINGLE, "local", "ulysses_attn") or (method == "usp_attn" and ring_degree == 1):
        shards, layout = 1, "whole"  # one sequence (Ulysses: every rank's heads, all tokens)
    elif method == "allgather_attn":
        shards, layout = world, "zigzag"
    else:
        shards, layout = world, ec.get_method(method).layout if method != "usp_attn" else "zigzag"
    s = length // shards
    segments = tuple(layouts.segments(layout, r, shards, s) for r in range(shards))
    docs = ShardDocuments.plain((s,) * shards, Geometry(segments, True, window))
    from easy_context.attention.kernels import offsets

    covered = 0
    for qs in range(shards):
        for ks in range(shards):
            for c in docs.calls(qs, slice(None), ks, slice(None), False):
                n, m = len(range(s)[c.q]), len(range(s)[c.kv])
                if c.window is None:
                    covered += n * (n + 1) // 2 if c.causal else n * m
                    continue
                lo, hi = offsets(n, m, False, c.window)
                i = torch.arange(n)
                first = (i + lo).clamp(min=0) if lo is not None else torch.zeros_like(i)
                last = (i + hi).clamp(max=m - 1) if hi is not None else torch.full_like(i, m - 1)
                covered += int((last - first + 1).clamp(min=0).sum())
    return covered / (length * (length + 1) / 2)


def summarize(name: str, per_rank: list[dict], length: int, kv_heads: int, world: int,
              threads: int, ring_degree: int | None, spec: dict) -> dict[str, Any]:
    """One row from every rank's iterations of one variant."""
    n_iter = min(len(r["iters"]) for r in per_rank)
    slowest = [max(r["iters"][i]["time_s"] for r in per_rank) for i in range(n_iter)]

    def per_rank_median(key, scale=1.0):
        return [_median(it[key] * scale if it[key] is not None else None for it in r["iters"])
                for r in per_rank]

    time_rank = per_rank_median("time_s", 1e3)
    kernel = per_rank_median("kernel_s", 1e3)
    kernel_cpu = per_rank_median("kernel_thread_cpu_s", 1e3)
    cpu = per_rank_median("process_cpu_s", 1e3)
    merge = per_rank_median("merge_s", 1e3)
    comm = per_rank_median("comm_wait_s", 1e3)
    peak = per_rank_median("peak_bytes", 1 / MB)
    other = [t - k - m - c if None not in (t, k, m, c) else None
             for t, k, m, c in zip(time_rank, kernel, merge, comm)]
    base, window = split_window(name)
    row = {
        "method": (base if not (base == "usp_attn" and ring_degree != 1)
                   else f"usp_attn[ring_degree={ring_degree}]")
        + ("" if window is None else f"{WINDOW_TAG}{window}"),
        "L": length, "kv_heads": kv_heads, "heads": HEADS, "head_dim": HEAD_DIM, "batch": BATCH,
        "dtype": "bf16", "causal": True, "world_size": world, "threads_per_rank": threads,
        "ring_degree": ring_degree,
        "time_ms": _r(_median(slowest) * 1e3), "time_ms_iters": [_r(t * 1e3) for t in slowest],
        "fwd_ms": _r(_median(max(r["iters"][i]["fwd_s"] for r in per_rank) for i in range(n_iter)) * 1e3),
        "bwd_ms": _r(_median(max(r["iters"][i]["bwd_s"] for r in per_rank) for i in range(n_iter)) * 1e3),
        "time_ms_per_rank": [_r(t) for t in time_rank],
        "peak_mb": _r(max(p for p in peak if p is not None)) if any(p is not None for p in peak) else None,
        "peak_mb_per_rank": [_r(p) for p in peak],
        "kernel_ms_per_rank": [_r(k) for k in kernel],
        "merge_ms_per_rank": [_r(m) for m in merge],
        "comm_wait_ms_per_rank": [_r(c) for c in comm],
        "other_ms_per_rank": [_r(o) for o in other],
        "kernel_calls_per_rank": [per_rank[i]["iters"][0]["kernel_calls"] for i in range(len(per_rank))],
        "kernel_thread_cpu_ms_per_rank": [_r(k) for k in kernel_cpu],
        "process_cpu_ms_per_rank": [_r(c) for c in cpu],
        "process_cpu_ms_total": _r(sum(c for c in cpu if c is not None)),
        "kernel_imbalance_wall": (_r(max(kernel) / min(kernel), 3)
                                  if world > 1 and min(kernel) > 0 else None),
        "kernel_imbalance": (_r(max(kernel_cpu) / min(kernel_cpu), 3)
                             if world > 1 and threads == 1 and min(kernel_cpu) > 0 else None),
        "repeats": n_iter, "warmup": spec["warmup"],
        "warmup_length": spec["warmup_length"] if spec["warmup"] else None,
    }
    work = schedule_work(name, world, length) if split_window(name)[1] is None else None
    if work:
        row["schedule_work_per_rank"] = work
        row["schedule_imbalance"] = _r(max(work) / min(work), 3)
    return row


def _available_methods(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    ok, skipped = [], {}
    for name in wanted:
        try:
            ec.METHODS[name].attention
        except Exception as e:  # module missing or broken: others may still be writing it
            skipped[name] = f"{type(e).__name__}: {e}".strip()[:300]
            continue
        ok.append(name)
    return ok, skipped


def _deepspeed_status() -> dict[str, Any]:
    import importlib.util

    version = common._package_version("deepspeed")
    if version is None or importlib.util.find_spec("deepspeed") is None:
        return {"installed": False, "version": None,
                "note": "deepspeed is not installed: `pip install deepspeed --no-deps` and its "
                        "pure-python deps (einops hjson msgpack ninja py-cpuinfo pydantic)"}
    return {"installed": True, "version": version}


def _row_key(r: dict) -> tuple:
    return (r["method"], r["L"], r["kv_heads"])


def evaluate_targets(rows: list[dict]) -> list[dict[str, Any]]:
    by = {_row_key(r): r for r in rows if "error" not in r}
    out = []

    def add(name, value, limit, what):
        out.append({"target": name, "value": value, "limit": limit,
                    "status": "NOT MEASURED" if value is None else ("PASS" if value <= limit else "FAIL"),
                    "what": what})

    for m in ("zigzag_ring_attn", "dist_flash_attn"):
        r = by.get((m, TARGET_L, HEADS), {})
        add(f"{m} time / single @ L={TARGET_L}", r.get("time_ratio_vs_single"),
            TARGETS["time_ratio_max"], "slowest-rank fwd+bwd time over single-process flash attention")
        add(f"{m} peak memory / single @ L={TARGET_L}", r.get("mem_ratio_vs_single"),
            TARGETS["mem_ratio_max"], "largest per-rank fwd+bwd peak over the single process's")
    lengths = sorted({r["L"] for r in rows})
    for length in lengths:
        r = by.get(("zigzag_ring_attn", length, HEADS))
        if r is not None or length == TARGET_L:
            add(f"zigzag_ring_attn kernel imbalance (max/min) @ L={length}",
                (r or {}).get("kernel_imbalance"), TARGETS["zigzag_imbalance_max"],
                "per-rank CPU time inside the attention kernel (1 thread per rank), max over min")
    for length in lengths:
        r = by.get(("ulysses_attn", length, HEADS))
        if r is not None and r.get("time_ratio_vs_deepspeed") is not None:
            # paired: the median of the per-round ratios (each round runs both in the same
            # ranks one after the other), which a drifting machine moves least
            paired = (r.get("time_ratio_vs_deepspeed_spread") or {}).get("median",
                                                                         r["time_ratio_vs_deepspeed"])
            add(f"ulysses_attn time / DeepSpeed DistributedAttention @ L={length}",
                paired, TARGETS["ulysses_vs_deepspeed_max"],
                "median of the per-round ratios, the two alternating in the same ranks")
    return out


def table(rows: list[dict], markdown: bool = False) -> str:
    header = ["method", "L", "Hkv", "time ms", "x single", "cpu x single", "fwd ms", "bwd ms",
              "peak MB/rank", "x single", "kernel ms/rank", "imbal", "merge+comm+other ms/rank"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["method"], r["L"], r["kv_heads"], "ERROR", "", "", "", "", "", "", "", "",
                         r["error"].strip().splitlines()[-1][:60]])
            continue
        rest = "/".join(f"{m:.0f}+{c:.0f}+{o:.0f}" for m, c, o in
                        zip(r["merge_ms_per_rank"], r["comm_wait_ms_per_rank"], r["other_ms_per_rank"])
                        if None not in (m, c, o))
        body.append([r["method"], r["L"], r["kv_heads"], f"{r['time_ms']:.0f}",
                     "" if r.get("time_ratio_vs_single") is None else f"{r['time_ratio_vs_single']:.2f}",
                     "" if r.get("cpu_ratio_vs_single") is None else f"{r['cpu_ratio_vs_single']:.2f}",
                     f"{r['fwd_ms']:.0f}", f"{r['bwd_ms']:.0f}",
                     "" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}",
                     "" if r.get("mem_ratio_vs_single") is None else f"{r['mem_ratio_vs_single']:.2f}",
                     "/".join(f"{k:.0f}" for k in r["kernel_ms_per_rank"] if k is not None),
                     "" if r.get("kernel_imbalance") is None else f"{r['kernel_imbalance']:.3f}",
                     rest])
    return common.fmt_table(header, body, markdown=markdown)


def targets_table(targets: list[dict], markdown: bool = False) -> str:
    body = [[t["target"], "" if t["value"] is None else f"{t['value']:.3f}", f"<= {t['limit']}",
             t["status"]] for t in targets]
    return common.fmt_table(["target", "value", "limit", "status"], body, markdown=markdown)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help="comma-separated total sequence lengths (default %(default)s)")
    p.add_argument("--methods", default=",".join(SEQUENCE_PARALLEL),
                   help="comma-separated methods (default: every sequence-parallel one); usp_attn gives two "
                        "rows, ring_degree=1 (Ulysses over 2) and ring_degree=N (pure ring)")
    p.add_argument("--no-deepspeed", action="store_true",
                   help="do not run DeepSpeed's DistributedAttention beside ulysses_attn")
    p.add_argument("--ulysses-stages", default="",
                   help="comma-separated stage limits (parallel/ulysses.py STAGES) to run as "
                        "contenders ulysses_attn@stages=K beside ulysses_attn and DeepSpeed "
                        "(1: the exchange unpipelined); '' for none")
    p.add_argument("--gqa-lengths", default="4096",
                   help="lengths at which to add rows with 2 KV heads (GQA 8/2); '' for none")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed iterations per row (median); L >= 32768 uses max(1, repeats // 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="round-robin rounds run first and dropped (warm-up at the length itself)")
    p.add_argument("--world-size", type=int, default=2, help="N, the number of ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(common.results_path("attention")),
                   help="JSON results file (default %(default)s)")
    p.add_argument("--fresh", action="store_true", help="replace the output file instead of merging rows")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: L=2048 only, 1 repeat, no GQA rows")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="also run each method's sliding-window layer of this window, side by side "
                        "with its global one (rows <method>@window=W)")
    p.add_argument("--machine-note", default=None,
                   help="free text stored as machine_note (e.g. 'shared machine, other jobs running')")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.gqa_lengths = "2048", 1, ""
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.gqa_lengths = [int(x) for x in args.gqa_lengths.split(",") if x.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.ulysses_stages = [int(x) for x in args.ulysses_stages.split(",") if x.strip()]
    unknown = [m for m in args.methods if m not in SEQUENCE_PARALLEL]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(SEQUENCE_PARALLEL)}")
    return args


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # runs the finally: that closes the ranks


def main(argv=None) -> int:
    args = parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    common.setup_env()  # before the ranks are spawned: their allocator must return big frees
    from easy_context.testing import DistError, DistPool

    world = args.world_size
    methods, skipped = _available_methods(args.methods)
    for m, why in skipped.items():
        print(f"[skip] {m}: {why}", file=sys.stderr, flush=True)
    ds = _deepspeed_status() if not args.no_deepspeed else {"installed": None, "note": "--no-deepspeed"}
    run_id = common.now_iso()
    machine = common.machine_info()
    t_start = time.time()

    old = None if args.fresh else common.load_results(args.output)

    def save(final: bool):
        """Write what is measured so far (after every row: a long run that is stopped
        still leaves its results), merged with the rows already in the file."""
        elapsed = time.time() - t_start
        all_rows = common.merge_rows(old.get("rows", []) if old else [], rows, _row_key)
        skipped_now = {m: why for m, why in skipped.items()}
        if old:  # a method measured earlier and skipped now keeps its rows and is not "skipped"
            measured = {r["method"] for r in all_rows if "error" not in r}
            skipped_now = {m: w for m, w in skipped_now.items() if m not in measured}
        targets = evaluate_targets(all_rows)
        runs = (old.get("runs", []) if old else []) + [{
            "run_id": run_id, "argv": sys.argv[1:] if argv is None else list(argv),
            "elapsed_s": round(elapsed, 1), "complete": final, "machine": machine,
            "load_average_1_5_15_at_end": common.load_average(), "worker_malloc_mmap_threshold": worker_env,
            "machine_note": args.machine_note}]
        payload = {
            "benchmark": "attention",
            "description": ("fwd+bwd of causal attention, B=1, H=8, D=64, bf16: each sequence-parallel "
                            f"method on N={world} gloo ranks with 1 thread each vs single-process flash "
                            f"attention on the whole sequence with {world} threads (same kernel)."),
            "protocol": {
                "time": "per iteration the slowest rank's wall time between barriers; median over iterations",
                "memory": "per-rank RSS high-water above the inputs during fwd+bwd (PeakMemory), median "
                          "over iterations, largest rank; includes communication buffers",
                "balance": "kernel_imbalance: per-rank CPU time (thread_time; each rank runs 1 thread) "
                           "inside the attention kernel, from timers wrapped around the kernel in the "
                           "benchmark processes, max / min; kernel_imbalance_wall: the same with wall "
                           "time (inflated by other load); schedule_imbalance: the schedule's score "
                           "entries per rank",
                "cpu": "process_cpu_ms: CPU time of each process (all its threads, gloo's included) "
                       "during fwd+bwd; cpu_ratio_vs_single = sum over ranks / single process: the "
                       "work overhead of the method, much less sensitive to a busy machine than wall time",
                "breakdown": "merge = partial-result merge; comm = blocking collectives + waits on "
                             "async P2P; other = copies, accumulation, casts, Python",
                "deepspeed": "DistributedAttention alternates iterations with ulysses_attn in the same ranks; "
                             "time_ratio_vs_deepspeed_per_round pairs the two within each round",
                "repeats": "round-robin: --warmup + repeats rounds (repeats = --repeats at L < 32768, "
                           "max(1, repeats // 3) at 32768 and above), each running every contender "
                           "once in the same order (a job's variants alternate within it); the "
                           "first --warmup rounds dropped, medians and min/max over the rest",
                "env": common.BENCH_ENV,
            },
            "machine": machine,
            "machine_note": args.machine_note if args.machine_note is not None
            else (old or {}).get("machine_note"),
            "deepspeed": ds,
            "skipped_methods": skipped_now,
            "targets": targets,
            "rows": all_rows,
            "runs": runs[-20:],
        }
        payload["table"] = table(all_rows)
        payload["table_markdown"] = table(all_rows, markdown=True)
        payload["targets_markdown"] = targets_table(targets, markdown=True)
        path = common.write_results(args.output, payload)
        return path, all_rows, targets, skipped_now, elapsed

    rows: list[dict] = []
    worker_env = None
    pool = DistPool(world, threads_per_rank=1, timeout_s=600, pg_timeout_s=1800)
    try:
        for length in args.lengths:
            for kv_heads in [HEADS] + ([2] if length in args.gqa_lengths else []):
                repeats = args.repeats if length < 32768 else max(1, args.repeats // 3)
                base = {"length": length, "kv_heads": kv_heads, "seed": args.seed,
                        "warmup": 0, "warmup_length": length, "repeats": 1}
                # a generous timeout: minutes per iteration at 16K on a busy 2-core machine
                timeout = 300 + 300 * max(1.0, (length / 16384) ** 2)
                jobs = [[(SINGLE, None)]]
                for m in methods:
                    if m == "usp_attn":
                        jobs += [[(m, 1)], [(m, world)]]
                    elif m == "ulysses_attn":
                        jobs.append([(m, None)] + [(f"{m}{STAGES_TAG}{n}", None)
                                                   for n in args.ulysses_stages]
                                    + ([(DEEPSPEED, None)] if ds.get("installed") else []))
                    else:
                        jobs.append([(m, None)])
                if args.sliding_window:  # each global layer beside its sliding one
                    tag = f"{WINDOW_TAG}{args.sliding_window}"
                    jobs = [[(n, rd) for n, rd in job if n != DEEPSPEED]
                            + [(n + tag, rd) for n, rd in job if n != DEEPSPEED] for job in jobs]
                # Round-robin: each round runs every contender once (the variants of a job
                # alternate inside it too), so drift of a shared machine falls on all alike;
                # the first --warmup rounds (lazy imports, gloo pairs, allocator growth at this
                # length) are dropped, medians over the rest.
                rounds = args.warmup + repeats
                kept: dict[int, list] = {i: [] for i in range(len(jobs))}
                failed: set[int] = set()
                load = common.load_average()
                for rnd in range(rounds):
                    for i, variants in enumerate(jobs):
                        if i in failed:
                            continue
                        is_single = variants[0][0] == SINGLE
                        spec = dict(base, variants=variants, threads=world if is_single else 1)
                        label = "+".join(n if rd is None else f"{n}[rd={rd}]" for n, rd in variants)
                        t0 = time.time()
                        try:
                            got = pool.run(bench_rank, spec, timeout_s=timeout * len(variants))
                        except DistError as e:
                            failed.add(i)
                            print(f"[error] {label} L={length} Hkv={kv_heads}: {str(e)[-800:]}",
                                  file=sys.stderr, flush=True)
                            for n, rd in variants:
                                name = n if not (n == "usp_attn" and rd != 1) else f"usp_attn[ring_degree={rd}]"
                                rows.append({"method": name, "L": length, "kv_heads": kv_heads,
                                             "error": str(e)[-2000:], "run_id": run_id})
                            save(final=False)
                            continue
                        got = [g for g in got if g is not None]
                        worker_env = got[0]["malloc_mmap_threshold"]
                        if rnd >= args.warmup:
                            kept[i].append(got)
                        print(f"[{time.time() - t_start:6.0f}s] round {rnd + 1}/{rounds}"
                              f"{' (dropped)' if rnd < args.warmup else ''} {label:<40} "
                              f"L={length:<6} Hkv={kv_heads} ({time.time() - t0:.0f} s)",
                              file=sys.stderr, flush=True)
                new, single_row = {}, None
                for i, variants in enumerate(jobs):
                    if i in failed or not kept[i]:
                        continue
                    is_single = variants[0][0] == SINGLE
                    n_ranks = 1 if is_single else world
                    spec = dict(base, variants=variants, threads=world if is_single else 1,
                                repeats=len(kept[i]), warmup=args.warmup)
                    for name, rd in variants:
                        # every kept round's iterations of this contender, rank by rank
                        per_rank = [{"iters": [it for got in kept[i] for it in got[r]["results"][name]["iters"]],
                                     "error": kept[i][0][r]["results"][name].get("error")}
                                    for r in range(len(kept[i][0]))]
                        if per_rank[0].get("error"):
                            ds["error"] = per_rank[0]["error"][-1500:]
                            print(f"[error] {name}: {ds['error']}", file=sys.stderr, flush=True)
                            continue
                        row = summarize(name, per_rank, length, kv_heads, n_ranks,
                                        spec["threads"], rd, spec)
                        row["run_id"], row["load_average_1m_at_start"] = run_id, load and load[0]
                        row["protocol"] = "round-robin"
                        row["time_ms_spread"] = {k: _r(v) for k, v in
                                                 common.spread(row["time_ms_iters"]).items()}
                        if name == "usp_attn":
                            row["note"] = ("ring_degree=1: Ulysses over both ranks (the main usp row)"
                                           if rd == 1 else f"ring_degree={rd}=N: a pure zigzag ring")
                        if name == DEEPSPEED:
                            row["note"] = ("deepspeed.sequence.layer.DistributedAttention(scatter_idx=2, "
                                           "gather_idx=1), local attention = easy_context local_attention")
                        key = row["method"]
                        new[key] = row
                        if name == SINGLE:
                            single_row = row
                for row in new.values():
                    if single_row is not None and row is not single_row and row["threads_per_rank"] == 1:
                        row["time_ratio_vs_single"] = _r(row["time_ms"] / single_row["time_ms"], 3)
                        if row["process_cpu_ms_total"] and single_row["process_cpu_ms_total"]:
                            row["cpu_ratio_vs_single"] = _r(row["process_cpu_ms_total"]
                                                            / single_row["process_cpu_ms_total"], 3)
                        if row["peak_mb"] is not None and single_row["peak_mb"]:
                            row["mem_ratio_vs_single"] = _r(row["peak_mb"] / single_row["peak_mb"], 3)
                for name, row in new.items():
                    plain, window = split_window(name)
                    if window is not None and plain in new:
                        row["time_ratio_vs_global"] = _r(row["time_ms"] / new[plain]["time_ms"], 3)
                        rd = row.get("ring_degree")
                        row["computed_fraction"] = _r(computed_fraction(
                            plain.split("[")[0], world, length, window, rd), 4)
                for ours in [r for n, r in new.items() if n.startswith("ulysses_attn")]:
                    if DEEPSPEED not in new:
                        break
                    theirs = new[DEEPSPEED]
                    ours["time_ratio_vs_deepspeed"] = _r(ours["time_ms"] / theirs["time_ms"], 3)
                    # paired: the two alternate inside each round, so each round gives a ratio
                    per_round = [a / b for a, b in zip(ours["time_ms_iters"], theirs["time_ms_iters"])]
                    ours["time_ratio_vs_deepspeed_per_round"] = [_r(x, 3) for x in per_round]
                    ours["time_ratio_vs_deepspeed_spread"] = {
                        k: _r(v, 3) for k, v in common.spread(per_round).items()}
                    # what the all-to-all implementations differ in: each rank's time outside
                    # the (identical) attention kernel, the slowest rank's, ours over theirs
                    outside = [max(t - k for t, k in zip(x["time_ms_per_rank"],
                                                         x["kernel_ms_per_rank"]))
                               for x in (ours, theirs)]
                    ours["outside_kernel_ms_vs_deepspeed"] = [_r(v, 1) for v in outside]
                    ours["outside_kernel_ratio_vs_deepspeed"] = _r(outside[0] / outside[1], 3)
                rows.extend(new.values())
                save(final=False)
                for row in new.values():
                    print(f"{row['method']:<40} L={length:<6} Hkv={kv_heads} time "
                          f"{row['time_ms']:9.1f} ms ({row['time_ms_spread']})  "
                          f"x{row.get('time_ratio_vs_single', 1.0):.2f}  peak {row['peak_mb']} MB",
                          file=sys.stderr, flush=True)
    finally:
        pool.close()

    path, all_rows, targets, skipped_now, elapsed = save(final=True)

    print()
    print(table(all_rows))
    print()
    print(targets_table(targets))
    if skipped_now:
        print("\nskipped (module missing or broken):")
        for m, why in skipped_now.items():
            print(f"  {m}: {why}")
    if ds.get("installed") is False or ds.get("error"):
        print(f"\nDeepSpeed: {ds.get('note') or ds.get('error')}")
    print(f"\nwrote {path} in {elapsed:.0f} s")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
