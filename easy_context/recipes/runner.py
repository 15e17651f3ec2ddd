"""Run a recipe's stages in order (or print the plan), each from the previous one's model."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from ..train.config import TrainConfig
from .recipe import Recipe, Stage, mark_done

log = logging.getLogger("easy_context.recipe")


def _previous_model(recipe: Recipe, index: int) -> Path:
    return recipe.stages[index - 1].model_dir


def run_config_stage(recipe: Recipe, index: int) -> dict:
    """Copy the previous model and change its RoPE settings, without training (the original's
    final 250M -> 1B step, which it did with sed on config.json)."""
    from ..models import apply_rope_overrides
    from transformers import AutoConfig

    stage = recipe.stages[index]
    source = _previous_model(recipe, index)
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"stage {stage.name!r}: {source} holds no model; run the stages "
                                "before it first")
    tmp = stage.output_dir.with_name(stage.output_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    config = AutoConfig.from_pretrained(tmp)
    apply_rope_overrides(config, stage.set_rope_theta, stage.set_rope_scaling)
    config.save_pretrained(tmp)
    if stage.output_dir.exists():
        shutil.rmtree(stage.output_dir)
    tmp.rename(stage.output_dir)
    return {"stage": stage.name, "from": str(source), "rope": config.rope_parameters}


def run_train_stage(stage: Stage) -> dict:
    from ..launch import launch
    from ..train.trainer import results_of, run_training

    config = TrainConfig(**stage.train)
    start = time.perf_counter()
    launch(run_training, config.nproc_per_node, config, timeout_minutes=config.pg_timeout_minutes)
    metrics = results_of(stage.output_dir)
    return {"stage": stage.name, "steps": len(metrics), "seconds": time.perf_counter() - start,
            "final_loss": metrics[-1]["loss"] if metrics else None,
            "peak_memory_mb": max((m["peak_memory_mb"] for m in metrics
                                   if m.get("peak_memory_mb") is not None), default=None),
            "tokens_per_s": (sum(m["tokens_per_s"] for m in metrics) / len(metrics)) if metrics else None}


def check_stages(recipe: Recipe) -> None:
    """Preflight every unfinished training stage (easy_context/train/preflight.py) before
    the first one starts: a bad dataset in stage 5 should not wait for stages 1-4. A model
    that an earlier stage writes is not there yet, so only the others are checked."""
    from ..train.preflight import preflight

    written = set()
    for stage in recipe.stages:
        if stage.trains and not stage.done():
            try:
                preflight(TrainConfig(**stage.train),
                          model=stage.train["model"] not in written)
            except ValueError as e:  # say which stage
                raise ValueError(f"stage {stage.name!r}: {e}") from e
            except (FileNotFoundError, NotADirectoryError) as e:
                raise FileNotFoundError(f"stage {stage.name!r}: {e}") from e
        written.add(str(stage.model_dir))


def run_recipe(recipe: Recipe) -> list[dict]:
    """Run every unfinished stage; returns each stage's summary (finished ones included)."""
    check_stages(recipe)
    summaries = []
    for i, stage in enumerate(recipe.stages):
        if stage.done():
            log.info("stage %d/%d %s: done, skipped", i + 1, len(recipe.stages), stage.name)
            summaries.append(json.loads((stage.output_dir / "stage_done.json").read_text()))
            continue
        log.info("stage %d/%d %s: %s", i + 1, len(recipe.stages), stage.name,
                 "training" if stage.trains else "editing the RoPE settings")
        summary = run_train_stage(stage) if stage.trains else run_config_stage(recipe, i)
        mark_done(stage, summary)
        summaries.append(summary)
    return summaries


def _shapes(recipe: Recipe) -> list:
    """Each training stage's model shape; a stage that starts from an earlier stage's model
    (not trained yet at planning time) has that stage's shape."""
    from ..plan.shapes import load_shape

    shapes, by_dir = [], {}
    for stage in recipe.stages:
        shape = None
        if stage.trains:
            model = stage.train["model"]
            shape = by_dir.get(str(model))
            if shape is None:
                try:
                    shape = load_shape(model)
                except (ValueError, OSError):
                    shape = None
        else:
            shape = shapes[-1] if shapes else None
        by_dir[str(stage.model_dir)] = shape
        shapes.append(shape)
    return shapes


