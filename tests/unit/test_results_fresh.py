"""Every benchmark results file is from today's code, or benchmarks/results/STALE.json says
why it is not.

A results file (benchmarks/results/*.json) records the commit it was measured at and the CPU
(``machine``: ``git_commit``, ``cpu``; benchmarks/common.py machine_info). The benchmark that
wrote it names, in its module-level ``MEASURES`` list, the repository paths whose change makes
its figures stale. A file is stale when:

- it records no commit or no CPU model (in any of its machine records);
- a commit it records is not in this checkout's history (HEAD does not descend from it);
- a path in ``MEASURES`` changed after a commit it records: in a commit HEAD has and that one
  has not, or uncommitted in the working tree (what the tests are running against). For a
  Python file the change must be to its code: comments and docstrings are left out of the
  comparison (:func:`code_of`), since mending a comment changes no figure.

A stale file must be listed in STALE.json ``{"file.json": "why, and what re-running it
needs"}``; the entry of a file that records no commit or no CPU model says so in those words
("records no commit", "records no CPU model"). An entry whose file is no longer stale (or gone)
fails too, so the registry cannot rot. Re-run the benchmark and remove the entry, or add the
entry; the failure message gives the reason to start from.

A run on an uncommitted tree records the commit below the code it ran: once that code is
committed, its change comes after the recorded commit and the file is stale. Measure after
committing the code, or record the commit that holds it (as the gpu_check_h200 files do).

The decision itself (:func:`why_stale`, :func:`registry_problems`) takes the git question as
a function, and is tested below with a made-up history; the git questions themselves on a
scratch repository. Needs a full git checkout: skipped in an exported tree or a shallow clone
(recorded commits would be missing, not stale).
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
REGISTRY = RESULTS / "STALE.json"

# results/<name>.json is written by benchmarks/<name>.py (its default output name). The files
# written under another name (``--output``) and the script that wrote each:
WRITTEN_BY = {
    "all_to_all_avx2.json": "all_to_all.py",
    "all_to_all_xeon.json": "all_to_all.py",
    "all_to_all_xeon_avx2.json": "all_to_all.py",
    "attention_sliding.json": "attention.py",
    "attention_ulysses_deepspeed_epyc.json": "attention.py",
    "attention_ulysses_deepspeed_epyc_avx2.json": "attention.py",
    "attention_ulysses_deepspeed_xeon.json": "attention.py",
    "generic_backward_deepseek3.json": "generic_backward.py",
    "generic_backward_llama3.json": "generic_backward.py",
    "gpu_check_h200_cudnn.json": "gpu_check.py",
    "gpu_check_h200_first.json": "gpu_check.py",
    "gpu_check_h200_first_methods.json": "gpu_check.py",
    "gpu_check_h200_offload_fix.json": "gpu_check.py",
    "hf_trainer_2k_maxlen.json": "hf_trainer.py",
    "hf_trainer_2k_repeats.json": "hf_trainer.py",
}

NO_COMMIT = "records no commit"
NO_CPU = "records no CPU model"

# changed_since(commit, measures) -> None when none of those paths changed after that commit,
# else one line saying what changed (or that the commit is not in the history)
ChangedSince = Callable[[str, tuple], "str | None"]


# ------------------------------------------------------------------------------ the decision
def machine_records(data) -> list[dict]:
    """The machine records of a results file: the dicts under a key ``machine`` or
    ``*_machine``, at any depth (a file merged from several runs has one per run)."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            if (key == "machine" or key.endswith("_machine")) and isinstance(value, dict):
                found.append(value)
            found.extend(machine_records(value))
    elif isinstance(data, list):
        for value in data:
            found.extend(machine_records(value))
    return found


def recorded_commits(data) -> list[str]:
    """The commits a results file records, each once, in the order they appear."""
    return list(dict.fromkeys(r["git_commit"] for r in machine_records(data)
                              if r.get("git_commit")))


def why_stale(data, measures: Iterable[str], changed_since: ChangedSince) -> str | None:
    """Why the figures in ``data`` (a results file's JSON) may not be today's code's, in one
    line; None when they are: every machine record names its commit and CPU, and no path in
    ``measures`` changed after any commit recorded."""
    records = machine_records(data)
    reasons = []
    if not records or any(not r.get("git_commit") for r in records):
        reasons.append(NO_COMMIT)
    if not records or any(not r.get("cpu") for r in records):
        reasons.append(NO_CPU)
    paths = tuple(sorted(set(measures)))
    for commit in recorded_commits(data):
        change = changed_since(commit, paths)
        if change:
            reasons.append(f"measured at {commit}: {change}")
    return "; ".join(reasons) or None


