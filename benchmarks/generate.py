"""Sequence-parallel generation against transformers' generate in one process.

Side by side in one run, round-robin (each round runs every contender once at each length;
the first round is dropped; medians with min-max): easy_context.generate on 2 gloo ranks
(one thread each; zigzag ring prefill, the KV cache split over the ranks) against
transformers' greedy ``generate`` on one process with two threads (the same two cores; sdpa,
a DynamicCache). Per contender and length: prefill seconds, decode seconds per new token,
and the KV cache's bytes (ours: the larger rank's; theirs: the DynamicCache's tensors). Both
generate the same tokens (checked and recorded). The model: the tiny Llama with Llama-3-8B's
proportions that benchmarks/hf_trainer.py trains (4 layers, 8 heads, 2 KV heads), fp32.

    python benchmarks/generate.py                       # 16K and 32K, 32 new tokens, 2 rounds
Results: benchmarks/results/generate.json (and a Markdown table: generate.md).
Targets (issue 26): cache per rank <= 0.55x one process's at N=2; decode time per token at
32K within 1.5x of one process's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
             attention_dropout=0.0, tie_word_embeddings=False)
# The modules whose code this benchmark measures (a results file older than their last
# change is stale).
MEASURES = ["easy_context/generation", "easy_context/parallel", "easy_context/attention",
            "easy_context/integrations/hf.py"]
MB = 2**20


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **MODEL)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


def _prompt(length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    return torch.randint(3, MODEL["vocab_size"], (1, length), generator=g)


def ours(length: int, new_tokens: int, method: str) -> dict:
    """On each rank: one sequence-parallel generation."""
    import torch.distributed as dist

    import easy_context as ec

    model = _model()
    ec.apply_sequence_parallel(model, method)
    ids = _prompt(length)
    dist.barrier()
    r = ec.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], return_stats=True)
    return {"prefill_s": r.prefill_seconds, "decode_s_per_token": r.decode_seconds
            / max(r.new_tokens - 1, 1), "cache_bytes": r.cache_bytes,
            "tokens": r.sequences[0, length:].tolist()}


class _StepClock:
    """A stopping criterion that never stops: transformers calls it once per new token,
    right after choosing it, so the first call ends the prefill and the gaps between calls
    are the decode steps (timing one generate, not the difference of two noisy ones)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)


