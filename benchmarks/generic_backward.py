"""Max-length mode's generic layer: split at its attention call, in tiles, against whole.

The generic path (easy_context/memory/generic_layer.py) runs a layer's own forward again in
backward. Split at the attention call and run in tiles (easy_context/memory/tiled_backward.py,
its forward too) it holds the whole sequence's attention output and its gradient, and q, k, v
(turning into their gradients) with one head chunk's backward; run over the whole sequence
at once, every intermediate of the layer. This runs one max-length training step
(forward and backward, loss in chunks of 128 tokens) of a tiny model of
benchmarks/trainer_runs.py in one process, each way in its own process at the same time
(side by side: the machine is noisy), and reports each process's resident high-water mark
above its memory when the step starts, the step time, and that the loss and the sum of
|gradients| are the same.

    python benchmarks/generic_backward.py                      # gemma3-tiny, 8K tokens
    python benchmarks/generic_backward.py --shape deepseek3-tiny --length 8192
    python benchmarks/generic_backward.py --shape llama3-tiny --with-fused   # + the fused layer

``--with-fused`` adds a third process: the same step on the fused layer
(easy_context/memory/fused_layer.py, for layers it verifies: Llama's), what the issue asks the
generic path to be weighed against; the other two then run the generic path on those layers.

The vocabulary is cut to 1,000 (``--vocab``) so that the step's peak is the layers' and not the
loss's 32,000-wide logits chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

MEASURES = ["easy_context/memory", "easy_context/attention", "easy_context/parallel",
            "easy_context/integrations", "easy_context/sequence_parallel.py"]
MB = 2**20
WAYS = ("whole", "tiles", "fused")


def step(shape: str, length: int, way: str, vocab: int, tile: int, chunk: int) -> dict:
    """One step in this process (the child's side)."""
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import easy_context as ec
    from benchmarks.trainer_runs import MODELS, SHAPE
    from easy_context.memory import generic_layer
    from easy_context.memory.maxlen import apply_max_length
    from easy_context.memory.peak import PeakMemory

    spec = dict(MODELS[shape])
    family = spec.pop("family")
    config = AutoConfig.for_model(family, **{**SHAPE, **spec, "vocab_size": vocab})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    ec.apply_sequence_parallel(model, "local")
    apply_max_length(model, tile, chunk, "full", path="auto" if way == "fused" else "generic")
    if way == "whole":  # no layer runs split at its attention call: forward nor backward
        generic_layer._splits = lambda *args, **kwargs: None
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(length)[None]
    warm = slice(0, min(256, length))  # the first call's one-off allocations
    ec.causal_lm_loss(model, ids[:, warm], pos[:, warm], ids[:, warm], chunked=True,
                      chunk_size=128).backward()
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    with PeakMemory("cpu") as peak:  # the resident high-water mark, reset at the start
        loss = ec.causal_lm_loss(model, ids, pos, ids, chunked=True, chunk_size=128)
        loss.backward()
    seconds = time.perf_counter() - t
    total = sum(float(p.grad.double().abs().sum()) for p in model.parameters()
                if p.grad is not None)
    return {"way": way, "peak_above_start_mb": peak.peak_bytes / MB,
            "step_s": seconds, "loss": loss.item(), "grad_abs_sum": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gemma3-tiny")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--tile", type=int, default=1024)
    ap.add_argument("--head-chunk", type=int, default=4)
    ap.add_argument("--with-fused", action="store_true")
    ap.add_argument("--output", default=str(common.RESULTS_DIR / "generic_backward.json"))
    ap.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        row = step(args.shape, args.length, args.child, args.vocab, args.tile, args.head_chunk)
        print("RESULT " + json.dumps(row))
        return 0
    load_before = common.load_average()
    cmd = [sys.executable, __file__, "--shape", args.shape, "--length", str(args.length),
           "--vocab", str(args.vocab), "--tile", str(args.tile),
           "--head-chunk", str(args.head_chunk)]
    env = common.bench_env({**os.environ, "OMP_NUM_THREADS": "1"})
    ways = WAYS if args.with_fused else WAYS[:2]
    procs = {w: subprocess.Popen(cmd + ["--child", w], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for w in ways}
    rows = []
    for way, p in procs.items():
        out, err = p.communicate()
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"{way}: FAILED\n{err[-2000:]}")
            return 1
        rows.append(json.loads(line[-1][len("RESULT "):]))
    by = {r["way"]: r for r in rows}
    same = all(abs(r["loss"] - by["whole"]["loss"]) <= 1e-6 * abs(by["whole"]["loss"]) and
               abs(r["grad_abs_sum"] - by["whole"]["grad_abs_sum"])
               <= 1e-5 * by["whole"]["grad_abs_sum"] for r in rows)
    result = {"benchmark": "generic_backward", "shape": args.shape, "length": args.length,
              "vocab": args.vocab, "mlp_tile": args.tile, "heads_per_chunk": args.head_chunk,
              "rows": rows, "same_loss_and_grad_sum": same,
              "peak_ratio_tiles_to_whole": by["tiles"]["peak_above_start_mb"]
              / by["whole"]["peak_above_start_mb"],
              **({"peak_ratio_tiles_to_fused": by["tiles"]["peak_above_start_mb"]
                  / by["fused"]["peak_above_start_mb"],
                  "time_ratio_tiles_to_fused": by["tiles"]["step_s"] / by["fused"]["step_s"]}
                 if "fused" in by else {}),
              "command": "python benchmarks/generic_backward.py " + " ".join(argv or sys.argv[1:]),
              "machine": common.machine_info(), "load_average_before": load_before,
              "load_average_after": common.load_average(), "date": common.now_iso()}
    for r in rows:
        print(f"{r['way']:6s}: peak {r['peak_above_start_mb']:.0f} MB above the step's start, "
              f"step {r['step_s']:.1f} s, loss {r['loss']:.6f}")
    print(f"tiles / whole peak: {result['peak_ratio_tiles_to_whole']:.2f}; same loss and "
          f"gradient sum: {same}")
    if "fused" in by:
        print(f"tiles / fused: peak {result['peak_ratio_tiles_to_fused']:.2f}, time "
              f"{result['time_ratio_tiles_to_fused']:.2f}")
    print(f"wrote {common.write_results(args.output, result)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
