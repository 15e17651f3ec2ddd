"""``easy-context recipe RECIPE.yaml [--dry-run]``."""

from __future__ import annotations

import argparse
import logging
from importlib import resources

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
    parser.add_argument("--output-root", default=None,
                        help="folder that relative output_dir paths are under (default: the recipe's folder)")


def run_recipe_command(args: argparse.Namespace) -> int:
    from .recipe import load_recipe
    from .runner import plan_text, run_recipe

    path = bundled_recipes().get(args.recipe, args.recipe)
    recipe = load_recipe(path, args.output_root)
    print(plan_text(recipe))
    if args.dry_run:
        return 0
    for summary in run_recipe(recipe):
        log.info("%s", summary)
    return 0