def registry_problems(stale: dict[str, str | None], registry: dict[str, str]) -> list[str]:
    """What is wrong between the results files' verdicts (name -> reason, None when fresh)
    and STALE.json's entries (name -> reason given)."""
    problems = []
    for name, why in sorted(stale.items()):
        if why and name not in registry:
            problems.append(f"{name} is stale and not in STALE.json: {why}")
    for name, entry in sorted(registry.items()):
        if name not in stale:
            problems.append(f"{name} is in STALE.json but there is no such results file")
        elif not stale[name]:
            problems.append(f"{name} is in STALE.json but is fresh now: remove its entry")
        else:
            for missing in (NO_COMMIT, NO_CPU):
                if missing in stale[name] and missing.lower() not in entry.lower():
                    problems.append(f"{name} {missing}, and its STALE.json entry does not say "
                                    f"so ('{missing}')")
    return problems


# ------------------------------------------------------------------------------ the repository
def writer(name: str) -> Path:
    return BENCHMARKS / WRITTEN_BY.get(name, Path(name).stem + ".py")


@lru_cache(maxsize=None)
def declared_measures(script: Path) -> tuple[str, ...] | None:
    """The script's module-level ``MEASURES`` list, read from its source (no import: the
    scripts import torch), or None when it has none."""
    for node in ast.parse(script.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "MEASURES" for t in targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value), \
                f"{script.name}: MEASURES must be a literal list of paths"
            return tuple(value)
    return None


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.json") if p != REGISTRY)


def _git(*args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)


def _git_usable() -> str | None:
    """Why the history cannot be asked, or None."""
    if shutil.which("git") is None:
        return "git is not installed"
    if not (REPO / ".git").exists():
        return ("no .git: an exported tree has no history to check the commits that results "
                "files record against")
    shallow = _git("rev-parse", "--is-shallow-repository")
    if shallow.returncode:
        return f"git cannot read this checkout: {shallow.stderr.strip()[:200]}"
    if shallow.stdout.strip() == "true":
        return "a shallow clone: the commits results files record may be missing from it"
    return None


def code_of(source: str | None) -> str | None:
    """A Python module's code as ``ast.dump`` gives it, docstrings left out (comments are not
    in the tree); None for no file or one that does not parse."""
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _under(path: str, measures: tuple[str, ...]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in measures)


def _listing(paths: list[str], most: int = 4) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


class GitHistory:
    """changed_since() from this checkout: one ``git status`` in all, one ``merge-base`` per
    recorded commit, one ``git log`` per (commit, MEASURES)."""

    def __init__(self, repo: Path = REPO):
        self.repo = repo
        status = _git("status", "--porcelain=v1", "-z", "--untracked-files=all", repo=repo)
        assert status.returncode == 0, status.stderr
        entries = status.stdout.split("\0")
        self.dirty: list[str] = []
        i = 0
        while i < len(entries):
            entry = entries[i]
            if len(entry) > 3:
                self.dirty.append(entry[3:])
                if entry[0] in "RC":  # a rename's source follows it
                    i += 1
                    self.dirty.append(entries[i])
            i += 1
        self.head = _git("rev-parse", "--short", "HEAD", repo=repo).stdout.strip()

    @lru_cache(maxsize=None)
    def in_history(self, commit: str) -> bool:
        return _git("merge-base", "--is-ancestor", commit, "HEAD", repo=self.repo).returncode == 0

    def _at(self, commit: str, path: str) -> str | None:
        """The file's text at ``commit``, or None where it did not exist."""
        shown = _git("show", f"{commit}:{path}", repo=self.repo)
        return shown.stdout if shown.returncode == 0 else None

    def _now(self, path: str) -> str | None:
        try:
            return (self.repo / path).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    @lru_cache(maxsize=None)
    def code_changed(self, commit: str, path: str) -> bool:
        """Whether what runs changed: for a Python file, its code without comments and
        docstrings (so mending a comment leaves the figures fresh); any other file, its text."""
        before, now = self._at(commit, path), self._now(path)
        if path.endswith(".py"):
            return code_of(before) is None or code_of(before) != code_of(now)
        return before is None or before != now

    @lru_cache(maxsize=None)
    def changed_since(self, commit: str, measures: tuple[str, ...]) -> str | None:
        if not self.in_history(commit):
            return f"{commit} is not in this checkout's history (HEAD {self.head})"
        log = _git("log", "--format=%x01%h", "--name-only", f"{commit}..HEAD", "--", *measures,
                   repo=self.repo)
        assert log.returncode == 0, log.stderr
        touched: dict[str, list[str]] = {}  # commit -> the measured files it touched
        for line in log.stdout.splitlines():
            if line.startswith("\x01"):
                current = touched.setdefault(line[1:], [])
            elif line.strip():
                current.append(line)
        files = sorted({f for fs in touched.values() for f in fs
                        if f not in self.dirty and self.code_changed(commit, f)})
        commits = [c for c, fs in touched.items() if set(fs) & set(files)]
        dirty = sorted(p for p in self.dirty if _under(p, measures)
                       and self.code_changed(commit, p))
        said = []
        if commits:
            said.append(f"{_listing(sorted(files))} changed since, in {len(commits)} "
                        f"commit{'s' * (len(commits) > 1)} (newest {commits[0]})")
        if dirty:
            said.append(f"uncommitted changes to {_listing(dirty)}")
        return "; ".join(said) or None


