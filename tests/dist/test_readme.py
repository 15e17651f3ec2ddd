"""Every code block of the README runs as written, so the examples cannot drift from the code.

- ``python`` blocks run on 2 gloo ranks (the session's pool), each in a fresh namespace that
  holds ``path``: a small Hugging Face causal LM folder with its tokenizer (what the README's
  examples call a model folder).
- ``bash`` blocks run in order in one folder (later blocks use what earlier ones wrote) that
  holds the same model as ``model/``; ``easy-context`` is this interpreter's CLI. A section
  whose heading is followed by ``<!-- readme-test: own folder -->`` says its blocks start
  from nothing: they run in order in a folder of their own, beside the others (two chains
  of processes on two cores take less wall time than one after the other).
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
    # Only the model modules already imported (a patched class is in one): getattr on every
    # name of the transformers package would import all of its models (~20 s).
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for cls in list(vars(module).values()):
            original = (isinstance(cls, type)
                        and cls.__dict__.get("_easy_context_original_post_init"))
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
OWN_FOLDER = "<!-- readme-test: own folder -->"


def bash_chains() -> dict[str, list[tuple[str, int]]]:
    """The bash blocks by the folder they run in: "main", or the heading of a section marked
    as starting from nothing; each list in README order."""
    text = README.read_text()
    own = {}  # line where a marked section starts -> its heading
    for m in re.finditer(r"^(## .+)\n+" + re.escape(OWN_FOLDER), text, re.M):
        own[text.count("\n", 0, m.start()) + 1] = m.group(1)
    starts = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(r"^## .+", text, re.M)]
    chains: dict[str, list[tuple[str, int]]] = {}
    for code, line in BASH:
        start = max((a for a in starts if a < line), default=0)
        chains.setdefault(own.get(start, "main"), []).append((code, line))
    return chains


@pytest.mark.parametrize("code,line", PYTHON, ids=[f"line{line}" for _, line in PYTHON])
def test_python_block_on_2_ranks(dist2, workdir, code, line):
    dist2.run(run_python_block, code, str(workdir / "model"), line)


@pytest.mark.slow  # every shell example in order: a few short training runs and evals
def test_bash_blocks_in_order(workdir):
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(README.parent), os.environ.get("PYTHONPATH")]))}
    # The README's commands call `easy-context`; here it is this interpreter's CLI, so the
    # checkout under test runs whether or not its console script is on PATH.
    prelude = f'easy-context() {{ "{sys.executable}" -m easy_context.cli "$@"; }}\n'
    chains = bash_chains()
    assert "main" in chains and sum(map(len, chains.values())) == len(BASH)

    def run_chain(name: str) -> str | None:
        """The first failure of the chain's blocks, run in order, or None."""
        cwd = workdir if name == "main" else workdir / re.sub(r"\W+", "-", name).strip("-")
        cwd.mkdir(exist_ok=True)
        for code, line in chains[name]:
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + code], cwd=cwd,
                                 env=env, capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                return f"README.md:{line} failed:\n{code}\n{run.stderr[-4000:]}"
        return None

    with ThreadPoolExecutor(len(chains)) as pool:
        failures = [f for f in pool.map(run_chain, chains) if f]
    assert not failures, "\n\n".join(failures)


def test_marked_sections_hold_bash_blocks():
    """A section marked as starting from nothing holds bash blocks (the marker is where the
    test looks, right under the heading), and each chain keeps the README's order."""
    text = README.read_text()
    marked = text.count(OWN_FOLDER)
    chains = bash_chains()
    assert len(chains) == 1 + marked, (marked, list(chains))
    for blocks in chains.values():
        assert [line for _, line in blocks] == sorted(line for _, line in blocks)


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


SHOWN_PLANS = shown_plan_outputs()


@pytest.mark.parametrize("cmd,expected,line", SHOWN_PLANS,
                         ids=[f"line{line}" for _, _, line in SHOWN_PLANS])
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
