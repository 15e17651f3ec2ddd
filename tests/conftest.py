"""Shared fixtures. Distributed tests reuse one pool of gloo ranks per world size; the tiny
needle model (a minute or two of training, one core) trains in a background process from
the start of the session when a collected test needs it."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from easy_context.testing import DistPool

REPO = Path(__file__).resolve().parents[1]
_BACKGROUND: dict[str, tuple] = {}

_POOLS: dict[int, DistPool] = {}


def _pool(world_size: int) -> DistPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size, threads_per_rank=1, timeout_s=180)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def dist1() -> DistPool:
    """One gloo rank in its own process (keeps the test process free of a process group)."""
    return _pool(1)


@pytest.fixture(scope="session")
def dist2() -> DistPool:
    """Two gloo ranks, started on first use and kept for the session."""
    return _pool(2)


@pytest.fixture(scope="session")
def dist4() -> DistPool:
    """Four gloo ranks, started on first use and kept for the session."""
    return _pool(4)


def _start_needle_training() -> tuple:
    folder = Path(tempfile.mkdtemp(prefix="easy-context-needle-model-"))
    log = open(folder.parent / f"{folder.name}.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.eval_fixtures", "--train-into",
                             str(folder / "model")], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return folder, proc, log


def pytest_collection_modifyitems(session, config, items):
    """Start training the needle model now if a collected test needs it: the dist tests
    run first, so it is ready by then (1 thread, beside the rest of the suite)."""
    if any("trained_needle_model" in getattr(item, "fixturenames", ()) for item in items):
        _BACKGROUND["needle"] = _start_needle_training()


@pytest.fixture(scope="session")
def trained_needle_model() -> Path:
    """The tiny needle model (tests/unit/eval_fixtures.py train_needle_model, seed 0, one
    thread), trained in the background since collection."""
    if "needle" not in _BACKGROUND:
        _BACKGROUND["needle"] = _start_needle_training()
    folder, proc, log = _BACKGROUND["needle"]
    proc.wait(timeout=1200)
    log.seek(0)
    assert proc.returncode == 0, f"training the needle model failed:\n{log.read()[-4000:]}"
    return folder / "model"


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    for folder, proc, log in _BACKGROUND.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
