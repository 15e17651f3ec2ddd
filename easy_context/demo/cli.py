"""``easy-context demo [--quick] [--output DIR]``: the whole job on a laptop CPU, no downloads."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("easy_context.demo")


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="demo_output",
                        help="folder for everything the demo writes; rerunning continues there "
                             "(default: demo_output)")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps per stage and a coarse eval: every artifact in ~2 min "
                             "(for CI; the accuracy targets need the full run)")
    parser.add_argument("--nproc-per-node", type=int, default=2,
                        help="processes per training stage (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, model and training")


def run_demo(args: argparse.Namespace) -> int:
    from .run import run_demo_pipeline

    if args.nproc_per_node < 1:
        raise SystemExit("--nproc-per-node must be >= 1")
    run_demo_pipeline(args.output, quick=args.quick, nproc_per_node=args.nproc_per_node,
                      seed=args.seed)
    log.info("report: %s/report.md", args.output)
    return 0
