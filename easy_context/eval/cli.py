"""Argparse entry points of the eval commands; ``easy_context/cli.py`` mounts them as

    easy-context eval-needle --model DIR [--haystack-dir DIR] --max-context-length N ...
    easy-context eval-ppl    --model DIR [--model DIR2] (--tokenized DIR | --dataset SRC) ...
    easy-context eval-ruler  --model DIR [--tasks niah_single_1 vt ...] --lengths 4096 8192 ...
    easy-context plot-ppl    FILE.csv [FILE2.csv] (--output FILE.png | --output-dir DIR)

The evals run in one process, under torchrun, or spawn ``--nproc-per-node`` ranks
themselves (easy_context.launch); every rank loads the model and holds a shard of each
sequence. Rank 0 writes the results (JSON/CSV) and then draws the figures from those files.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from ..parallel import get_method
from ..launch import device as rank_device
from ..launch import launch
from ..utils.paths import check_output_path, model_name

logger = logging.getLogger(__name__)


def _add_common(parser: argparse.ArgumentParser) -> None:
    from ..generation.cli import add_model_run_flags

    add_model_run_flags(parser)


def _setup(args: argparse.Namespace, path: str, tokenizer: bool = True):
    """On this rank: device, model (sequence-parallel unless generating), tokenizer (None with
    ``tokenizer=False``) and the sequence-parallel group (every rank: one sequence at a time)."""
    from ..integrations.hf import apply_sequence_parallel
    from ..mesh import build_mesh
    from ..models import load_model_and_tokenizer

    dev = rank_device()
    model, tok = load_model_and_tokenizer(path, device=dev, dtype=args.dtype,
                                          rope_theta=args.rope_theta,
                                          rope_scaling=args.rope_scaling,
                                          trust_remote_code=args.trust_remote_code,
                                          tokenizer=tokenizer)
    if tok is not None:
        tok.model_max_length = 1 << 40  # long prompts are the point; silence length warnings
    group = None
    if not getattr(args, "generate", False):
        world = dist.get_world_size() if dist.is_initialized() else 1
        group = build_mesh(world, args.ring_degree, dev.type).sp
        apply_sequence_parallel(model, args.method, group=group, ring_degree=args.ring_degree)
    return dev, model, tok, group


def _check_common(args: argparse.Namespace, models: list[str], tokenizer: bool) -> None:
    """The flags every eval has, and the model folders (weights, a tokenizer when the eval
    needs one, heads the method can split), checked before any rank starts."""
    from ..models import check_model_path, has_tokenizer, model_heads, parse_rope_scaling

    method = get_method(args.parallel_mode)
    args.method = method.name
    world = args.nproc_per_node
    if world < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {world}")
    if args.method == "local" and world > 1:
        raise ValueError("--parallel-mode data_parallel evaluates in one process; use a "
                         "sequence-parallel method with --nproc-per-node > 1")
    if args.rope_theta is not None and not args.rope_theta > 0:
        raise ValueError(f"--rope-theta must be > 0, got {args.rope_theta}")
    parse_rope_scaling(args.rope_scaling)
    method.check(None, None, world, args.ring_degree)  # before the models: flags first
    for path in models:
        check_model_path(path, weights=True)
        if tokenizer and has_tokenizer(path) is False:
            raise FileNotFoundError(f"model folder {path} has no tokenizer (tokenizer.json); "
                                    "this eval turns text into tokens: save the model's "
                                    "tokenizer there (tokenizer.save_pretrained)")
        method.check(*model_heads(path), world, args.ring_degree)


def _is_main() -> bool:
    # Under torchrun the process group is gone once launch() returns; RANK still says who we are.
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


# ---------------------------------------------------------------- eval-needle


def add_eval_needle_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context eval-needle`` (the original's, plus launching and RoPE)."""
    parser.add_argument("--model", required=True, help="model folder (save_pretrained)")
    parser.add_argument("--max-context-length", type=int, default=32000)
    parser.add_argument("--min-context-length", type=int, default=1000)
    parser.add_argument("--context-interval", type=int, default=1000)
    parser.add_argument("--depth-interval", type=float, default=0.1,
                        help="depth step as a fraction: 0.1 gives 0%%, 10%%, ..., 100%%")
    parser.add_argument("--num-samples", type=int, default=2, help="numbers asked per cell")
    parser.add_argument("--rnd-number-digits", type=int, default=7)
    parser.add_argument("--haystack-dir", default=None,
                        help="folder of .txt files; default: a generated haystack")
    parser.add_argument("--no-repeat-haystack", action="store_true",
                        help="fail instead of repeating a haystack folder shorter than the "
                             "longest context")
    parser.add_argument("--num-distractor", type=int, default=0,
                        help="needles with other keys (multi-key variant)")
    parser.add_argument("--num-values", type=int, default=1,
                        help="values for the queried key; the answer lists all (multi-value)")
    parser.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                        help="prepend BOS (default: when the tokenizer has one)")
    parser.add_argument("--generate", action="store_true",
                        help="score by greedy generation in one process instead of one "
                             "teacher-forced sequence-parallel forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None,
                        help="where results.json and heatmap.png go (default: "
                             "needle_output/<model folder name>)")
    _add_common(parser)


