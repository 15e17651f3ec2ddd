"""``easy-context train`` and ``python -m easy_context.train`` (for torchrun / accelerate)."""

from __future__ import annotations

import argparse

from .config import add_train_args, config_from_args

__all__ = ["add_train_args", "run_train", "main"]


def run_train(args: argparse.Namespace) -> int:
    from ..launch import launch
    from ..utils.allocator import export_for_children
    from .trainer import run_training

    config = config_from_args(args)
    export_for_children()  # the ranks start with the allocator the planner assumes
    launch(run_training, config.nproc_per_node, config, timeout_minutes=config.pg_timeout_minutes)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m easy_context.train",
                                     description="DP x SP training of a Hugging Face causal LM")
    add_train_args(parser)
    return run_train(parser.parse_args(argv))
