"""``easy-context recipe RECIPE.yaml [--dry-run]``."""

from __future__ import annotations

import argparse
import logging
from importlib import resources
from pathlib import Path

log = logging.getLogger("easy_context.recipe")


def bundled_recipes() -> dict[str, str]:
    """Recipes shipped with the package, by file stem."""
    folder = resources.files("easy_context.recipes") / "configs"
    return {p.name.removesuffix(".yaml"): str(p) for p in folder.iterdir() if p.name.endswith(".yaml")}


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a recipe YAML file, or the name of a bundled one: "
                                       + ", ".join(sorted(bundled_recipes())))
    parser.add_argument("--dry-run", action="store_true",
                        help="print the stages with estimated memory per rank and time; run nothing")
    parser.add_argument("--output-dir", "--output-root", dest="output_root", default=None,
                        help="folder that the stages' relative paths (output_dir, and model and "
                             "dataset too) are under (default: outputs under the current folder, "
                             "model and dataset paths under the recipe's folder)")


def recipe_path(name: str) -> str:
    """A bundled recipe's file, or ``name`` itself when it is a file."""
    bundled = bundled_recipes()
    if name in bundled:
        return bundled[name]
    if not Path(name).is_file():
        raise FileNotFoundError(f"recipe {name} is neither a file nor a bundled recipe "
                                f"({', '.join(sorted(bundled))})")
    return name


def run_recipe_command(args: argparse.Namespace) -> int:
    from ..utils.paths import check_output_path
    from .recipe import load_recipe
    from .runner import plan_text, run_recipe

    if args.output_root:
        check_output_path("--output-dir", args.output_root, folder=True)
    recipe = load_recipe(recipe_path(args.recipe), args.output_root)
    print(plan_text(recipe))
    if args.dry_run:
        return 0
    for summary in run_recipe(recipe):
        log.info("%s", summary)
    return 0