def _needle_rank(args: argparse.Namespace) -> dict:
    from .needle import NeedleConfig, build_haystack, evaluate_needle

    cfg = NeedleConfig(args.min_context_length, args.max_context_length, args.context_interval,
                       args.depth_interval, args.num_samples, args.rnd_number_digits,
                       args.num_distractor, args.num_values, args.seed, args.add_bos)
    dev, model, tok, group = _setup(args, args.model)
    hay = build_haystack(tok, args.max_context_length, args.haystack_dir,
                         repeat=not args.no_repeat_haystack, seed=args.seed)
    start = time.time()
    results = evaluate_needle(model, tok, hay, cfg, args.method, group=group, device=dev,
                              generate=args.generate, ring_degree=args.ring_degree,
                              progress=_is_main())
    world = dist.get_world_size() if dist.is_initialized() else 1
    variant = ("multi-value" if cfg.num_values > 1 else "multi-key" if cfg.num_distractor
               else "single")
    results["config"] = {"model": args.model, "method": args.method, "world_size": world,
                         "scoring": "generate" if args.generate else "teacher_forced",
                         "variant": variant, "haystack": args.haystack_dir or "generated",
                         "seconds": round(time.time() - start, 2),
                         **{k: v for k, v in vars(cfg).items() if k != "template"}}
    return results


def run_eval_needle(args: argparse.Namespace) -> int:
    """Run the needle eval; write results.json and heatmap.png; print the average score."""
    from transformers import AutoTokenizer

    from ..models import check_model_path
    from .needle import NeedleConfig, build_haystack, check_needle_prompts, read_haystack_dir
    from .plots import plot_needle_heatmap

    # bad flags, lengths too short for the prompt, a haystack folder too short (without
    # repetition): all before any launch
    _check_common(args, [args.model], tokenizer=True)
    if args.generate and args.nproc_per_node > 1:
        raise ValueError("--generate runs in one process (decoding is not sequence-parallel); "
                         "drop --nproc-per-node or --generate")
    cfg = NeedleConfig(args.min_context_length, args.max_context_length, args.context_interval,
                       args.depth_interval, args.num_samples, args.rnd_number_digits,
                       args.num_distractor, args.num_values, args.seed, args.add_bos)
    if args.num_distractor < 0:
        raise ValueError(f"--num-distractor must be >= 0, got {args.num_distractor}")
    if args.haystack_dir is not None and not read_haystack_dir(args.haystack_dir).strip():
        raise ValueError(f"haystack folder {args.haystack_dir}: its .txt files are empty")
    out = Path(args.output_dir or Path("needle_output") / model_name(args.model))
    check_output_path("--output-dir", out, folder=True)
    tok = AutoTokenizer.from_pretrained(check_model_path(args.model),
                                        trust_remote_code=args.trust_remote_code)
    tok.model_max_length = 1 << 40
    check_needle_prompts(tok, cfg)
    if args.haystack_dir is not None and args.no_repeat_haystack:
        build_haystack(tok, args.max_context_length, args.haystack_dir, repeat=False)
    results = launch(_needle_rank, args.nproc_per_node, args)
    if not _is_main():
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_needle_heatmap(out / "results.json", out / "heatmap.png")
    print(f"average score {results['average_score']:.4f} (token accuracy "
          f"{results['average_token_accuracy']:.4f}, chance {results['chance']:.2g}); "
          f"wrote {out / 'results.json'} and {out / 'heatmap.png'}")
    return 0


