"""Recipes: parsing errors, --dry-run, and resume (finished stages skipped, an interrupted
stage continued from its checkpoint) on a tiny model in one gloo process."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from easy_context.cli import main
from easy_context.recipes.recipe import load_recipe
from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir

TRAIN = dict(seq_length=32, parallel_mode="data_parallel", mixed_precision="fp32",
             checkpointing="none", learning_rate=1e-3, max_train_steps=4, save_every=2)


def _write(folder: Path, recipe: dict) -> Path:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("recipe, message", [
    ({"stages": [{"name": "a", "model": "m", "dataset": "d", "sequence_length": 8}]},
     "unknown keys ['sequence_length']"),
    ({"defaults": {"lr": 1e-3}, "stages": [{"name": "a", "model": "m", "dataset": "d"}]},
     "unknown keys in defaults ['lr']"),
    ({"stages": [{"name": "a", "dataset": "d"}]}, "the first stage needs a model"),
    ({"stages": [{"name": "a", "model": "m", "dataset": "d"}, {"name": "a", "dataset": "d"}]},
     "stage names must be unique"),
    ({"stages": [{"name": "rope", "set_rope_theta": 1e6}]}, "no stage before it trains one"),
    ({"stages": [{"model": "m", "dataset": "d"}]}, "stage 1 needs a name"),
    ({"stages": []}, "non-empty 'stages' list"),
])
def test_bad_recipes_are_refused_before_anything_runs(tmp_path, recipe, message):
    with pytest.raises(ValueError) as info:
        load_recipe(_write(tmp_path, recipe), output_root=tmp_path / "out")
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


def test_paths_are_relative_to_the_output_root(tmp_path):
    recipe = load_recipe(_write(tmp_path, {"stages": [
        {"name": "a", "model": "base_model", "dataset": "data_32", **TRAIN},
        {"name": "b", "dataset": "org/hub_name", **TRAIN}]}), output_root=tmp_path / "out")
    a, b = recipe.stages
    assert a.train["model"] == str(tmp_path / "out" / "base_model")
    assert a.train["dataset"] == str(tmp_path / "out" / "data_32")
    assert a.output_dir == tmp_path / "out" / "output" / "a"
    assert b.train["model"] == str(a.output_dir / "final_model")  # the previous stage's export
    assert b.train["dataset"] == "org/hub_name"  # one slash and no such folder: a hub name
    assert a.train["resume"] and b.train["resume"]


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    path = _write(tmp_path, {"name": "tiny", "stages": [
        {"name": "short", "model": "base_model", "dataset": "d", "rope_theta": 10000, **TRAIN},
        {"name": "long", "dataset": "d", "rope_theta": 40000, **{**TRAIN, "seq_length": 64}},
        {"name": "rope_only", "set_rope_theta": 1e6}]})
    assert main(["recipe", str(path), "--dry-run", "--output-root", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "recipe tiny: 3 stages" in text
    for name in ("short", "long", "rope_only", "theta=40000", "(config only)", "to run"):
        assert name in text
    assert not (tmp_path / "out").exists()


def test_bundled_demo_recipe_parses(tmp_path):
    from easy_context.demo.run import bundled_recipe_path

    recipe = load_recipe(bundled_recipe_path(), output_root=tmp_path)
    assert [s.train["seq_length"] for s in recipe.stages] == [512, 512, 1024, 2048]
    assert [s.train["rope_theta"] for s in recipe.stages] == [1000, 1000, 4000, 16000]
    # the copy curriculum keeps its learning rate: the circuit forms late in the stage
    assert recipe.stages[0].train["lr_schedule"] == "constant"
    assert recipe.nproc_per_node == 2
    assert all(s.train["mixed_precision"] == "fp32" for s in recipe.stages)


def _run(path: str, root: str) -> list[dict]:
    """In a gloo worker: load and run the recipe (nproc 1 runs the stages in this process)."""
    from easy_context.recipes.runner import run_recipe

    return run_recipe(load_recipe(path, output_root=root))


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))
            if p.is_file()}


# ~5 s on an idle 2-core machine (~40 s under load ~15): three tiny trainings and a resume
def test_resume_skips_finished_stages_and_continues_an_interrupted_one(tmp_path, dist1):
    tiny_model_dir(tmp_path / "base_model")
    tiny_dataset_dir(tmp_path / "data_32", seq_length=32, rows=16)
    path = str(_write(tmp_path, {"name": "resume", "nproc_per_node": 1, "defaults": TRAIN,
                                 "stages": [
                                     {"name": "one", "model": "base_model", "dataset": "data_32",
                                      "rope_theta": 10000},
                                     {"name": "two", "dataset": "data_32", "rope_theta": 40000},
                                     {"name": "rope", "set_rope_theta": 1e6}]}))
    root = str(tmp_path)
    out = tmp_path / "output"
    first = dist1.run(_run, path, root)[0]
    assert [s["stage"] for s in first] == ["one", "two", "rope"]
    assert all((out / s / "stage_done.json").exists() for s in ("one", "two", "rope"))
    config = json.loads((out / "rope" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1e6
    two_metrics = (out / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(two_metrics) == 4

    # Everything finished: a rerun touches no file and returns the saved summaries.
    before = _snapshot(out)
    assert dist1.run(_run, path, root)[0] == json.loads(json.dumps(first))
    assert _snapshot(out) == before

    # Interrupt stage "two" after its step-3 log line: the last checkpoint is step 2's, no done
    # marker, no export, no step 4 (neither its checkpoint nor its log line).
    ckpt = out / "two" / "checkpoints"
    assert (ckpt / "step_0000002").is_dir()
    shutil.rmtree(ckpt / "step_0000004")
    (out / "two" / "metrics.jsonl").write_text("".join(l + "\n" for l in two_metrics[:3]))
    (ckpt / "latest").write_text("step_0000002")
    shutil.rmtree(out / "two" / "final_model")
    for name in ("two", "rope"):
        os.remove(out / name / "stage_done.json")
    one_before = {k: v for k, v in _snapshot(out).items() if k.startswith("one/")}

    again = dist1.run(_run, path, root)[0]
    assert [s["stage"] for s in again] == ["one", "two", "rope"]
    assert {k: v for k, v in _snapshot(out).items() if k.startswith("one/")} == one_before
    resumed = (out / "two" / "metrics.jsonl").read_text().splitlines()
    # Steps 1-2 are the lines written before the interruption (a restart would rewrite them
    # with new timings); steps 3-4 are recomputed from the checkpoint and match the first run.
    assert resumed[:2] == two_metrics[:2]
    assert len(resumed) == len(two_metrics) == 4  # the resumed stage wrote its steps 3-4
    assert (ckpt / "step_0000004").is_dir()  # ... and trained them: it saved step 4 again
    for old, new in zip(two_metrics[2:], resumed[2:]):
        old, new = json.loads(old), json.loads(new)
        assert new["step"] == old["step"]
        assert abs(new["loss"] - old["loss"]) <= 1e-5 * abs(old["loss"])
    assert (out / "two" / "final_model" / "model.safetensors").exists()
    assert (out / "rope" / "stage_done.json").exists()
