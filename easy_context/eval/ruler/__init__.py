"""RULER-style synthetic long-context evaluation (``easy-context eval-ruler``).

    from easy_context.eval.ruler import RulerConfig, run_ruler, make_sample, PromptEncoder

tasks.py generates the tasks' samples from a seed, haystack.py holds their text and fits a
prompt to a token length, scoring.py scores as RULER's harness does and makes the tables,
run.py runs the samples sequence-parallel, resumably.
"""

from ...utils.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("PromptEncoder", "fit_units", "pseudo_words"), "haystack"),
    **dict.fromkeys(("TASKS", "RulerSample", "TaskSpec", "get_task", "make_sample"), "tasks"),
    **dict.fromkeys(("markdown_table", "postprocess", "score_sample", "string_match_all",
                     "string_match_part"), "scoring"),
    **dict.fromkeys(("RulerConfig", "check_lengths", "check_resume", "load_records",
                     "run_ruler"), "run"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = list(_EXPORTS)
