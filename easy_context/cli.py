"""``easy-context``: one command, a subcommand per job.

Each subcommand lives with the code it drives and exposes ``add_<name>_args(parser)`` and
``run_<name>(args) -> int``; this file only wires them up, importing a subcommand's module
when it runs (so ``easy-context --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, "add" function, "run" function, help)
SUBCOMMANDS = {
    "train": ("easy_context.train.cli", "add_train_args", "run_train",
              "DP x SP training with FSDP2 or DeepSpeed, checkpoints, resume and export"),
    "recipe": ("easy_context.recipes.cli", "add_recipe_args", "run_recipe_command",
               "run a progressive RoPE / context-extension recipe (YAML stages); --dry-run plans"),
    "prepare-data": ("easy_context.data.cli", "add_prepare_data_args", "run_prepare_data",
                     "tokenize and pack text or datasets into long-context training windows"),
    "synth-data": ("easy_context.data.cli", "add_synthetic_args", "run_synthetic",
                   "generate a synthetic long-context corpus (haystacks, passkeys, kv, variables)"),
    "train-tokenizer": ("easy_context.data.cli", "add_train_tokenizer_args", "run_train_tokenizer",
                        "train a small byte-level BPE tokenizer on local text"),
    "plan": ("easy_context.plan.cli", "add_plan_args", "run_plan",
             "predict per-device memory, pick the method, find the longest context that fits"),
    "demo": ("easy_context.demo.cli", "add_demo_args", "run_demo",
             "the main job on a CPU: train a tiny model short, extend its context, report"),
    "eval-needle": ("easy_context.eval.cli", "add_eval_needle_args", "run_eval_needle",
                    "needle-in-a-haystack eval (sequence-parallel, teacher-forced): JSON + heatmap"),
    "eval-ppl": ("easy_context.eval.cli", "add_eval_ppl_args", "run_eval_ppl",
                 "perplexity against context length (sequence-parallel, token-weighted): CSV"),
    "plot-ppl": ("easy_context.eval.cli", "add_plot_ppl_args", "run_plot_ppl",
                 "plot eval-ppl CSVs: perplexity against context length, one line per model"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="easy-context",
        description="EasyContext: exact sequence-parallel long-context training and evaluation.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add, _, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only in (None, name):
            getattr(importlib.import_module(module), add)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        build_parser(only="").print_help() if command is None else build_parser(only="").parse_args(argv)
        return 0 if command is None else 2
    args = build_parser(only=command).parse_args(argv)
    module, _, run, _ = SUBCOMMANDS[command]
    return int(getattr(importlib.import_module(module), run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
