"""Long-context evaluation: needle in a haystack, perplexity against length, RULER's
synthetic tasks, and their plots.

    from easy_context.eval import NeedleConfig, build_haystack, evaluate_needle
    from easy_context.eval import PplConfig, evaluate_ppl, load_model_and_tokenizer
    from easy_context.eval import RulerConfig, run_ruler

The needle and perplexity evals run sequence-parallel over the ranks of a process group (one forward pass per
prompt or window, sharded like training) and sum their per-token results across ranks.
RULER generates answers with easy_context.generation, sequence-parallel too. Command line:
``easy-context eval-needle``, ``eval-ppl``, ``eval-ruler`` and ``plot-ppl`` (easy_context.eval.cli).
"""

from ..utils.lazy import lazy_exports

# Imported on first use: plot-ppl needs neither the models nor the evals.
_EXPORTS = {
    **dict.fromkeys(("apply_rope_overrides", "load_config", "load_model_and_tokenizer",
                     "parse_rope_scaling", "resolve_dtype"), "..models"),
    **dict.fromkeys(("Haystack", "NeedleConfig", "NeedlePrompt", "NeedleTemplate",
                     "build_haystack", "build_prompt", "evaluate_needle", "score_generate",
                     "score_teacher_forced"), "needle"),
    **dict.fromkeys(("plot_needle_heatmap", "plot_ppl", "plot_ruler"), "plots"),
    **dict.fromkeys(("RulerConfig", "run_ruler"), "ruler.run"),
    **dict.fromkeys(("PplConfig", "evaluate_ppl", "sliding_windows", "window_stats"), "ppl"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = list(_EXPORTS)
