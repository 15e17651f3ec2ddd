"""``python -m easy_context.train ...`` (what torchrun and accelerate start on each rank): an
entry point, so it may import the CLI above the package."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``python -m easy_context.train ...`` (what torchrun and accelerate start on each rank):
    ``easy-context train ...``, with its one-line errors and --debug."""
    from ..cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
