"""Failures on spawned ranks, and the command line as a user runs it (subprocesses).

``launch`` raises one RankError for the first rank that fails (the root cause), with its
exception and traceback; the CLI prints it once as ``rank N: <message>``, with no traceback
from any rank unless --debug asks for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from easy_context.errors import RankError, exit_code
from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir

REPO = Path(__file__).resolve().parents[2]


def _rank1_killed() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits on a peer that never comes (it is terminated)


@pytest.mark.slow  # a spawn of 2 ranks
def test_launch_names_a_killed_rank():
    """A rank killed by a signal while its peer waits in a collective: launch ends the peer
    and raises one RankError naming the killed rank. (A rank that raises:
    test_teardown.py::test_launch_leaves_no_distributed_threads_at_exit[True].)"""
    from easy_context.launch import launch

    with pytest.raises(RankError) as info:
        launch(_rank1_killed, 2)
    assert info.value.rank == 1 and "was killed by SIGKILL" in str(info.value)
    assert exit_code(info.value) == 1  # a failure at run time


def _cli(*args: str, env: dict | None = None, cwd: Path | None = None):
    # The checkout first on the path, as `easy-context` from `pip install -e .` has it.
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "easy_context.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r"easy-context( \S+)?: error: ", line)]


def test_bad_flag_in_a_subprocess(tmp_path):
    run = _cli("train", "--model", str(tmp_path / "nope"), "--dataset", "d", "--seq-length", "0")
    assert run.returncode == 2
    assert run.stderr == "easy-context train: error: --seq-length must be >= 1, got 0\n"
    run = _cli("plan", "--devices", "0", "--debug")
    assert run.returncode == 2 and "Traceback" in run.stderr
    assert _error_lines(run.stderr) == ["easy-context plan: error: --devices must be >= 1, got 0"]


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory) -> tuple[Path, Path]:
    """A model whose weights file is not safetensors: every rank fails while loading it,
    after the checks made before launching (which see a config and a .safetensors file)."""
    root = tmp_path_factory.mktemp("broken")
    model = tiny_model_dir(root / "model")
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    return model, tiny_dataset_dir(root / "data", seq_length=32, rows=4)


@pytest.mark.slow  # a 2-rank run that starts torch and transformers
def test_rank_failure_is_reported_once(broken_model, tmp_path):
    model, data = broken_model
    args = ["train", "--model", str(model), "--dataset", str(data), "--seq-length", "32",
            "--nproc-per-node", "2", "--output-dir", str(tmp_path / "out")]
    run = _cli(*args)
    errors = _error_lines(run.stderr)
    assert run.returncode == 1, run.stderr  # a failure at run time, not a bad flag
    assert len(errors) == 1, run.stderr
    assert re.match(r"easy-context train: error: rank [01]: \S+", errors[0]), errors
    assert "Traceback" not in run.stderr
    # (--debug: the failed rank's own traceback before that line, report_error's part:
    # tests/unit/test_cli_errors.py::test_debug_prints_a_failed_ranks_own_traceback, with
    # launch's RankError carrying a rank's traceback in test_teardown.py)
