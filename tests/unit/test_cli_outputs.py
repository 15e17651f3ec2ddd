"""``--output-dir`` wherever a command writes a folder (the old flag names still work):
train and eval-needle had it; demo (--output), recipe (--output-root), eval-ppl (writes
DIR/ppl.csv; --output-file) and plot-ppl (--output) gained it."""

from __future__ import annotations

import csv

import datasets
import pytest

from easy_context.cli import build_parser, main
from tests.unit.eval_fixtures import random_model_dir


def _parse(*argv: str):
    return build_parser(only=argv[0]).parse_args(list(argv))


@pytest.mark.parametrize("command", ["train", "eval-needle", "demo", "recipe"])
def test_every_folder_writing_command_takes_output_dir(command):
    extra = {"train": [], "eval-needle": ["--model", "m"], "demo": [], "recipe": ["r.yaml"]}
    args = _parse(command, *extra[command], "--output-dir", "somewhere")
    dest = {"demo": "output", "recipe": "output_root"}.get(command, "output_dir")
    assert getattr(args, dest) == "somewhere"


def test_old_names_still_work():
    assert _parse("demo", "--output", "d").output == "d"
    assert _parse("recipe", "r.yaml", "--output-root", "o").output_root == "o"


def test_recipe_output_dir_roots_the_stages(tmp_path, capsys):
    from easy_context.recipes.cli import recipe_path
    from easy_context.recipes.recipe import load_recipe

    for flag in ("--output-dir", "--output-root"):
        args = _parse("recipe", "tiny_cpu_demo", "--dry-run", flag, str(tmp_path))
        recipe = load_recipe(recipe_path(args.recipe), args.output_root)
        assert all(s.output_dir.is_relative_to(tmp_path) for s in recipe.stages)
        assert main(["recipe", "tiny_cpu_demo", "--dry-run", flag, str(tmp_path)]) == 0
        assert f"{len(recipe.stages)} stages on" in capsys.readouterr().out


@pytest.fixture(scope="module")
def ppl_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    model = random_model_dir(root / "model")
    (model / "tokenizer.json").unlink()  # --tokenized data needs no tokenizer
    (model / "tokenizer_config.json").unlink()
    ids = [[(7 * i) % 250 + 3 for i in range(160)]] * 2
    datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(str(root / "tokens"))
    return model, root / "tokens"


def test_eval_ppl_output_dir_and_plot_ppl_output_dir(ppl_inputs, tmp_path, capsys):
    model, tokens = ppl_inputs
    out = tmp_path / "results"
    argv = ["eval-ppl", "--model", str(model), "--tokenized", str(tokens), "--min-tokens", "64",
            "--max-tokens", "128", "--tokens-step", "64", "--output-dir", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    rows = list(csv.DictReader((out / "ppl.csv").open()))
    assert [r["context_length"] for r in rows] == ["64", "128"]
    assert all(float(r["ppl"]) > 1 for r in rows)
    assert main(["plot-ppl", str(out / "ppl.csv"), "--output-dir", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "ppl.png").read_bytes()[:4] == b"\x89PNG"