@pytest.fixture(scope="module")
def history() -> GitHistory:
    why = _git_usable()
    if why:
        pytest.skip(why)
    return GitHistory()


# ------------------------------------------------------------------------------ the checks
def test_every_results_file_has_a_benchmark_with_measures():
    """Each results file maps to a script that exists and declares MEASURES, every path of
    which exists; WRITTEN_BY names only files that exist (it cannot rot either)."""
    problems = []
    files = {p.name for p in results_files()}
    for name in sorted(files):
        script = writer(name)
        if not script.exists():
            problems.append(f"{name}: which benchmark wrote it? benchmarks/{script.name} does not "
                            "exist: add the file to WRITTEN_BY in tests/unit/test_results_fresh.py")
            continue
        measures = declared_measures(script)
        if not measures:
            problems.append(f"{name}: benchmarks/{script.name} declares no MEASURES (the paths "
                            "whose change makes its results stale)")
            continue
        problems += [f"benchmarks/{script.name}: MEASURES names {m}, which does not exist"
                     for m in measures if not (REPO / m).exists()]
    problems += [f"WRITTEN_BY names {name}, which is not in benchmarks/results"
                 for name in WRITTEN_BY if name not in files]
    problems = list(dict.fromkeys(problems))  # a script's fault once, not once per file
    assert not problems, "\n".join(problems)


def test_stale_results_are_registered(history):
    registry = json.loads(REGISTRY.read_text()) if REGISTRY.exists() else {}
    assert isinstance(registry, dict) and all(isinstance(v, str) and v.strip()
                                              for v in registry.values()), \
        "STALE.json: an object of results file name -> a non-empty reason"
    stale, unchecked = {}, []
    for path in results_files():
        script = writer(path.name)
        measures = declared_measures(script) if script.exists() else None
        if not measures:  # test_every_results_file_has_a_benchmark_with_measures says why
            unchecked.append(path.name)
            continue
        stale[path.name] = why_stale(json.loads(path.read_text()), measures,
                                     history.changed_since)
    problems = registry_problems(stale, {k: v for k, v in registry.items() if k not in unchecked})
    assert not problems, ("results files against benchmarks/results/STALE.json:\n"
                          + "\n".join(problems))


# ------------------------------------------------------------------------------ its teeth
def _fake_history(changes: dict[str, dict[str, str]], known: set[str]) -> ChangedSince:
    """changed_since over a made-up history: ``changes[commit][path]`` = what changed that
    path after ``commit``; commits outside ``known`` are not in the history."""
    def changed_since(commit, measures):
        if commit not in known:
            return f"{commit} is not in this checkout's history"
        hits = [f"{p}: {what}" for p, what in sorted(changes.get(commit, {}).items())
                if _under(p, measures)]
        return ", ".join(hits) or None
    return changed_since


def _results(*machines) -> dict:
    return {"rows": [], "machine": machines[0],
            "runs": [{"machine": m} for m in machines[1:]]}


AMD = {"cpu": "AMD EPYC", "logical_cpus": 2}
HISTORY = _fake_history({"aaa": {"easy_context/parallel/ring.py": "ccc"},
                         "bbb": {"easy_context/attention/kernels.py": "ddd"}},
                        known={"aaa", "bbb", "ccc", "ddd"})


def test_fresh_when_nothing_measured_changed():
    data = _results({**AMD, "git_commit": "aaa"})
    assert why_stale(data, ["easy_context/attention"], HISTORY) is None
    assert why_stale(data, ["easy_context/parallel/zigzag.py"], HISTORY) is None


def test_stale_when_a_measured_path_changed_after_the_commit():
    data = _results({**AMD, "git_commit": "aaa"})
    why = why_stale(data, ["easy_context/parallel"], HISTORY)
    assert why and "measured at aaa" in why and "easy_context/parallel/ring.py" in why
    assert why_stale(data, ["easy_context/parallel/ring.py"], HISTORY)


def test_every_recorded_commit_counts():
    """Rows merged from two runs: the older run's change makes the file stale."""
    data = _results({**AMD, "git_commit": "bbb"}, {**AMD, "git_commit": "aaa"})
    assert "measured at aaa" in why_stale(data, ["easy_context/parallel"], HISTORY)
    assert "measured at bbb" in why_stale(data, ["easy_context/attention"], HISTORY)


