"""The demo pipeline: build, train short, evaluate, extend (recipe), evaluate, report.

    output/
      tokenizer/ base_model/ data_512/ data_1024/ data_2048/ heldout.jsonl   (build)
      output/<stage>/        each recipe stage: metrics.jsonl, checkpoints, final_model
      eval/                  needle_{before,after}.json, ppl_{before,after}.csv
      timings.json, summary.json, report.md, *.png

Every phase is skipped when its outputs exist, and the stages go through the recipe runner,
so rerunning an interrupted demo continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ..recipes.recipe import Recipe, load_recipe
from ..recipes.runner import plan_text, run_recipe
from .build import ModelShape, build_model, build_tokenizer, write_corpus, write_heldout
from .evaluate import EvalSettings, evaluate_model

log = logging.getLogger("easy_context.demo")

RECIPE = "tiny_cpu_demo.yaml"


@dataclass
class DemoSettings:
    """Sizes of one demo run; ``quick()`` is the CI version (every artifact, no accuracy)."""

    vocab_size: int = 384
    shape: ModelShape = field(default_factory=ModelShape)
    steps: tuple[int, ...] | None = None  # per recipe stage; None: the recipe's own
    min_doc: dict = field(default_factory=lambda: {512: 64, 1024: 256, 2048: 512})
    # Per dataset folder, write_corpus settings that differ from its defaults: the copy
    # curriculum is short period documents and copy drills only (easy_context.demo.build).
    corpus: dict = field(default_factory=lambda: {
        "data_copy_512": {"period_share": 0.2, "drill_share": 0.8, "drill_tokens": (48, 80)},
        # retrieval: mostly needle tasks, with drills whose copies lie far apart
        "data_512": {"period_share": 0.05, "drill_share": 0.2, "drill_tokens": (64, 512),
                     "drill_gap": 400}})
    heldout_docs: int = 8
    eval: EvalSettings = field(default_factory=EvalSettings)

    @classmethod
    def quick(cls) -> "DemoSettings":
        return cls(steps=(4, 4, 2, 2), heldout_docs=2,
                   eval=EvalSettings(min_length=512, length_step=512, depth_interval=0.5,
                                     samples=1, ruler_tasks=("niah_single_1", "vt"),
                                     ruler_samples=1))


def bundled_recipe_path() -> Path:
    return Path(str(resources.files("easy_context.recipes") / "configs" / RECIPE))


def demo_recipe(output: Path, settings: DemoSettings, nproc_per_node: int, seed: int) -> Recipe:
    """The bundled recipe under ``output``, with the step counts, process count and seed of
    this run (the global batch stays the same for any process count)."""
    recipe = load_recipe(bundled_recipe_path(), output_root=output)
    recipe.nproc_per_node = nproc_per_node
    for i, stage in enumerate(recipe.stages):
        train = stage.train
        if settings.steps is not None:
            train["max_train_steps"] = settings.steps[i]
            train["warmup_steps"] = min(train["warmup_steps"], settings.steps[i] // 2)
        if train["parallel_mode"] == "data_parallel":
            train["batch_size"] = max(1, train["batch_size"] * train["nproc_per_node"] // nproc_per_node)
        train["nproc_per_node"] = nproc_per_node
        train["seed"] = seed
    return recipe


def short_stages(recipe: Recipe) -> int:
    """How many leading stages train at the first length and RoPE base: the model before
    extension is the last of them."""
    t0 = recipe.stages[0].train
    n = 1
    while n < len(recipe.stages) and all(
            recipe.stages[n].train[k] == t0[k] for k in ("seq_length", "rope_theta")):
        n += 1
    return n


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the spawned ranks)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Timings:
    """Wall and CPU seconds per phase, saved after each one (timings.json). CPU seconds
    matter on a shared machine: wall time there mostly measures the other jobs."""

    def __init__(self, path: Path):
        self.path = path
        self.phases = json.loads(path.read_text()) if path.exists() else {}

    @contextmanager
    def phase(self, name: str, processes: int = 1):
        """``processes``: how many processes do the work (one core each), for the estimate of
        the wall time on an idle machine (CPU seconds / processes)."""
        wall, cpu = time.perf_counter(), _cpu_seconds()
        load = os.getloadavg()[0]
        yield
        # A rerun adds to the phase: the time a resumed demo spent on it, over all its runs.
        prev = self.phases.get(name, {"wall_s": 0.0, "cpu_s": 0.0, "load_start": load})
        self.phases[name] = {"wall_s": prev["wall_s"] + time.perf_counter() - wall,
                             "cpu_s": prev["cpu_s"] + _cpu_seconds() - cpu,
                             "load_start": prev["load_start"], "load_end": os.getloadavg()[0],
                             "processes": processes}
        self.path.write_text(json.dumps(self.phases, indent=1))
        log.info("phase %s: %.1f s wall, %.1f s CPU", name, self.phases[name]["wall_s"],
                 self.phases[name]["cpu_s"])


def build_phase(out: Path, recipe: Recipe, settings: DemoSettings, seed: int) -> list[str]:
    """Tokenizer, base model, one packed dataset per stage length, held-out texts."""
    from transformers import AutoTokenizer

    from ..data.prepare import PrepareConfig, prepare_data

    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(tok_dir, settings.vocab_size, seed)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if not (out / "base_model" / "config.json").exists():
        build_model(out / "base_model", tokenizer, settings.shape, seed)
    for stage in recipe.stages:
        t = stage.train
        data = Path(t["dataset"])
        if (data / "stats.json").exists():
            continue
        windows = t["max_train_steps"] * t["batch_size"] * t["gradient_accumulate_every"]
        if t["parallel_mode"] == "data_parallel":
            windows *= t["nproc_per_node"]
        corpus = out / "corpus" / f"{data.name}.jsonl"
        counts = write_corpus(corpus, tokenizer, t["seq_length"], windows + 1,
                              settings.min_doc.get(t["seq_length"], 64), seed,
                              **settings.corpus.get(data.name, {}))
        log.info("%s: %s", data.name, counts)
        prepare_data(PrepareConfig(inputs=[str(corpus)], tokenizer=str(tok_dir), output=str(data),
                                   seq_length=t["seq_length"], seed=seed))
    heldout = out / "heldout.jsonl"
    if heldout.exists():
        return [json.loads(line)["text"] for line in heldout.read_text().splitlines()]
    return write_heldout(heldout, tokenizer, settings.heldout_docs, settings.eval.max_length, seed)


def _evaluate(model_dir: Path, label: str, out: Path, settings: DemoSettings,
              heldout: list[str], timings: Timings) -> dict:
    """The eval of one model, or its saved summary when a previous run finished it."""
    done = out / "eval" / f"summary_{label}.json"
    if done.exists():
        return json.loads(done.read_text())
    with timings.phase(f"eval {label}"):
        summary = evaluate_model(model_dir, label, out / "eval", settings.eval, heldout)
    done.write_text(json.dumps(summary, indent=1))
    return summary


def run_demo_pipeline(output: str | Path, quick: bool = False, nproc_per_node: int = 2,
                      seed: int = 0) -> dict:
    """Run (or continue) the whole demo; returns summary.json's content."""
    from .report import write_report

    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # A rerun continues the run in ``out``, so it must be the same run (step counts, data
    # sizes and checkpoints depend on these).
    run = {"quick": quick, "nproc_per_node": nproc_per_node, "seed": seed}
    marker = out / "demo_run.json"
    if marker.exists() and json.loads(marker.read_text()) != run:
        raise ValueError(f"{out} holds a demo run with {marker.read_text().strip()}; this one is "
                         f"{json.dumps(run)}: pass another --output, or delete that folder")
    marker.write_text(json.dumps(run))
    settings = DemoSettings.quick() if quick else DemoSettings()
    # One thread in this process: on a shared machine OpenMP threads that wait for each other
    # slow small matmuls down many times; the training ranks already take one core each.
    torch.set_num_threads(1)
    timings = Timings(out / "timings.json")
    start = time.perf_counter()
    recipe = demo_recipe(out, settings, nproc_per_node, seed)
    log.info("demo in %s (%s run)", out, "quick" if quick else "full")
    with timings.phase("build"):
        heldout = build_phase(out, recipe, settings, seed)
    plan = plan_text(recipe)  # after the build: the planner reads the base model's shape
    (out / "plan.txt").write_text(plan + "\n")
    log.info("\n%s", plan)
    short = short_stages(recipe)
    first = recipe.stages[short - 1]
    with timings.phase(f"train {first.name}", nproc_per_node):
        run_recipe(dataclasses.replace(recipe, stages=recipe.stages[:short]))
    evals = {"before": _evaluate(first.model_dir, "before", out, settings, heldout, timings)}
    with timings.phase("train extension stages", nproc_per_node):
        stages = run_recipe(recipe)
    evals["after"] = _evaluate(recipe.stages[-1].model_dir, "after", out, settings, heldout,
                               timings)
    summary = {"quick": quick, "nproc_per_node": nproc_per_node, "seed": seed,
               "first_length": first.train["seq_length"],
               "stages": stages, "evals": evals, "timings": timings.phases,
               "total_wall_s": time.perf_counter() - start,
               "cpu_count": os.cpu_count(), "load_average_end": os.getloadavg()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with timings.phase("report"):
        write_report(out, recipe)
    return summary
