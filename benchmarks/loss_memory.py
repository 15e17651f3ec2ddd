"""Peak memory and time of the LM loss (forward + backward): chunked vs the full-logits path.

Setting, as in a bf16 training step: hidden states (T, H) and lm_head weight (V, H) in bf16,
T = 32768 tokens, V = 32000 (Llama-2 vocabulary), H = 2048; softmax and loss in fp32.
  logits path:  logits = h @ W.T (bf16, T x V), then fp32 cross-entropy, as transformers does
  chunked path: easy_context.memory.chunked_cross_entropy (never builds T x V)
Each path runs in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536, so freed big blocks go
back to the OS and the resident-set high-water mark (PeakMemory) measures this path alone. The
peak is taken above the memory held once the inputs exist; it includes the gradients of h and W.
The subprocess caps its address space at what the machine has free, so an oversized run fails
with an allocation error instead of waking the OOM killer.

    python benchmarks/loss_memory.py                  # 32K x 32K, writes results/loss_memory.json
    python benchmarks/loss_memory.py --tokens 4096    # a quick look
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

# the modules whose change makes these results stale
MEASURES = ["easy_context/memory/loss.py", "easy_context/memory/peak.py"]
RESULTS = Path(__file__).resolve().parent / "results" / "loss_memory.json"
TARGET_RATIO = 0.1






def worker(mode: str, tokens: int, vocab: int, hidden: int, chunk_size: int) -> dict:
    import torch

    from easy_context.memory import chunked_cross_entropy, logits_cross_entropy
    from easy_context.memory.peak import PeakMemory

    torch.manual_seed(0)
    dtype = torch.bfloat16
    h = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    y[: tokens // 10] = -100  # some ignored targets, as with prompt masking
    common.cap_address_space()
    t0 = time.perf_counter()
    with PeakMemory("cpu") as pm:
        if mode == "logits":
            loss = logits_cross_entropy(h @ w.T, y)
        else:
            loss = chunked_cross_entropy(h, w, y, chunk_size=chunk_size)
        loss.backward()
    seconds = time.perf_counter() - t0
    return {"peak_mb": pm.peak_bytes / 2**20, "time_s": seconds, "loss": loss.item(),
            "threads": torch.get_num_threads()}


def run_in_subprocess(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--worker", mode, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--chunk-size", str(args.chunk_size)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--worker", choices=["logits", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default: results/loss_memory.json at 32K x 32K)")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.vocab, args.hidden,
                                args.chunk_size)))
        return

    import torch

    load_before = os.getloadavg()
    runs = {mode: run_in_subprocess(mode, args) for mode in ("chunked", "logits")}
    ratio = runs["chunked"]["peak_mb"] / runs["logits"]["peak_mb"]
    result = {
        "what": "peak resident memory above the inputs and time, loss forward + backward",
        "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
        "dtype": "bfloat16 inputs, fp32 softmax/loss", "chunk_size": args.chunk_size,
        "logits_bytes_fp32_mb": args.tokens * args.vocab * 4 / 2**20,
        "chunked": runs["chunked"], "logits": runs["logits"],
        "memory_ratio_chunked_over_logits": ratio,
        "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
        "loss_rel_diff": abs(runs["chunked"]["loss"] - runs["logits"]["loss"])
                         / abs(runs["logits"]["loss"]),
        "device": "cpu", "torch": torch.__version__, "cpus": os.cpu_count(),
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "machine": common.machine_info(),
    }
    for mode in ("chunked", "logits"):
        r = runs[mode]
        print(f"{mode:8s} peak {r['peak_mb']:9.1f} MB   {r['time_s']:7.1f} s/step   "
              f"loss {r['loss']:.6f}")
    print(f"ratio chunked/logits = {ratio:.4f} (target <= {TARGET_RATIO})")
    out = args.out
    if out is None and (args.tokens, args.vocab) == (32768, 32000):
        out = RESULTS
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
