"""``easy-context demo [--quick] [--output-dir DIR]``: the whole job on a laptop CPU, no downloads."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("easy_context.demo")


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", "--output", dest="output", default="demo_output",
                        help="folder for everything the demo writes; rerunning continues there "
                             "(default: demo_output)")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps per stage and a coarse eval: every artifact in ~2 min "
                             "(for CI; the accuracy targets need the full run)")
    parser.add_argument("--nproc-per-node", type=int, default=2,
                        help="processes per training stage (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, model and training")


def check_demo_args(args: argparse.Namespace) -> None:
    """Bad values fail here, before the build phase spends its seconds."""
    from ..train.config import TrainConfig
    from ..utils.paths import check_output_path
    from ..train.preflight import check_layout
    from .run import DemoSettings, demo_recipe

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    check_output_path("--output-dir", args.output, folder=True)
    out = Path(args.output)
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    for stage in demo_recipe(out, settings, args.nproc_per_node, args.seed).stages:
        try:  # every stage's length must split over the ranks
            check_layout(TrainConfig(**stage.train), args.nproc_per_node)
        except ValueError as e:
            raise ValueError(f"--nproc-per-node {args.nproc_per_node} cannot split the "
                             f"{stage.train['seq_length']} tokens of stage {stage.name!r} "
                             f"({stage.train['parallel_mode']}); use 1, 2 or 4") from e


def run_demo(args: argparse.Namespace) -> int:
    from .run import run_demo_pipeline

    check_demo_args(args)
    run_demo_pipeline(args.output, quick=args.quick, nproc_per_node=args.nproc_per_node,
                      seed=args.seed)
    log.info("report: %s/report.md", args.output)
    return 0
