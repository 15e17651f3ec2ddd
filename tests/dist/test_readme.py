"""Every code block of the README runs as written, so the examples cannot drift from the code.

- ``python`` blocks run on 2 gloo ranks (the session's pool), each in a fresh namespace that
  holds ``path``: a small Hugging Face causal LM folder with its tokenizer (what the README's
  examples call a model folder).
- ``bash`` blocks run in order in one folder (later blocks use what earlier ones wrote) that
  holds the same model as ``model/``; ``easy-context`` is this interpreter's CLI.
- A block right after ``<!-- readme-test: skip: <why> -->`` is not run (only the set-up
  commands, which CI runs itself: .ci/run and tests/dist/test_install.py).
A block passes when it finishes without an error (bash: ``set -euo pipefail``); the
examples assert what they show where that is cheap (e.g. sequence-parallel output equals
one-process attention).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip: [^>]+-->\s*$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[tuple[str, str, int, bool]]:
    """(language, code, line number, skipped) for every fenced block of the README."""
    text = README.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        line = text.count("\n", 0, m.start()) + 1
        blocks.append((m.group(1), m.group(2), line, bool(SKIP.search(before))))
    return blocks


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    assert blocks
    for lang, code, line, skipped in blocks:
        # text blocks are not code (the layout tree); every other block is run
        assert lang in ("python", "bash", "text"), f"README line {line}: ```{lang}"
    skipped = [line for _, _, line, s in blocks if s]
    assert len(skipped) == 1, f"only the set-up commands may be skipped, not lines {skipped}"


def _restore_class_patches() -> None:
    """apply_seq_parallel_monkey_patch(seq_algo, "llama") patches a transformers class for
    the whole process; the pool's ranks outlive the example, so undo it."""
    import transformers

    for name in dir(transformers):
        cls = getattr(transformers, name, None)
        original = isinstance(cls, type) and cls.__dict__.get("_easy_context_original_post_init")
        if original:
            cls.post_init = original
            del cls._easy_context_original_post_init


def run_python_block(code: str, model_dir: str, line: int) -> None:
    namespace = {"__name__": f"readme_line_{line}", "path": model_dir}
    try:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
    finally:
        _restore_class_patches()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from tests.train_fixtures import tiny_model_with_tokenizer

    work = tmp_path_factory.mktemp("readme")
    tiny_model_with_tokenizer(work / "model")
    return work


PYTHON = [(code, line) for lang, code, line, skipped in readme_blocks()
          if lang == "python" and not skipped]
BASH = [(code, line) for lang, code, line, skipped in readme_blocks()
        if lang == "bash" and not skipped]


@pytest.mark.parametrize("code,line", PYTHON, ids=[f"line{line}" for _, line in PYTHON])
def test_python_block_on_2_ranks(dist2, workdir, code, line):
    dist2.run(run_python_block, code, str(workdir / "model"), line)


@pytest.mark.slow  # every shell example in order: a few short training runs and evals
def test_bash_blocks_in_order(workdir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(README.parent), os.environ.get("PYTHONPATH")]))}
    # The README's commands call `easy-context`; here it is this interpreter's CLI, so the
    # checkout under test runs whether or not its console script is on PATH.
    prelude = f'easy-context() {{ "{sys.executable}" -m easy_context.cli "$@"; }}\n'
    for code, line in BASH:
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + code], cwd=workdir,
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"README.md:{line} failed:\n{code}\n{run.stderr[-4000:]}"


def shown_plan_outputs() -> list[tuple[str, str, int]]:
    """(command, the output line the README shows after it, line number): an
    `easy-context plan` line followed by a `# longest sequence that fits: ...` comment."""
    shown = []
    for lang, code, line, _ in readme_blocks():
        if lang != "bash":
            continue
        lines = code.splitlines()
        for i, cmd in enumerate(lines):
            if not cmd.startswith("easy-context plan"):
                continue
            for later in lines[i + 1:]:
                if not later.startswith("#"):
                    break
                if later.startswith("# longest sequence that fits:"):
                    shown.append((cmd, later[2:].strip(), line + 1 + i))
    return shown


@pytest.mark.parametrize("cmd,expected,line", shown_plan_outputs(),
                         ids=[f"line{line}" for _, _, line in shown_plan_outputs()])
def test_shown_plan_output_is_current(cmd, expected, line):
    """The planner's answer the README prints under its command is what the command prints
    today (it drifted once when the planner changed)."""
    from easy_context.cli import main

    argv = shlex.split(cmd.split("#", 1)[0])[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert expected in out.getvalue().splitlines(), (
        f"README.md:{line} shows {expected!r}; the command prints:\n{out.getvalue()[-800:]}")