# ---------------------------------------------------------------- eval-ruler


def add_eval_ruler_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context eval-ruler``."""
    from .ruler.tasks import TASKS

    parser.add_argument("--model", required=True, help="model folder (save_pretrained)")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help="RULER tasks (default: all): " + ", ".join(TASKS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768],
                        help="lengths in the model's tokens: each prompt, template included, "
                             "plus its answer budget fits in its length")
    parser.add_argument("--num-samples", type=int, default=20,
                        help="samples per task and length (RULER uses 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--template", choices=("base", "chat"), default="base",
                        help="base: plain text after BOS; chat: the tokenizer's chat template")
    parser.add_argument("--haystack-dir", default=None,
                        help="folder of .txt files for the essay haystack; default: generated "
                             "text")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="answer budget of every task (default: each task's, as RULER: "
                             "128 niah and kv, 30 vt, 120 cwe, 50 fwe)")
    parser.add_argument("--output-dir", default=None,
                        help="where samples.jsonl, scores.csv/.md/.png go; a rerun resumes "
                             "(default: ruler_output/<model folder name>)")
    _add_common(parser)


def ruler_config(args: argparse.Namespace):
    """The RulerConfig of the flags, with what else changes the answers (the model folder,
    dtype as resolved on this machine, RoPE overrides) as its settings."""
    from ..models import resolve_dtype
    from .ruler.run import RulerConfig
    from .ruler.tasks import TASKS

    model = Path(args.model).expanduser()
    settings = {"model": str(model.resolve()) if model.is_dir() else args.model,
                "dtype": str(resolve_dtype(args.dtype, rank_device())),
                "rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling}
    return RulerConfig(args.tasks or list(TASKS), args.lengths, args.num_samples, args.seed,
                       args.template, args.haystack_dir, args.max_new_tokens, settings)


def _ruler_rank(args: argparse.Namespace, cfg, out: Path) -> list[dict]:
    from .ruler.run import run_ruler

    # args has no `generate`: _setup switches the model to --parallel-mode, and
    # easy_context.generation decodes with that method over its group.
    dev, model, tok, _ = _setup(args, args.model)
    return run_ruler(model, tok, cfg, out, device=dev, progress=_is_main())


def run_eval_ruler(args: argparse.Namespace) -> int:
    """Run (or resume) the RULER eval; write samples.jsonl, scores.csv/.md/.png; print the
    table."""
    from transformers import AutoTokenizer

    from ..generation.generate import check_rope_range
    from ..models import check_model_path, load_config
    from .needle import read_haystack_dir
    from .ruler.run import check_lengths, check_resume
    from .ruler.scoring import markdown_table

    # bad flags, a folder of another run, lengths past the model's RoPE range or too short
    # for a task, a haystack folder too short: all before any launch
    _check_common(args, [args.model], tokenizer=True)
    cfg = ruler_config(args)
    if cfg.haystack_dir is not None and not read_haystack_dir(cfg.haystack_dir).strip():
        raise ValueError(f"haystack folder {args.haystack_dir}: its .txt files are empty")
    out = Path(args.output_dir or Path("ruler_output") / model_name(args.model))
    check_output_path("--output-dir", out, folder=True)
    check_resume(out, cfg)
    path = check_model_path(args.model)
    check_rope_range(load_config(path, args.rope_theta, args.rope_scaling,
                                 args.trust_remote_code), max(cfg.lengths))
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    tok.model_max_length = 1 << 40
    check_lengths(tok, cfg)
    rows = launch(_ruler_rank, args.nproc_per_node, args, cfg, out)
    if not _is_main():
        return 0
    print(markdown_table(rows), end="")
    print(f"wrote {out / 'samples.jsonl'}, {out / 'scores.csv'}, {out / 'scores.md'} and "
          f"{out / 'scores.png'}")
    return 0


# ---------------------------------------------------------------- eval-ppl


def add_eval_ppl_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context eval-ppl`` (the original's, plus launching, RoPE and last-k)."""
    parser.add_argument("-m", "--model", action="append", required=True,
                        help="model folder; repeat for several models")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--tokenized", help="saved dataset (save_to_disk) with an input_ids column")
    data.add_argument("--dataset", help="text: file, folder, .jsonl/.parquet, saved dataset or "
                                        "dataset name; tokenized with each model's tokenizer")
    parser.add_argument("--text-column", default="text", help="text column of --dataset")
    parser.add_argument("--dataset-min-tokens", type=int, default=None,
                        help="keep only samples with at least this many tokens")
    parser.add_argument("--samples", type=int, default=None, help="use the first N samples")
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--tokens-step", type=int, default=None,
                        help="evaluate every this many tokens from min to max (default: max only)")
    parser.add_argument("--sliding-window", type=int, default=256, help="stride between windows")
    parser.add_argument("--truncate", action="store_true",
                        help="cut each sample to the context length (one window per sample)")
    parser.add_argument("--last-k", type=int, default=256,
                        help="also report the perplexity of each window's last k tokens")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--output-file", default=None,
                        help="CSV, one row per model x length (default: ppl.csv)")
    output.add_argument("--output-dir", default=None, help="folder to write ppl.csv in")
    _add_common(parser)


