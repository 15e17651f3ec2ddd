"""The chunked loss at a 128K vocabulary: what each chunk costs beyond its matmuls.

The loss (easy_context.memory.loss.chunked_cross_entropy, forward + backward) at Llama-3's
vocabulary (128,256), with the hidden size reduced so that it runs on a CPU in seconds: every
chunk re-reads the (V, H) head in its GEMMs and adds its (V, H) share to the head gradient,
so the per-chunk overhead is what grows with the number of chunks. Contenders, in rotating
order within each round (the machine is noisy; ratios are taken within a round):

  rows-130-product   the old GPU default (64 MiB of fp32 logits: 130 rows at this
                     vocabulary), each chunk's head gradient formed as a (V, H) product and
                     then added, as before add_matmul_
  rows-2048-product  the new GPU chunk (2,048 rows), products as before
  rows-2048-gemm     the new GPU chunk, accumulated inside the GEMM (add_matmul_: addmm_ in
                     fp32), what the package runs now

fp32 here (the CPU has no bf16 -> fp32 accumulating GEMM; on a GPU the bf16 path goes through
addmm's out_dtype where it runs). The loss and gradients of every contender are checked
against the first (relative 1e-6).

    python benchmarks/loss_chunks.py                  # writes results/loss_chunks.json
    python benchmarks/loss_chunks.py --tokens 2048 --rounds 1 --output /tmp/x.json   # a look
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale
MEASURES = ["easy_context/memory/loss.py"]
CONTENDERS = {"rows-130-product": (130, False), "rows-2048-product": (2048, False),
              "rows-2048-gemm": (2048, True)}


def _product_then_add(acc, a, b):
    """The head-gradient accumulation before add_matmul_: a (V, H) product, then added."""
    return acc.add_(a @ b)


def one_step(h, w, y, rows: int, in_gemm: bool) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seconds, loss, grad h, grad w) of one forward + backward."""
    from easy_context.memory import loss as L

    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    original = L.add_matmul_
    if not in_gemm:
        L.add_matmul_ = _product_then_add
    try:
        t0 = time.perf_counter()
        loss = L.chunked_cross_entropy(h, w, y, chunk_size=rows)
        loss.backward()
        seconds = time.perf_counter() - t0
    finally:
        L.add_matmul_ = original
    return seconds, loss.detach(), h.grad, w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default="loss_chunks")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=g)
    w = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    y[: args.tokens // 10] = -100
    names = list(CONTENDERS)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, float] = {}
    one_step(h, w, y, 2048, True)  # warm-up: allocator, threads
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for name in order:
            seconds, *outs = one_step(h, w, y, *CONTENDERS[name])
            times[name].append(seconds)
            got[name] = outs
        ref = got[names[0]]
        for name in names:
            errors[name] = max(errors.get(name, 0.0),
                               *(_rel(a, b) for a, b in zip(got[name], ref)))
            ratios[name].append(times[name][-1] / times[names[0]][-1])
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names),
              flush=True)
    rows = []
    for name in names:
        rows.append({"contender": name, "chunk_rows": CONTENDERS[name][0],
                     "accumulated_in_gemm": CONTENDERS[name][1],
                     "chunks": -(-args.tokens // CONTENDERS[name][0]),
                     "time_s": common.spread(times[name]),
                     "time_ratio_to_rows_130_product": common.spread(ratios[name]),
                     "max_rel_error_to_rows_130_product": errors[name]})
    table = common.fmt_table(
        ["contender", "chunks", "median s", "ratio to 130-row products (min-max)", "rel. error"],
        [[r["contender"], r["chunks"], f"{r['time_s']['median']:.3f}",
          f"{r['time_ratio_to_rows_130_product']['median']:.3f} "
          f"({r['time_ratio_to_rows_130_product']['min']:.3f}-"
          f"{r['time_ratio_to_rows_130_product']['max']:.3f})",
          f"{r['max_rel_error_to_rows_130_product']:.1e}"] for r in rows])
    print(table)
    payload = {"what": __doc__.splitlines()[0], "tokens": args.tokens, "vocab": args.vocab,
               "hidden": args.hidden, "dtype": "float32", "rounds": args.rounds,
               "threads": torch.get_num_threads(), "rows": rows,
               "machine": common.machine_info(), "finished": common.now_iso()}
    print(f"wrote {common.write_results(common.results_path(args.output), payload)}")


if __name__ == "__main__":
    main()
