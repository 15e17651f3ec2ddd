"""prepare-data throughput against a plain datasets.map + itertools packing baseline.

Both start from the same generated jsonl corpus and end with a packed dataset saved to disk
(load -> tokenize with num_proc workers -> pack into seq_length+1 windows -> save_to_disk),
each with a fresh datasets cache so neither reuses the other's (or a previous run's) work.
The baseline is what a training script typically does: map the tokenizer, chain the token
lists with itertools, cut windows; it keeps no position_ids/document_ids and no stats.

    python benchmarks/prepare_data.py                      # 50M characters, 2 workers
    python benchmarks/prepare_data.py --chars 5e6          # quick run

Also runs ours with --streaming (no Arrow copy of the raw corpus). The variants run in turn,
``--repeats`` times, in a rotated order each repeat, and the ratio is taken between medians:
on a shared machine a single run of each, one after the other, measures the neighbours'
load as much as the code. Every run checks that ours packs exactly the baseline's ids.

Writes benchmarks/results/prepare_data.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks import common  # noqa: E402
from easy_context.data import (PrepareConfig, SyntheticConfig, generate, prepare_data,  # noqa: E402
                               train_bpe_tokenizer)
from easy_context.data.synthetic import generate_texts  # noqa: E402

# the modules whose change makes these results stale: prepare-data's pipeline (sources,
# tokenizing, packing, checks; the corpus generator and the BPE tokenizer it trains)
MEASURES = ["easy_context/data", "easy_context/utils/progress.py"]


def write_corpus(path: Path, total_chars: int, doc_chars: int, seed: int) -> tuple[int, int]:
    """jsonl of synthetic documents of varied length until ``total_chars``; (docs, chars)."""
    rng = np.random.default_rng(seed)
    n_docs = chars = 0
    with path.open("w") as f:
        while chars < total_chars:
            # Log-uniform lengths from doc_chars/16 to doc_chars: many short, some long.
            length = int(doc_chars * 2 ** rng.uniform(-4, 0))
            (rec,) = generate(SyntheticConfig(kind="mix", num_docs=1, length=length,
                                              seed=seed * 10**7 + n_docs))
            f.write(json.dumps({"text": rec["text"]}) + "\n")
            chars += len(rec["text"])
            n_docs += 1
    return n_docs, chars


def fresh_cache(root: Path, name: str) -> None:
    cache = root / f"cache_{name}"
    cache.mkdir()
    datasets.config.HF_DATASETS_CACHE = cache  # read at each load_dataset call


def run_ours(corpus: Path, tok_dir: Path, out: Path, seq_length: int, num_proc: int,
             streaming: bool = False) -> dict:
    t0 = time.perf_counter()
    stats = prepare_data(PrepareConfig(inputs=[str(corpus)], tokenizer=str(tok_dir), output=str(out),
                                       seq_length=seq_length, num_proc=num_proc, shuffle=False,
                                       streaming=streaming))
    return {"seconds": time.perf_counter() - t0, "tokens": stats["tokens"], "windows": stats["windows"]}


def run_baseline(corpus: Path, tok_dir: Path, out: Path, seq_length: int, num_proc: int) -> dict:
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train")

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[bos] + x + [eos] for x in ids]}

    ds = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])
    n_tokens = 0

    def windows():
        nonlocal n_tokens
        stream = itertools.chain.from_iterable(ds["input_ids"])
        while True:
            w = list(itertools.islice(stream, seq_length + 1))
            n_tokens += len(w)
            if len(w) < seq_length + 1:
                return
            yield {"input_ids": w}

    packed = datasets.Dataset.from_generator(windows)
    packed.save_to_disk(str(out))
    return {"seconds": time.perf_counter() - t0, "tokens": n_tokens, "windows": len(packed)}


def packed_ids(out: Path) -> np.ndarray:
    """All input_ids of a saved packed dataset, in row order, as one flat array."""
    return datasets.load_from_disk(str(out)).with_format("numpy")[:]["input_ids"].ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=float, default=50e6, help="corpus size in characters")
    parser.add_argument("--doc-chars", type=int, default=200_000, help="longest document")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (median)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "prepare_data.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    datasets.disable_progress_bars()

    root = Path(tempfile.mkdtemp(prefix="ec_bench_prepare_"))
    try:
        t0 = time.perf_counter()
        corpus = root / "corpus.jsonl"
        n_docs, n_chars = write_corpus(corpus, int(args.chars), args.doc_chars, seed=0)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_bpe_tokenizer(generate_texts(400, 10_000, seed=1), args.vocab_size, root / "tok")
        t_tok = time.perf_counter() - t0
        print(f"corpus: {n_docs} docs, {n_chars / 1e6:.1f}M chars ({t_gen:.1f} s); "
              f"tokenizer {args.vocab_size} ({t_tok:.1f} s)")
        load_before = os.getloadavg()

        variants = {"baseline": run_baseline, "ours": run_ours,
                    "ours_streaming": functools.partial(run_ours, streaming=True)}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        names = list(variants)
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                tag = f"{name}_{rep}"
                fresh_cache(root, tag)
                load = os.getloadavg()[0]
                r = variants[name](corpus, root / "tok", root / f"out_{tag}", args.seq_length,
                                   args.num_proc)
                r["tokens_per_s"] = r["tokens"] / r["seconds"]
                r["load_1min_before"] = load
                runs[name].append(r)
                print(f"{tag:16s} {r['seconds']:7.1f} s  {r['tokens'] / 1e6:6.2f}M tokens  "
                      f"{r['tokens_per_s'] / 1e6:5.2f}M tokens/s  {r['windows']} windows  "
                      f"(load {load:.1f})", flush=True)
            # Same output: ours (unshuffled) holds exactly the baseline's windows, in order.
            base = packed_ids(root / f"out_baseline_{rep}")
            for name in ("ours", "ours_streaming"):
                if not np.array_equal(packed_ids(root / f"out_{name}_{rep}"), base):
                    raise SystemExit(f"{name} packed different ids from the baseline")
            for name in names:
                shutil.rmtree(root / f"out_{name}_{rep}")
                shutil.rmtree(root / f"cache_{name}_{rep}")
        results = {name: {"median_seconds": float(np.median([r["seconds"] for r in rs])),
                          "median_tokens_per_s": float(np.median([r["tokens_per_s"] for r in rs])),
                          "tokens": rs[0]["tokens"], "windows": rs[0]["windows"], "runs": rs}
                   for name, rs in runs.items()}
        base_tps = results["baseline"]["median_tokens_per_s"]
        ratio = results["ours"]["median_tokens_per_s"] / base_tps
        ratio_streaming = results["ours_streaming"]["median_tokens_per_s"] / base_tps
        # Each repeat's own ratio compares runs made minutes apart, under similar load.
        paired = {name: [o["tokens_per_s"] / b["tokens_per_s"]
                         for o, b in zip(runs[name], runs["baseline"])]
                  for name in ("ours", "ours_streaming")}
        print(f"ours / baseline throughput (medians of {args.repeats}): {ratio:.2f}x "
              f"(streaming: {ratio_streaming:.2f}x); per repeat: "
              f"{', '.join(f'{r:.2f}x' for r in paired['ours'])}; packed ids identical")

        report = {
            "benchmark": "prepare_data",
            "command": "python benchmarks/prepare_data.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
            "corpus": {"documents": n_docs, "characters": n_chars, "kind": "synthetic mix (jsonl)"},
            "seq_length": args.seq_length,
            "num_proc": args.num_proc,
            "vocab_size": args.vocab_size,
            "results": results,
            "repeats": args.repeats,
            "ratio_ours_over_baseline": ratio,
            "ratio_ours_streaming_over_baseline": ratio_streaming,
            "ratio_per_repeat": paired,
            "median_ratio_per_repeat": {k: float(np.median(v)) for k, v in paired.items()},
            "same_packed_ids": True,
            "notes": "wall time from jsonl to a saved packed dataset, fresh datasets cache each; "
                     "ours also writes position_ids and document_ids and stats.json; medians "
                     "over repeats run in rotated order",
            # The machine may be shared: a load average well above the core count means the
            # figures are depressed and noisy.
            "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
            "machine": {**common.machine_info(),  # the commit and CPU, as every results file
                        "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "datasets": datasets.__version__},
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
