"""Progressive RoPE / context-extension recipes: stages in YAML, run in order, resumable."""

from .recipe import Recipe, Stage, load_recipe
from .runner import plan_text, run_recipe

__all__ = ["Recipe", "Stage", "load_recipe", "plan_text", "run_recipe"]
