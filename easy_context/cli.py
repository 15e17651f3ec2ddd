"""``easy-context``: one command, a subcommand per job.

Each subcommand lives with the code it drives and exposes ``add_<name>_args(parser)`` and
``run_<name>(args) -> int``; this file only wires them up, importing a subcommand's module
when it runs (so ``easy-context --help`` stays fast).

It is also the one place where exceptions become messages (easy_context/errors.py): a
failure prints ``easy-context <command>: error: <message>`` on one line and exits with 2 for
bad usage, 1 for a failure at run time. ``--debug`` (anywhere on the line) or
``EASY_CONTEXT_DEBUG=1`` prints the traceback too. Called as a library, the subcommands'
``run_*`` functions raise their exceptions as usual.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from .errors import RankError, UsageError, describe, exit_code, one_line

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
    "generate": ("easy_context.generation.cli", "add_generate_args", "run_generate",
                 "generate from a prompt, sequence-parallel: prefill by any method, KV cache "
                 "sharded over the ranks"),
    "eval-needle": ("easy_context.eval.cli", "add_eval_needle_args", "run_eval_needle",
                    "needle-in-a-haystack eval (sequence-parallel, teacher-forced): JSON + heatmap"),
    "eval-ruler": ("easy_context.eval.cli", "add_eval_ruler_args", "run_eval_ruler",
                   "RULER's synthetic tasks (niah, vt, cwe, fwe, kv) against length, "
                   "sequence-parallel generation; resumable: JSONL + CSV/Markdown + plot"),
    "eval-ppl": ("easy_context.eval.cli", "add_eval_ppl_args", "run_eval_ppl",
                 "perplexity against context length (sequence-parallel, token-weighted): CSV"),
    "plot-ppl": ("easy_context.eval.cli", "add_plot_ppl_args", "run_plot_ppl",
                 "plot eval-ppl CSVs: perplexity against context length, one line per model"),
}


_DEBUG_HELP = "on an error, also print the traceback (or set EASY_CONTEXT_DEBUG=1)"


class _Parser(argparse.ArgumentParser):
    """Raises its errors (main reports them like any other) instead of printing the usage
    (40 lines for train) and exiting."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="easy-context",
        description="EasyContext: exact sequence-parallel long-context training and evaluation.")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add, _, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only in (None, name):
            getattr(importlib.import_module(module), add)(p)
            # main takes --debug out of the line first; this is its entry in --help
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help=_DEBUG_HELP)
    return parser


def _split_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """--debug may come before or after the subcommand: take it out wherever it is (not
    after a ``--``, where everything is an argument)."""
    end = argv.index("--") if "--" in argv else len(argv)
    rest = [a for a in argv[:end] if a != "--debug"] + argv[end:]
    flag = len(rest) < len(argv)
    return flag or os.environ.get("EASY_CONTEXT_DEBUG", "") not in ("", "0"), rest


def report_error(command: str | None, exc: BaseException, debug: bool) -> int:
    """Print ``exc`` as the one-line error (after its traceback with ``debug``); return the
    exit status."""
    if debug:
        # A rank's own traceback: the one of this process only shows launch() re-raising it.
        tb = exc.traceback if isinstance(exc, RankError) and exc.traceback else \
            "".join(traceback.format_exception(exc))
        sys.stderr.write(tb if tb.endswith("\n") else tb + "\n")
    message = "interrupted" if isinstance(exc, KeyboardInterrupt) else one_line(describe(exc))
    prog = f"easy-context {command}" if command else "easy-context"
    # Under torchrun every process runs this: say which rank is talking.
    if not isinstance(exc, RankError) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        message = f"rank {os.environ.get('RANK', '?')}: {message}"
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return exit_code(exc)


def main(argv: list[str] | None = None) -> int:
    """The ``easy-context`` command: returns the exit status (errors are printed, not raised)."""
    debug, argv = _split_debug(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = next((a for a in argv if not a.startswith("-")), None)
    known = command if command in SUBCOMMANDS else None
    try:
        if known is None:
            parser = build_parser(only="")
            if command is None and not argv:
                parser.print_help()
                return 0
            parser.parse_args(argv)  # --help exits 0; an unknown command raises UsageError
            parser.print_help()  # only global flags were given
            return 0
        args = build_parser(only=known).parse_args(argv)
        module, _, run, _ = SUBCOMMANDS[known]
        return int(getattr(importlib.import_module(module), run)(args) or 0)
    except (Exception, KeyboardInterrupt) as e:
        return report_error(known, e, debug)


if __name__ == "__main__":
    sys.exit(main())