def transformers_generate(length: int, new_tokens: int) -> dict:
    """One process: transformers' greedy generate with a DynamicCache, each step timed."""
    from transformers import StoppingCriteriaList

    model = _model()
    ids = _prompt(length)
    clock = _StepClock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True,
                             stopping_criteria=StoppingCriteriaList([clock]))
    cache = getattr(out, "cache", None) or out.past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return {"prefill_s": clock.times[0] - start,
            "decode_s_per_token": (clock.times[-1] - clock.times[0]) / max(new_tokens - 1, 1),
            "cache_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "tokens": out.sequences[0, length:].tolist()}


def _summary(runs: list[dict], key: str) -> dict:
    return {key: round(common.median(r[key] for r in runs), 4),
            f"{key}_min": round(min(r[key] for r in runs), 4),
            f"{key}_max": round(max(r[key] for r in runs), 4)}


def table(payload: dict) -> str:
    rows = []
    for r in payload["measured"]:
        rows.append([r["system"], r["length"], f"{r['prefill_s']:.2f} ({r['prefill_s_min']:.2f}-"
                     f"{r['prefill_s_max']:.2f})",
                     f"{1000 * r['decode_s_per_token']:.1f} ({1000 * r['decode_s_per_token_min']:.1f}-"
                     f"{1000 * r['decode_s_per_token_max']:.1f})",
                     f"{r['cache_bytes'] / MB:.1f}", r.get("cache_ratio", ""),
                     r.get("decode_ratio", "")])
    m = payload["machine"]
    return (common.fmt_table(["system", "L", "prefill s", "decode ms/token", "cache MB/rank",
                              "cache vs one process", "decode vs one process"], rows,
                             markdown=True)
            + f"\n\n{m['cpu_description']}; {payload['world']} gloo ranks x 1 thread against one "
              f"process x 2 threads, fp32, {payload['new_tokens']} new tokens, commit "
              f"{m['git_commit']}, {payload['date'][:10]}; median of {payload['rounds']} rounds "
              "after a dropped first one (min-max); tokens equal: "
              f"{payload['tokens_equal']}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--method", default="zigzag_ring_attn")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds (one more is dropped)")
    p.add_argument("--output", default="generate")
    args = p.parse_args(argv)
    common.setup_env()
    from easy_context.testing import DistPool

    start = time.time()
    runs = {("ours", n): [] for n in args.lengths} | {("transformers", n): [] for n in args.lengths}
    tokens_equal = True
    pools = {"ours": DistPool(2, threads_per_rank=1, timeout_s=3600),
             "transformers": DistPool(1, threads_per_rank=2, timeout_s=3600)}
    try:
        for rnd in range(args.rounds + 1):
            for n in args.lengths:
                theirs = pools["transformers"].run(transformers_generate, n, args.new_tokens)[0]
                mine = pools["ours"].run(ours, n, args.new_tokens, args.method)
                tokens_equal &= all(r["tokens"] == theirs["tokens"] for r in mine)
                worst = {"prefill_s": max(r["prefill_s"] for r in mine),
                         "decode_s_per_token": max(r["decode_s_per_token"] for r in mine),
                         "cache_bytes": max(r["cache_bytes"] for r in mine)}
                if rnd:  # the first round warms both up and is dropped
                    runs[("transformers", n)].append(theirs)
                    runs[("ours", n)].append(worst)
                print(f"[{time.time() - start:5.0f}s] round {rnd} L={n}: ours prefill "
                      f"{worst['prefill_s']:.2f}s decode {1000 * worst['decode_s_per_token']:.1f}"
                      f" ms/token; transformers {theirs['prefill_s']:.2f}s "
                      f"{1000 * theirs['decode_s_per_token']:.1f} ms/token", file=sys.stderr,
                      flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    measured = []
    for (system, n), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "ours")):
        row = {"system": "ours-2-ranks" if system == "ours" else "transformers-1-process",
               "length": n, **_summary(rs, "prefill_s"), **_summary(rs, "decode_s_per_token"),
               "cache_bytes": max(r["cache_bytes"] for r in rs), "rounds": len(rs)}
        measured.append(row)
    by = {(r["system"], r["length"]): r for r in measured}
    targets = []
    for n in args.lengths:
        o, t = by[("ours-2-ranks", n)], by[("transformers-1-process", n)]
        o["cache_ratio"] = round(o["cache_bytes"] / t["cache_bytes"], 3)
        o["decode_ratio"] = round(o["decode_s_per_token"] / t["decode_s_per_token"], 3)
        o["prefill_ratio"] = round(o["prefill_s"] / t["prefill_s"], 3)
        targets.append({"target": f"cache per rank <= 0.55x one process at L={n}",
                        "ratio": o["cache_ratio"],
                        "result": "PASS" if o["cache_ratio"] <= 0.55 else "FAIL"})
        if n == max(args.lengths):
            targets.append({"target": f"decode per token <= 1.5x one process at L={n}",
                            "ratio": o["decode_ratio"],
                            "result": "PASS" if o["decode_ratio"] <= 1.5 else "FAIL"})
    payload = {"benchmark": "generate", "command": "python benchmarks/generate.py "
               + " ".join(sys.argv[1:] if argv is None else argv), "model": MODEL,
               "method": args.method, "world": 2, "new_tokens": args.new_tokens,
               "rounds": args.rounds, "measures": MEASURES, "measured": measured,
               "targets": targets, "tokens_equal": tokens_equal,
               "machine": common.machine_info(), "date": common.now_iso(),
               "total_s": round(time.time() - start, 1)}
    path = common.write_results(args.output, payload)
    md = common.results_path(args.output).with_suffix(".md")
    md.write_text(table(payload))
    print(table(payload))
    for t in targets:
        print(f"{t['result']}: {t['target']} ({t['ratio']})")
    print(f"wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    common.ensure_env()
    sys.exit(main())
