"""Every code block of the README and of the documentation site (docs/, in the order of
mkdocs.yml's navigation) runs as written, so the examples cannot drift from the code.

- ``python`` blocks run on 2 gloo ranks (the session's pool), each in a fresh namespace that
  holds ``path``: a small Hugging Face causal LM folder with its tokenizer (what the README's
  examples call a model folder).
- ``bash`` blocks run in order in one folder (later blocks use what earlier ones wrote, page
  after page) that holds the same model as ``model/``; ``easy-context`` is this
  interpreter's CLI. A section whose heading is followed by ``<!-- readme-test: own folder
  -->`` says its blocks start from nothing: they run in order in a folder of their own,
  beside the others (two chains of processes on two cores take less wall time than one
  after the other).
- A block right after ``<!-- readme-test: skip: <why> -->`` is not run: the set-up commands
  (CI runs them itself: .ci/run and tests/dist/test_install.py), the 8-GPU recipe run, and
  the site build (tests/unit/test_docs_site.py).
A block passes when it finishes without an error (bash: ``set -euo pipefail``) and without a
C++ abort on its way out (issue 45: "terminate called without an active exception" once after
a finished 2-rank eval-needle; the bash blocks run ~10 two-rank commands, eval-needle among
them, so they are that check too); the examples assert what they show where that is cheap
(e.g. sequence-parallel output equals one-process attention).
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

REPO = Path(__file__).resolve().parents[2]
# The environment before any test ran (collection imports this module first): the shell
# commands run as a user's shell would, not with what in-process tests set since (the
# one-process trainer sets RANK, WORLD_SIZE, MASTER_PORT, the allocator's MALLOC_*, ...).
START_ENV = dict(os.environ)
README = REPO / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip: [^>]+-->\s*$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MAX_SKIPPED = 5  # the set-up commands, the 8-GPU recipe run, the site build, TRL's vision
# SFT example (a VLM checkpoint, its processor and an image dataset; test_trainer_vlm.py runs it)
# and the CLI's image-conversation commands (a VLM folder and images; test_train_vision.py)


def doc_files() -> list[Path]:
    """The README, then every page of the site in its navigation order."""
    import yaml

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (pages(value) if isinstance(value, list) else [value])

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [README] + [REPO / "docs" / page for page in pages(nav)]


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def readme_blocks() -> list[tuple[str, str, str, int, bool]]:
    """(file, language, code, line number, skipped) for every fenced block of every file."""
    blocks = []
    for path in doc_files():
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((_name(path), m.group(1), m.group(2), line, bool(SKIP.search(before))))
    return blocks


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    assert {f for f, *_ in blocks} >= {"README.md", "docs/guides/attention.md"}
    for file, lang, code, line, skipped in blocks:
        # text blocks are not code (the layout tree); every other block is run
        assert lang in ("python", "bash", "text"), f"{file}:{line}: ```{lang}"
    skipped = [f"{f}:{line}" for f, _, _, line, s in blocks if s]
    assert len(skipped) <= MAX_SKIPPED, f"blocks not run, each with a reason: {skipped}"


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


def run_python_block(code: str, model_dir: str, where: str) -> None:
    namespace = {"__name__": re.sub(r"\W", "_", where), "path": model_dir}
    try:
        exec(compile(code, where, "exec"), namespace)
    finally:
        _restore_class_patches()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from tests.train_fixtures import tiny_model_with_tokenizer

    work = tmp_path_factory.mktemp("readme")
    tiny_model_with_tokenizer(work / "model")
    return work


PYTHON = [(code, f"{file}:{line}") for file, lang, code, line, skipped in readme_blocks()
          if lang == "python" and not skipped]
BASH = [(file, code, line) for file, lang, code, line, skipped in readme_blocks()
        if lang == "bash" and not skipped]
OWN_FOLDER = "<!-- readme-test: own folder -->"
HEADING = r"^#{1,2} .+"  # a page's title or a section


def cpp_abort(stderr: str) -> bool:
    """What a process that exits with gloo threads still running prints (std::terminate, then
    SIGABRT; easy_context.launch.teardown prevents it), whatever the exit status."""
    return any("terminate called" in line or line.strip() == "Aborted"
               or "Aborted (core dumped)" in line for line in stderr.splitlines())


def bash_chains() -> dict[str, list[tuple[str, int]]]:
    """The bash blocks by the folder they run in: "main", or "file: heading" of a section
    marked as starting from nothing; each list in file and line order."""
    own, starts = {}, {}  # (file, line where a section starts) -> heading; file -> starts
    for path in doc_files():
        # headings outside code blocks only (a shell comment starts with "# " too); the
        # blocks' lines are kept as empty lines, so line numbers stay the file's
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
        name = _name(path)
        for m in re.finditer(r"^(#{1,2} .+)\n+" + re.escape(OWN_FOLDER), text, re.M):
            own[(name, text.count("\n", 0, m.start()) + 1)] = f"{name}: {m.group(1)}"
        starts[name] = [text.count("\n", 0, m.start()) + 1
                        for m in re.finditer(HEADING, text, re.M)]
    chains: dict[str, list[tuple[str, int]]] = {}
    for file, code, line in BASH:
        start = max((a for a in starts[file] if a < line), default=0)
        chains.setdefault(own.get((file, start), "main"), []).append((code, f"{file}:{line}"))
    return chains


@pytest.mark.parametrize("code,where", PYTHON, ids=[where for _, where in PYTHON])
def test_python_block_on_2_ranks(dist2, workdir, code, where):
    dist2.run(run_python_block, code, str(workdir / "model"), where)


@pytest.mark.slow  # every shell example in order: a few short training runs and evals
def test_bash_blocks_in_order(workdir):
    from concurrent.futures import ThreadPoolExecutor

    # this interpreter's scripts (accelerate, torchrun) first on PATH: a venv's python run
    # without activating the venv otherwise launches another installation's
    env = {**START_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(README.parent), START_ENV.get("PYTHONPATH")])),
        "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent),
                                              START_ENV.get("PATH")]))}
    # The README's commands call `easy-context`; here it is this interpreter's CLI, so the
    # checkout under test runs whether or not its console script is on PATH.
    prelude = f'easy-context() {{ "{sys.executable}" -m easy_context.cli "$@"; }}\n'
    chains = bash_chains()
    assert "main" in chains and sum(map(len, chains.values())) == len(BASH)

    def run_chain(name: str) -> str | None:
        """The first failure of the chain's blocks, run in order, or None."""
        cwd = workdir if name == "main" else workdir / re.sub(r"\W+", "-", name).strip("-")
        cwd.mkdir(exist_ok=True)
        # the README's commands name the repository's examples/ from its root
        if not (cwd / "examples").exists():
            (cwd / "examples").symlink_to(REPO / "examples")
        for code, where in chains[name]:
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + code], cwd=cwd,
                                 env=env, capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                # a failing rank's error can sit above the launcher's long epilogue
                errors = [l for l in run.stderr.splitlines() if "Error" in l][:20]
                return (f"{where} failed:\n{code}\n" + "\n".join(errors) +
                        f"\n...\n{run.stderr[-4000:]}")
            if cpp_abort(run.stderr):
                return f"{where} exited 0 but aborted on its way out:\n{run.stderr[-4000:]}"
        return None

    with ThreadPoolExecutor(len(chains)) as pool:
        failures = [f for f in pool.map(run_chain, chains) if f]
    assert not failures, "\n\n".join(failures)


