"""Needle and perplexity evals of one model folder, written as JSON/CSV for the report.

One process: at 2048 tokens a forward pass of the tiny model takes milliseconds, so the
evals need no sequence parallelism (the eval package supports it for long contexts).
"""

from __future__ import annotations

import csv
import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from ..models import load_model_and_tokenizer
from ..eval.needle import NeedleConfig, evaluate_needle
from ..eval.ppl import PplConfig, evaluate_ppl
from ..eval.ruler import RulerConfig, run_ruler
from ..generation import generate
from .build import DIGITS, DISTINCT_DIGITS, TEMPLATE, filler_haystack

log = logging.getLogger("easy_context.demo")


@dataclass
class EvalSettings:
    min_length: int = 256
    max_length: int = 2048
    length_step: int = 256
    depth_interval: float = 0.25
    samples: int = 4
    seed: int = 12345  # the training corpus uses other seeds, hence other numbers
    # RULER's tasks within the tiny model's reach (needles among noise or text, distractor
    # keys, a variable chain), at the trained length and at 4x, with generated answers
    ruler_tasks: tuple[str, ...] = ("niah_single_1", "niah_single_2", "niah_multikey_1", "vt")
    ruler_lengths: tuple[int, ...] = (512, 2048)
    ruler_samples: int = 4
    ruler_new_tokens: int = 24  # 7-digit numbers or a few variable names: no 128 needed


def needle_config(s: EvalSettings) -> NeedleConfig:
    return NeedleConfig(min_context_length=s.min_length, max_context_length=s.max_length,
                        context_interval=s.length_step, depth_interval=s.depth_interval,
                        num_samples=s.samples, rnd_number_digits=DIGITS, seed=s.seed,
                        template=TEMPLATE, distinct_digits=DISTINCT_DIGITS)


def evaluate_model(model_dir: Path, label: str, out_dir: Path, settings: EvalSettings,
                   heldout: list[str]) -> dict:
    """Write ``needle_<label>.json`` and ``ppl_<label>.csv`` into ``out_dir``; return a summary
    (needle score per length, ppl per length)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    cfg = needle_config(settings)
    hay = filler_haystack(tokenizer, settings.max_length + 64)
    needle = evaluate_needle(model, tokenizer, hay, cfg, "data_parallel", progress=False)
    needle["config"] = {"model": label, "model_dir": str(model_dir),
                        "rope_parameters": model.config.rope_parameters,
                        **{k: v for k, v in asdict(cfg).items() if k != "template"}}
    (out_dir / f"needle_{label}.json").write_text(json.dumps(needle, indent=1))

    samples = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in heldout]
    if tokenizer.bos_token_id is not None:
        samples = [[tokenizer.bos_token_id] + s for s in samples]
    ppl_cfg = PplConfig(min_tokens=settings.min_length, max_tokens=settings.max_length,
                        tokens_step=settings.length_step, truncate=True,
                        last_k=settings.min_length)
    rows = evaluate_ppl(model, samples, ppl_cfg, "data_parallel", tokenizer.pad_token_id or 0,
                        progress=False)
    with open(out_dir / f"ppl_{label}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", *rows[0]])
        writer.writeheader()
        writer.writerows({"model": label, **r} for r in rows)

    ruler_cfg = RulerConfig(tasks=list(settings.ruler_tasks),
                            lengths=list(settings.ruler_lengths),
                            num_samples=settings.ruler_samples, seed=settings.seed,
                            max_new_tokens=settings.ruler_new_tokens,
                            settings={"model": label})
    # "before" answers at 4x the length it was trained for, past its RoPE range on purpose
    ruler = run_ruler(model, tokenizer, ruler_cfg, out_dir / f"ruler_{label}", method="local",
                      progress=False, generate_fn=functools.partial(generate,
                                                                    beyond_rope_range=True))

    by_length: dict[int, list[float]] = {}
    for cell in needle["cells"]:
        by_length.setdefault(cell["context_length"], []).append(cell["score"])
    summary = {"model": label, "needle_average": needle["average_score"],
               "needle_by_length": {n: sum(v) / len(v) for n, v in sorted(by_length.items())},
               "ppl_by_length": {r["context_length"]: r["ppl"] for r in rows},
               "last_k_ppl_by_length": {r["context_length"]: r["last_k_ppl"] for r in rows},
               "ruler": [{k: r[k] for k in ("task", "length", "score", "samples")}
                         for r in ruler]}
    log.info("%s: needle %s; ppl %s", label,
             {n: round(v, 2) for n, v in summary["needle_by_length"].items()},
             {n: round(v, 3) for n, v in summary["ppl_by_length"].items()})
    return summary
