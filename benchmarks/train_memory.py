"""Peak memory per rank and tokens/s of ONE training step: EasyContext vs plain transformers.

Model: a fixed tiny Llama (4 layers, hidden 256, 4 heads, 2 kv heads, intermediate 688,
vocabulary 32000), random weights, fp32 weights and compute (no autocast) on both sides.
Sequence length L = 8K, 16K, 32K tokens (one sequence).

ours (the trainer's pieces, easy_context.train):
    apply_sequence_parallel(model, "zigzag_ring_attn") over N ranks (N = 1: a one-rank gloo
    group, 2 threads; N = 2: easy_context.testing.DistPool, 1 thread per rank), activation
    checkpointing per decoder layer (easy_context.memory.checkpointing, "full" and
    "attention"), CausalLMLoss chunked (chunk 4096 tokens, the trainer's default), backward,
    AdamW step. Parameters are replicated on each rank (no FSDP sharding: what is measured is
    the step's activation memory per rank).
plain (what a user does without us): AutoModelForCausalLM(attn_implementation="sdpa"),
    model(input_ids, labels=...) with full logits, backward, AdamW step; one process, 2
    threads; no checkpointing, and again with transformers' gradient checkpointing.

Memory: each measurement runs in a fresh process with MALLOC_MMAP_THRESHOLD_=65536 (freed big
blocks go back to the OS), capped at 90% of the memory free at its start (an oversized run
fails with an allocation error, recorded, instead of waking the OOM killer). The model and the
AdamW states (exp_avg, exp_avg_sq, created before the step) exist before the measurement:

    step_peak_mb    resident-set high-water mark during the step minus the resident size at its
                    start (easy_context.memory.peak.PeakMemory): activations, logits, gradients,
                    communication buffers, temporaries
    abs_peak_mb     the absolute high-water mark of the process (VmHWM): everything, including
                    the Python/torch runtime, weights and optimizer states
    activation_mb   step_peak_mb - gradient bytes (fp32, one per parameter): the step peak minus
                    (params + grads + optimizer states), params and optimizer states being
                    already excluded by measuring above the start

Per rank for N = 2: the larger of the two ranks. tokens/s: L / wall time of the step (slowest
rank). Targets (issue 4):
    T1  at 32K, ours per-rank step peak at N=2 <= 0.6 x at N=1        (full checkpointing)
    T2  at 32K, ours (N=1) <= 0.15 x plain transformers (no checkpointing), step peaks
    T3  ours activation_mb at 32K <= 2.1 x at 16K                     (N=1, full checkpointing)

    python benchmarks/train_memory.py                        # everything, ~10 min unloaded
    python benchmarks/train_memory.py --budget-s 1500        # stop starting runs after 25 min
    python benchmarks/train_memory.py --lengths 1024,2048 --out /tmp/x.json   # a quick look

Runs start in the order that decides the targets first (32K, then 16K, then the rest); when
the time budget is spent, the remaining runs are recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# the modules whose change makes these results stale (ours: apply_sequence_parallel,
# checkpointing, the chunked loss, the inputs' sharding; plain: none of it)
MEASURES = ["easy_context/integrations", "easy_context/parallel", "easy_context/attention",
            "easy_context/memory", "easy_context/compat.py", "easy_context/sequence_parallel.py",
            "easy_context/layouts.py"]
RESULTS = REPO / "benchmarks" / "results" / "train_memory.json"
BENCH_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
             attention_dropout=0.0, tie_word_embeddings=False)
MB = 2**20


# --------------------------------------------------------------------------- measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))




def _model(vocab: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**MODEL, "vocab_size": vocab})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                             dtype=torch.float32)
    model.train()
    return model


def _optimizer_with_state(params):
    """AdamW with its states allocated now (as after a first step), so they are not part of
    the measured step."""
    import torch

    params = list(params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
    return opt


def measure(mode: str, length: int, kind: str, vocab: int, world: int, mem_share: float) -> dict:
    """One training step on this rank; ``mode`` is "ours" or "plain"."""
    import torch
    import torch.distributed as dist

    from easy_context.memory.peak import PeakMemory

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _model(vocab)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, length + 1), generator=gen)
    if mode == "ours":
        from easy_context.compat import prepare_seq_parallel_inputs
        from easy_context.integrations.hf import CausalLMLoss, apply_sequence_parallel
        from easy_context.memory.checkpointing import apply_activation_checkpointing

        apply_sequence_parallel(model, "zigzag_ring_attn", group=dist.group.WORLD)
        apply_activation_checkpointing(model, kind)
        root = CausalLMLoss(model, chunked=True)
        local = prepare_seq_parallel_inputs("zigzag_ring_attn", ids[:, :-1], None, ids[:, 1:],
                                            rank, world, "cpu")
        batch = dict(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"],
                     target_ids=local["local_target_ids"], group=dist.group.WORLD)

        def step_loss():
            return root(**batch)
    else:
        if kind == "hf_checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        input_ids, labels = ids[:, :-1], ids[:, :-1].clone()

        def step_loss():
            # transformers shifts the labels itself (L-1 targets; ours has L)
            return model(input_ids=input_ids, labels=labels, use_cache=False).loss

    opt = _optimizer_with_state(model.parameters())
    common.cap_address_space(mem_share)
    if world > 1:
        dist.barrier()
    out = {"rank": rank, "params": n_params}
    start_rss = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    try:
        with PeakMemory("cpu") as pm:
            loss = step_loss()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        out.update(ok=True, loss=float(loss), step_s=time.perf_counter() - t0,
                   step_peak_mb=pm.peak_bytes / MB, start_rss_mb=start_rss / MB,
                   abs_peak_mb=_status_kib("VmHWM") / 1024,
                   grads_mb=n_params * 4 / MB, params_mb=n_params * 4 / MB,
                   optimizer_states_mb=2 * n_params * 4 / MB)
        out["activation_mb"] = out["step_peak_mb"] - out["grads_mb"]
    except (MemoryError, RuntimeError) as e:  # an allocation over the cap
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                   step_s=time.perf_counter() - t0, abs_peak_mb=_status_kib("VmHWM") / 1024)
    return out


def _one_rank(args: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from easy_context.testing import free_port

    torch.set_num_threads(2)
    if args["mode"] == "ours":  # the trainer's single code path: a one-rank group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=30))
    try:
        return measure(args["mode"], args["length"], args["kind"], args["vocab"], 1, 1.0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker(args: dict) -> dict:
    """In a fresh process: run one measurement on 1 or 2 ranks; per-rank results."""
    if args["n"] == 1:
        ranks = [_one_rank(args)]
    else:
        from easy_context.testing import DistPool

        with DistPool(args["n"], threads_per_rank=1, timeout_s=args["timeout_s"],
                      pg_timeout_s=args["timeout_s"]) as pool:
            ranks = pool.run(measure, args["mode"], args["length"], args["kind"], args["vocab"],
                             args["n"], 1.0 / args["n"], timeout_s=args["timeout_s"])
    return {"ranks": ranks}


# --------------------------------------------------------------------------- driver
def _run(spec: dict, timeout_s: float) -> dict:
    env = dict(os.environ, **BENCH_ENV)
    cmd = [sys.executable, __file__, "--worker", json.dumps({**spec, "timeout_s": timeout_s})]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        return {**spec, "ok": False, "error": f"timeout after {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-600:]
        killed = proc.returncode in (-9, 137)
        return {**spec, "ok": False, "wall_s": wall,
                "error": ("killed (out of memory?) " if killed else "") +
                         f"exit {proc.returncode}: {tail}"}
    ranks = json.loads(lines[-1][len("RESULT "):])["ranks"]
    row = {**spec, "wall_s": wall, "ranks": ranks}
    bad = [r for r in ranks if not r.get("ok")]
    if bad:
        row.update(ok=False, error=bad[0]["error"])
        return row
    row["ok"] = True
    for key in ("step_peak_mb", "abs_peak_mb", "activation_mb", "step_s"):
        row[key] = max(r[key] for r in ranks)
    row["tokens_per_s"] = spec["length"] / row["step_s"]
    row["loss"] = ranks[0]["loss"]
    for key in ("params_mb", "grads_mb", "optimizer_states_mb"):
        row[key] = ranks[0][key]
    return row


def _plan(lengths: list[int], vocab: int) -> list[dict]:
    """Every run, in the order that decides the targets first."""
    big, rest = lengths[-1], lengths[:-1]
    mid = lengths[-2] if len(lengths) > 1 else None
    runs = [("ours", big, "full", 1), ("ours", big, "full", 2), ("plain", big, "none", 1)]
    if mid:
        runs += [("ours", mid, "full", 1)]
    for L in reversed(rest):
        runs += [("ours", L, "full", 1), ("ours", L, "full", 2), ("plain", L, "none", 1)]
    for L in reversed(lengths):
        runs += [("ours", L, "attention", 1), ("ours", L, "attention", 2),
                 ("plain", L, "hf_checkpointing", 1)]
    seen, out = set(), []
    for mode, L, kind, n in runs:
        if (mode, L, kind, n) not in seen:
            seen.add((mode, L, kind, n))
            out.append(dict(mode=mode, length=L, kind=kind, n=n, vocab=vocab))
    return out


def _find(rows, mode, length, kind, n):
    for r in rows:
        if (r["mode"], r["length"], r["kind"], r["n"]) == (mode, length, kind, n) and r.get("ok"):
            return r
    return None


def _targets(rows: list[dict], lengths: list[int]) -> list[dict]:
    big = lengths[-1]
    mid = lengths[-2] if len(lengths) > 1 else None

    def check(name, text, num, den, limit, key):
        if num is None or den is None:
            missing = "numerator" if num is None else "denominator"
            return {"target": name, "text": text, "result": "NOT MEASURED",
                    "why": f"the {missing} run did not complete (see rows)"}
        ratio = num[key] / den[key]
        return {"target": name, "text": text, "ratio": round(ratio, 4), "limit": limit,
                "result": "PASS" if ratio <= limit else "FAIL"}

    out = [
        check("T1", f"ours per-rank step peak at N=2 <= 0.6 x N=1 (L={big}, full ckpt)",
              _find(rows, "ours", big, "full", 2), _find(rows, "ours", big, "full", 1), 0.6,
              "step_peak_mb"),
        check("T2", f"ours (N=1, full ckpt) <= 0.15 x plain transformers step peak (L={big})",
              _find(rows, "ours", big, "full", 1), _find(rows, "plain", big, "none", 1), 0.15,
              "step_peak_mb"),
    ]
    if mid:
        out.append(check("T3", f"ours activation at L={big} <= 2.1 x at L={mid} (N=1, full ckpt)",
                         _find(rows, "ours", big, "full", 1), _find(rows, "ours", mid, "full", 1),
                         2.1, "activation_mb"))
    # Also with the absolute peaks (runtime + weights + optimizer states included).
    for t, key in (("T1", "abs_peak_mb"), ("T2", "abs_peak_mb")):
        base = next(x for x in out if x["target"] == t)
        num = _find(rows, "ours", big, "full", 2 if t == "T1" else 1)
        den = _find(rows, "ours" if t == "T1" else "plain", big, "full" if t == "T1" else "none", 1)
        if num and den:
            base["ratio_abs_peak"] = round(num[key] / den[key], 4)
    return out


def _table(rows: list[dict]) -> str:
    head = (f"{'who':6} {'ckpt':17} {'N':>2} {'L':>6} {'step peak MB':>12} {'activ. MB':>10} "
            f"{'abs peak MB':>11} {'tok/s':>8} {'step s':>7}  note")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["mode"] != "ours", r["kind"], r["length"], r["n"])):
        if r.get("ok"):
            lines.append(f"{r['mode']:6} {r['kind']:17} {r['n']:>2} {r['length']:>6} "
                         f"{r['step_peak_mb']:>12.0f} {r['activation_mb']:>10.0f} "
                         f"{r['abs_peak_mb']:>11.0f} {r['tokens_per_s']:>8.0f} "
                         f"{r['step_s']:>7.1f}")
        else:
            lines.append(f"{r['mode']:6} {r['kind']:17} {r['n']:>2} {r['length']:>6} "
                         f"{'-':>12} {'-':>10} {'-':>11} {'-':>8} {'-':>7}  "
                         f"{(r.get('error') or '')[:90]!s}".replace("\n", " "))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="start no run after this many seconds (default 600)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(spec)), flush=True)
        return 0

    import torch

    lengths = sorted(int(x) for x in args.lengths.split(","))
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    rows = []
    for spec in _plan(lengths, args.vocab):
        left = args.budget_s - (time.perf_counter() - started)
        if left <= 5:
            rows.append({**spec, "ok": False, "error": "skipped: time budget spent"})
            continue
        row = _run(spec, timeout_s=left)
        row["load_average_1min_after"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        state = (f"{row['step_peak_mb']:.0f} MB step peak, {row['abs_peak_mb']:.0f} MB abs, "
                 f"{row['tokens_per_s']:.0f} tok/s" if row.get("ok") else row.get("error", "")[:200])
        print(f"[{time.perf_counter() - started:6.0f} s] {spec['mode']} {spec['kind']} "
              f"N={spec['n']} L={spec['length']}: {state}", flush=True)
    targets = _targets(rows, lengths)
    print()
    print(_table(rows))
    print()
    for t in targets:
        extra = (f"ratio {t['ratio']} (limit {t['limit']})" if "ratio" in t else t["why"])
        if "ratio_abs_peak" in t:
            extra += f"; with absolute peaks {t['ratio_abs_peak']}"
        print(f"{t['target']} {t['result']:12} {t['text']}: {extra}")
    payload = {
        "benchmark": "train_memory",
        "command": "python benchmarks/train_memory.py " + " ".join(argv or sys.argv[1:]),
        "model": {**MODEL, "vocab_size": args.vocab, "family": "llama", "dtype": "float32",
                  "autocast": None},
        "definitions": {
            "step_peak_mb": "RSS high-water mark during one step (forward, backward, AdamW step) "
                            "minus RSS at its start; weights and AdamW states exist before",
            "abs_peak_mb": "absolute RSS high-water mark of the process (VmHWM)",
            "activation_mb": "step_peak_mb - fp32 gradient bytes = step peak minus "
                             "(params + grads + optimizer states)",
            "per_rank": "N=2: the larger of the two ranks",
            "tokens_per_s": "L / wall time of the step (slowest rank); one step, no warm-up",
            "ours": "zigzag_ring_attn over N ranks (N=1: 2 threads, N=2: 1 thread each), "
                    "per-layer activation checkpointing (kind), CausalLMLoss chunked "
                    "(4096-token chunks), AdamW; parameters replicated (no FSDP)",
            "plain": "transformers sdpa, model(input_ids, labels=...) full logits, AdamW, one "
                     "process with 2 threads; kind none or hf_checkpointing",
        },
        "machine": {**common.machine_info(),  # the commit and CPU, as every results file
                    "cpus": os.cpu_count(), "mem_total_gib": round(common.meminfo_bytes("MemTotal") / 2**30, 1),
                    "torch": torch.__version__, "load_average_before": load_before,
                    "load_average_after": [round(x, 2) for x in os.getloadavg()],
                    "note": "a shared 2-core machine, heavily loaded by other jobs: times are "
                            "slow and noisy; memory is per process and not affected"},
        "budget_s": args.budget_s,
        "total_s": round(time.perf_counter() - started, 1),
        "rows": rows,
        "targets": targets,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