def test_unknown_commit_and_missing_records_are_stale():
    assert "not in this checkout's history" in why_stale(
        _results({**AMD, "git_commit": "zzz"}), ["easy_context"], HISTORY)
    assert why_stale({"rows": []}, ["easy_context"], HISTORY) == f"{NO_COMMIT}; {NO_CPU}"
    assert why_stale(_results({"cpu": "x", "git_commit": None}), ["x"], HISTORY) == NO_COMMIT
    assert why_stale(_results({"git_commit": "ccc"}), ["easy_context"], HISTORY) == NO_CPU
    # one run of two without its commit is enough
    assert why_stale(_results({**AMD, "git_commit": "ccc"}, AMD), ["easy_context"],
                     HISTORY) == NO_COMMIT
    # a machine record under another key (plan_validation's trainer_machine) counts too
    data = {"machine": {**AMD, "git_commit": "ccc"}, "trainer_machine": {"cpus": 2}}
    assert why_stale(data, ["easy_context"], HISTORY) == f"{NO_COMMIT}; {NO_CPU}"


def test_registry_must_match_the_verdicts():
    verdicts = {"a.json": "measured at aaa: ring.py changed", "b.json": None,
                "c.json": f"{NO_COMMIT}; {NO_CPU}"}
    # (a) stale, not registered
    assert any(p.startswith("a.json is stale and not in STALE.json")
               for p in registry_problems(verdicts, {"c.json": "records no commit, no CPU"}))
    # (b) registered, fresh now (or gone)
    problems = registry_problems(verdicts, {"a.json": "x", "b.json": "old",
                                            "d.json": "gone", "c.json": "x"})
    assert "b.json is in STALE.json but is fresh now: remove its entry" in problems
    assert "d.json is in STALE.json but there is no such results file" in problems
    # (c) missing commit / CPU: the entry must say so
    assert any(p.startswith(f"c.json {NO_COMMIT}") for p in problems)
    assert any(p.startswith(f"c.json {NO_CPU}") for p in problems)
    ok = {"a.json": "re-run it", "c.json": f"{NO_COMMIT} and {NO_CPU}: re-run it"}
    assert registry_problems(verdicts, ok) == []


def test_measures_are_read_without_importing(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text('import torch\nMEASURES = ["easy_context/a.py", "easy_context/b"]\n')
    assert declared_measures(script) == ("easy_context/a.py", "easy_context/b")
    (tmp_path / "none.py").write_text("X = 1\n")
    assert declared_measures(tmp_path / "none.py") is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_history_on_a_scratch_repository(tmp_path):
    """GitHistory's own git questions, on a three-commit repository made here."""
    def git(*args):
        done = _git("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    *args, repo=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def commit(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", f"change {path}")
        return git("rev-parse", "--short", "HEAD")

    git("init", "-q")
    measured = commit("pkg/a.py", "1")
    commit("pkg/b.py", "1")
    commit("other/c.py", "1")
    h = GitHistory(tmp_path)
    assert h.changed_since(measured, ("other/d.py", "pkg/a.py")) is None
    why = h.changed_since(measured, ("pkg",))
    assert "pkg/b.py changed since, in 1 commit" in why and "other" not in why
    assert "not in this checkout's history" in h.changed_since("0123456", ("pkg",))
    (tmp_path / "pkg" / "a.py").write_text("2")  # uncommitted
    (tmp_path / "pkg" / "new.py").write_text("")  # untracked
    why = GitHistory(tmp_path).changed_since(measured, ("pkg/a.py", "pkg/new.py"))
    assert why == "uncommitted changes to pkg/a.py, pkg/new.py"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_comments_and_docstrings_do_not_make_results_stale(tmp_path):
    def git(*args):
        done = _git("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    *args, repo=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def commit(text, path="pkg/m.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", "change")
        return git("rev-parse", "--short", "HEAD")

    git("init", "-q")
    measured = commit('"""A module."""\n\ndef f(x):\n    """Twice x."""\n    return 2 * x  # why\n')
    commit('"""A module, reworded."""\n\n\ndef f(x):\n    """Twice x, said better."""\n'
           '    # a new comment\n    return 2 * x  # why, mended\n')
    assert GitHistory(tmp_path).changed_since(measured, ("pkg",)) is None
    (tmp_path / "pkg" / "m.py").write_text('def f(x):\n    return 3 * x\n')  # uncommitted code
    assert GitHistory(tmp_path).changed_since(measured, ("pkg",)) == "uncommitted changes to pkg/m.py"
    newest = commit('def f(x):\n    return 3 * x\n')
    why = GitHistory(tmp_path).changed_since(measured, ("pkg",))
    assert why == f"pkg/m.py changed since, in 2 commits (newest {newest})", why
    commit("a: 1\n", "pkg/config.yaml")  # not Python: any change counts
    assert "pkg/config.yaml" in GitHistory(tmp_path).changed_since(newest, ("pkg",))