def test_marked_sections_hold_bash_blocks():
    """A section marked as starting from nothing holds bash blocks (the marker is where the
    test looks, right under the heading), and each chain keeps the files' order."""
    marked = sum(p.read_text().count(OWN_FOLDER) for p in doc_files())
    chains = bash_chains()
    assert marked >= 1 and len(chains) == 1 + marked, (marked, list(chains))
    for path in doc_files():  # a page marked under its title: all its blocks in its chain
        text = path.read_text()
        if re.match(r"# .+\n+" + re.escape(OWN_FOLDER), text):
            mine = [w for f, _, w in ((f, c, f"{f}:{n}") for f, c, n in BASH) if f == _name(path)]
            title = f"{_name(path)}: {text.splitlines()[0]}"
            assert [w for _, w in chains[title]] == mine, (title, mine)
    order = {_name(p): i for i, p in enumerate(doc_files())}
    for blocks in chains.values():
        keys = [(order[w.rsplit(":", 1)[0]], int(w.rsplit(":", 1)[1])) for _, w in blocks]
        assert keys == sorted(keys)


def shown_plan_outputs() -> list[tuple[str, str, str]]:
    """(command, the output line shown after it, file:line): an `easy-context plan` command
    (continued with backslashes) followed by a `# longest sequence that fits: ...` comment."""
    shown = []
    for file, lang, code, line, _ in readme_blocks():
        if lang != "bash":
            continue
        lines = code.splitlines()
        for i, cmd in enumerate(lines):
            if not cmd.startswith("easy-context plan"):
                continue
            j = i
            while lines[j].endswith("\\"):
                j += 1
                cmd = cmd[:-1] + " " + lines[j].strip()
            for later in lines[j + 1:]:
                if not later.startswith("#"):
                    break
                if later.startswith("# longest sequence that fits:"):
                    shown.append((cmd, later[2:].strip(), f"{file}:{line + 1 + i}"))
    return shown


SHOWN_PLANS = shown_plan_outputs()


@pytest.mark.parametrize("cmd,expected,where", SHOWN_PLANS,
                         ids=[where for _, _, where in SHOWN_PLANS])
def test_shown_plan_output_is_current(cmd, expected, where):
    """The planner's answer shown under its command is what the command prints today (it
    drifted once when the planner changed)."""
    from easy_context.cli import main

    argv = shlex.split(cmd.split("#", 1)[0])[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert expected in out.getvalue().splitlines(), (
        f"{where} shows {expected!r}; the command prints:\n{out.getvalue()[-800:]}")


def test_cpp_abort_is_recognised():
    """The bash blocks' exit check (issue 45's text; a rank's line can sit after another's)."""
    assert cpp_abort("average score 0.5\nterminate called without an active exception\n")
    assert cpp_abort("rank 0 done\n[rank1] terminate called without an active exception")
    assert cpp_abort("Aborted (core dumped)\n") and cpp_abort("Aborted\n")
    assert not cpp_abort("step 2 loss 3.1\nAbortedRunError is not raised here\n")