def ppl_output(args: argparse.Namespace) -> Path:
    """Where eval-ppl writes its CSV: --output-file, or ppl.csv in --output-dir, or ./ppl.csv."""
    if getattr(args, "output_dir", None):
        return Path(args.output_dir) / "ppl.csv"
    return Path(args.output_file or "ppl.csv")


def load_samples(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Token id lists from --tokenized or --dataset, filtered and limited as the flags say."""
    import datasets

    if args.tokenized:
        if not Path(args.tokenized).exists():
            raise FileNotFoundError(f"--tokenized {args.tokenized} does not exist")
        ds = datasets.load_from_disk(args.tokenized)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["test"] if "test" in ds else ds[next(iter(ds))]
        if "input_ids" not in ds.column_names:
            raise ValueError(f"{args.tokenized} has no input_ids column: {ds.column_names}")
        seqs = (list(x) for x in ds["input_ids"])
    else:
        from ..data.sources import iter_texts, load_source, parse_source

        ds = load_source(parse_source(args.dataset), text_column=args.text_column)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        seqs = (bos + tokenizer(t, add_special_tokens=False)["input_ids"]
                for batch in iter_texts(ds) for t in batch)
    out = []
    for s in seqs:
        if len(s) >= (args.dataset_min_tokens or 0):
            out.append(s)
            if args.samples is not None and len(out) == args.samples:
                break
    if not out:
        source = args.tokenized or args.dataset
        raise ValueError(f"no sample has at least {args.dataset_min_tokens} tokens in {source}; "
                         "lower --dataset-min-tokens" if args.dataset_min_tokens
                         else f"{source} holds no samples")
    return out


def _ppl_rank(args: argparse.Namespace) -> list[dict]:
    from ..models import pad_token_id
    from .ppl import PplConfig, evaluate_ppl

    cfg = PplConfig(args.min_tokens, args.max_tokens, args.tokens_step, args.sliding_window,
                    args.truncate, args.last_k)
    rows = []
    for path in args.model:
        # --tokenized data needs no tokenizer: the model folder may have none.
        dev, model, tok, group = _setup(args, path, tokenizer=not args.tokenized)
        samples = load_samples(args, tok)
        pad = pad_token_id(tok, model.config)
        for row in evaluate_ppl(model, samples, cfg, args.method, pad, group=group, device=dev,
                                ring_degree=args.ring_degree, progress=_is_main()):
            rows.append({"model": model_name(path), **row})
        del model
    return rows


# Suffixes that make a --dataset value a file name rather than a dataset name on the Hub.
_TEXT_FILES = (".txt", ".md", ".jsonl", ".json", ".parquet", ".csv")


def _check_ppl_data(args: argparse.Namespace) -> None:
    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.dataset_min_tokens is not None and args.dataset_min_tokens < 0:
        raise ValueError(f"--dataset-min-tokens must be >= 0, got {args.dataset_min_tokens}")
    if args.tokenized:
        import datasets

        if not Path(args.tokenized).is_dir():
            raise FileNotFoundError(f"--tokenized {args.tokenized} does not exist (a folder "
                                    "written by datasets' save_to_disk)")
        try:
            ds = datasets.load_from_disk(args.tokenized)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--tokenized {args.tokenized} is not a saved dataset "
                                    f"(save_to_disk): {e}") from e
        splits = ds.values() if isinstance(ds, datasets.DatasetDict) else [ds]
        for split in splits:
            if "input_ids" not in split.column_names:
                raise ValueError(f"--tokenized {args.tokenized} has no input_ids column "
                                 f"({split.column_names}); for text, use --dataset")
    elif not Path(args.dataset).expanduser().exists() and (
            args.dataset.startswith((".", "/", "~")) or Path(args.dataset).suffix in _TEXT_FILES):
        raise FileNotFoundError(f"--dataset {args.dataset} does not exist")


def run_eval_ppl(args: argparse.Namespace) -> int:
    """Run the perplexity eval for every --model; write the CSV; print a table."""
    from .ppl import PplConfig

    # bad flags fail before any launch
    _check_common(args, args.model, tokenizer=bool(args.dataset))
    PplConfig(args.min_tokens, args.max_tokens, args.tokens_step, args.sliding_window,
              args.truncate, args.last_k)
    _check_ppl_data(args)
    out = ppl_output(args)
    check_output_path("--output-dir" if args.output_dir else "--output-file", out, folder=False)
    rows = launch(_ppl_rank, args.nproc_per_node, args)
    if not _is_main():
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(f"{r['model']}  {r['context_length']:>8}  ppl {r['ppl']:.4f}  "
              f"last {r['last_k']} ppl {r['last_k_ppl']:.4f}  ({r['tokens']} tokens)")
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------- plot-ppl


def add_plot_ppl_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context plot-ppl``."""
    parser.add_argument("csv", nargs="+", help="CSV files written by eval-ppl")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--output", default=None, help="PNG path (default: first CSV's, .png)")
    output.add_argument("--output-dir", default=None,
                        help="folder for the PNG, named after the first CSV")
    parser.add_argument("--last-k", action="store_true",
                        help="plot the last-k-token perplexity instead")
    parser.add_argument("--xmax", type=float, default=None)
    parser.add_argument("--ymin", type=float, default=None)
    parser.add_argument("--ymax", type=float, default=None)


def run_plot_ppl(args: argparse.Namespace) -> int:
    from .plots import plot_ppl

    column = "last_k_ppl" if args.last_k else "ppl"
    for path in args.csv:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        missing = {"model", "context_length", column} - set(header)
        if missing:
            raise ValueError(f"{path} is not an eval-ppl CSV: no {sorted(missing)} column "
                             f"(columns: {header})")
    if args.ymin is not None and args.ymax is not None and args.ymin >= args.ymax:
        raise ValueError(f"--ymin ({args.ymin}) must be below --ymax ({args.ymax})")
    if args.xmax is not None and not args.xmax > 0:
        raise ValueError(f"--xmax must be > 0, got {args.xmax}")
    name = Path(args.csv[0]).with_suffix(".png").name
    out = args.output or str(Path(args.output_dir) / name if args.output_dir
                             else Path(args.csv[0]).with_suffix(".png"))
    check_output_path("--output", out, folder=False)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    plot_ppl(args.csv, out, column, args.xmax, args.ymin, args.ymax)
    print(f"wrote {out}")
    return 0