def _estimates(stage: Stage, shape, world: int):
    """(peak memory per rank in GiB, estimated hours) from the planner, or a reason."""
    from ..parallel import get_method
    from ..plan.estimate import estimate_memory

    train = stage.train
    if shape is None:
        return None, None, f"no model shape for {train['model']} (not a local folder or a built-in name)"
    config = TrainConfig(**train)
    sp = config.sp_size_for(world)
    est = estimate_memory(shape, train["seq_length"], sp, "local" if sp == 1 else
                          get_method(config.parallel_mode).name,
                          engine=train["engine"], offload=train["offload"],
                          checkpointing=train["checkpointing"], dtype=train["mixed_precision"],
                          loss_chunk="auto" if train["chunked_loss"] else None,
                          ring_degree=train.get("ring_degree"), lora=_lora_spec(train))
    # time: 6 * params * tokens for the dense part, plus causal attention (fwd+bwd, 2/3 of a
    # full 4 * L^2 * hidden per layer, times 3 for backward), at an assumed 40% of 312 TFLOP/s
    # (A100 bf16) per device.
    tokens = train["seq_length"] * train["batch_size"] * train["gradient_accumulate_every"] * (world // sp)
    attn = 3 * 2 * shape.layers * train["seq_length"] * shape.hidden * tokens
    flops = 6 * shape.num_params() * tokens + attn
    hours = flops * train["max_train_steps"] / (world * 0.4 * 312e12) / 3600
    return est.total / 2**30, hours, None


def _lora_spec(train: dict):
    """The planner's LoRASpec for a stage that trains LoRA adapters, else None."""
    if not train.get("lora_rank"):
        return None
    from ..plan.lora import LoRASpec, parse_targets

    return LoRASpec(int(train["lora_rank"]), parse_targets(train.get("lora_targets")))


def plan_text(recipe: Recipe) -> str:
    """What --dry-run prints: every stage with its settings, memory and time estimates."""
    world = recipe.nproc_per_node
    w = max(len(s.name) for s in recipe.stages)
    lines = [f"recipe {recipe.name}: {len(recipe.stages)} stages on {world} devices per node",
             f"{'#':>2} {'stage':<{w}} {'seq':>8} {'rope':>16} {'steps':>6} {'lr':>8} "
             f"{'method':<17} {'mem/rank GiB':>12} {'est. h (A100)':>13}  status"]
    for i, (stage, shape) in enumerate(zip(recipe.stages, _shapes(recipe)), 1):
        status = "done" if stage.done() else "to run"
        if not stage.trains:
            rope = f"theta={stage.set_rope_theta:g}" if stage.set_rope_theta else str(stage.set_rope_scaling)
            lines.append(f"{i:>2} {stage.name:<{w}} {'-':>8} {rope:>16} {'-':>6} {'-':>8} "
                         f"{'(config only)':<17} {'-':>12} {'-':>13}  {status}")
            continue
        t = stage.train
        rope = (f"theta={t['rope_theta']:g}" if t.get("rope_theta") else "") + \
               (f" {t['rope_scaling']}" if t.get("rope_scaling") else "")
        mem, hours, why = _estimates(stage, shape, world)
        mem_s = f"{mem:12.1f}" if mem is not None else f"{'?':>12}"
        hours_s = f"{hours:13.1f}" if hours is not None else f"{'?':>13}"
        lines.append(f"{i:>2} {stage.name:<{w}} {t['seq_length']:>8} {rope or 'model default':>16} "
                     f"{t['max_train_steps']:>6} {t['learning_rate']:>8.1e} {t['parallel_mode']:<17} "
                     f"{mem_s} {hours_s}  {status}" + (f"  ({why})" if why else ""))
    lines.append("memory: easy_context.plan estimate per rank (peak of one step); time: "
                 "6*params*tokens + causal attention FLOPs at 40% of 312 TFLOP/s per device")
    return "\n".join(lines)
