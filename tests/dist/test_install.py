"""The package as a user installs it (``pip install .``, not ``-e``): a wheel built from this
checkout must hold every file the package reads at run time (the bundled recipes, the
DeepSpeed config), and the demo must run from the installed wheel, in a folder away from
the checkout. (An editable install reads the checkout, so the other tests cannot see a
file missing from the wheel.) The quick demo is the CI version of the README's main job: the
real pipeline (tokenizer, model, corpora, 2-rank recipe stages, needle and ppl evals,
report) with a few steps per stage; it must write every artifact of the report, and a rerun
must find every phase done."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.venvs import venv_seeing_this_environment

REPO = Path(__file__).resolve().parents[2]


def _package_files() -> set[str]:
    root = REPO / "easy_context"
    return {str(p.relative_to(REPO)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (building in place would leave build/ and
    an egg-info folder in it)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "easy_context", src / "easy_context",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"),
           str(src)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(4, "--no-build-isolation")  # no download of setuptools when it is here
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (found,) = (root / "dist").glob("easy_context-*.whl")
    return found


def test_wheel_holds_every_package_file(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = _package_files() - names
    assert not missing, f"files of the package missing from the wheel: {sorted(missing)}"
    assert "easy_context/recipes/configs/tiny_cpu_demo.yaml" in names  # the demo's recipe


@pytest.mark.slow  # the quick demo: ~75 s on an idle 2-core machine, a few minutes loaded
def test_demo_runs_from_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = venv_seeing_this_environment(venv)
    # The package itself only from the wheel; --ignore-installed: never touch the editable
    # install the venv can see.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    where = subprocess.run([str(python), "-c", "import easy_context; print(easy_context.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    out = elsewhere / "demo"
    cmd = [str(venv / "bin" / "easy-context"), "demo", "--quick", "--output-dir", str(out)]
    run = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=840)
    assert run.returncode == 0, run.stderr[-4000:]
    _check_quick_demo(out)

    # Rerun: every stage is skipped (its outputs untouched) and the evals are reused.
    stage_files = sorted((out / "output").rglob("*"))
    mtimes = {p: p.stat().st_mtime_ns for p in stage_files if p.is_file()}
    again = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "done, skipped" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert "phase eval" not in again.stderr  # the saved evals are reused


def _check_quick_demo(out: Path) -> None:
    """Every artifact of the report, the recipe's stages in order, and the models the two
    evals read: "before" is the last stage at the first length and theta, "after" the last."""
    from easy_context.demo.report import ARTIFACTS
    from easy_context.demo.run import bundled_recipe_path
    from easy_context.recipes.recipe import load_recipe

    for name in ARTIFACTS:
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in (n for n in ARTIFACTS if n.endswith(".png")):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    assert "Quick run" in report
    for section in ("## Targets", "## Needle accuracy", "## Perplexity",
                    "## RULER tasks by context length", "## Training stages", "## Time"):
        assert section in report
    stages = load_recipe(bundled_recipe_path(), output_root=out).stages
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == [s.name for s in stages]
    assert set(summary["evals"]) == {"before", "after"}
    from easy_context.demo.run import DemoSettings

    quick = DemoSettings.quick().eval
    for label in ("before", "after"):  # RULER's table: every task at every length, scored
        cells = {(r["task"], r["length"]) for r in summary["evals"][label]["ruler"]}
        assert cells == {(t, n) for t in quick.ruler_tasks for n in quick.ruler_lengths}
        assert all(0 <= r["score"] <= 100 for r in summary["evals"][label]["ruler"])
    first = [s for s in stages if s.train["seq_length"] == stages[0].train["seq_length"]][-1]
    before = json.loads((out / "eval" / "needle_before.json").read_text())["config"]
    assert first.name in before["model_dir"]
    assert before["rope_parameters"]["rope_theta"] == first.train["rope_theta"]
    needle = json.loads((out / "eval" / "needle_after.json").read_text())
    assert max(c["context_length"] for c in needle["cells"]) == stages[-1].train["seq_length"]
    assert needle["config"]["rope_parameters"]["rope_theta"] == stages[-1].train["rope_theta"]


def test_the_wheel_venv_sees_a_venvs_packages(tmp_path):
    """The wheel test's venv made from inside a venv (how most people run the README) sees
    that venv's packages, not only the base Python's (``--system-site-packages`` gave the
    base's: no torch there in a plain venv): a module installed in the outer venv alone and
    torch import there, while the inner venv's own site-packages come first."""
    outer = venv_seeing_this_environment(tmp_path / "outer")  # a venv, like a user's
    # a package installed in that venv only (the base Python has none of it)
    outer_site = subprocess.run([str(outer), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    Path(outer_site, "only_in_the_outer_venv.py").write_text("WHERE = __file__\n")
    script = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
              "from tests.venvs import venv_seeing_this_environment as make;"
              "print(make(Path(sys.argv[2])))")
    made = subprocess.run([str(outer), "-c", script, str(REPO), str(tmp_path / "inner")],
                          check=True, capture_output=True, text=True, timeout=300)
    inner = Path(made.stdout.strip().splitlines()[-1])
    probe = ("import sys, sysconfig, torch, transformers, only_in_the_outer_venv; "
             "print(sysconfig.get_paths()['purelib']); print(torch.__file__); "
             "print('\\n'.join(sys.path))")
    seen = subprocess.run([str(inner), "-c", probe], cwd=tmp_path, check=True,
                          capture_output=True, text=True, timeout=300).stdout.splitlines()
    own, torch_file, path = seen[0], seen[1], seen[2:]
    assert Path(own).is_relative_to(tmp_path / "inner"), own
    assert not Path(torch_file).is_relative_to(tmp_path), torch_file  # this environment's torch
    sites = [p for p in path if p.endswith("-packages")]
    assert sites[0] == own, sites  # the venv's own packages first
