"""``easy-context train``; ``python -m easy_context.train`` (for torchrun / accelerate) is
__main__.py, which runs it through the CLI."""

from __future__ import annotations

import argparse

from .config import add_train_args, config_from_args

__all__ = ["add_train_args", "run_train"]


def run_train(args: argparse.Namespace) -> int:
    from ..launch import launch
    from ..utils.allocator import export_for_children
    from .preflight import preflight
    from .trainer import run_training

    config = config_from_args(args)
    preflight(config)
    export_for_children()  # the ranks start with the allocator the planner assumes
    launch(run_training, config.nproc_per_node, config, timeout_minutes=config.pg_timeout_minutes)
    return 0
