"""Ranks end their distributed state before they exit (easy_context.launch.teardown), and
the commands that spawn ranks exit cleanly (issue 45: "terminate called without an active
exception" once after a finished 2-rank eval-needle).

destroy_process_group() alone unregisters the groups but leaves their C++ objects, and with
them gloo's threads and rank 0's TCPStore server thread, alive while anything refers to
them; a model holding its group in a reference cycle keeps them until the interpreter's exit.
The commands as users run them (eval-needle, eval-ruler, generate, train, recipe on 2 ranks)
are checked for the abort text in tests/dist/test_readme.py::test_bash_blocks_in_order.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from easy_context.errors import RankError, exit_code
from easy_context.launch import distributed_threads, launch, teardown

REPO = Path(__file__).resolve().parents[2]


class _Holder:
    """Holds a group in a reference cycle, as a model's attention modules can."""

    def __init__(self, group):
        self.group, self.me = group, self


def _groups_in_a_cycle() -> _Holder:
    from easy_context.mesh import build_mesh

    holder = _Holder(build_mesh(dist.get_world_size()).sp.group)
    x = torch.ones(2)
    dist.all_reduce(x, group=holder.group)
    assert x.tolist() == [float(dist.get_world_size())] * 2
    return holder


def _teardown_probe() -> dict:
    _groups_in_a_cycle()
    during = distributed_threads()
    dist.destroy_process_group()
    after_destroy = distributed_threads()
    teardown()
    return {"during": during, "after_destroy": after_destroy,
            "after_teardown": distributed_threads(), "initialized": dist.is_initialized()}


def _report_at_exit(folder: str, fail: bool) -> int:
    """Build groups held in a cycle; at the rank's interpreter exit (after launch's own
    teardown), write what distributed state is left. Returns the world size."""
    rank = dist.get_rank()

    def report() -> None:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"threads": distributed_threads(), "initialized": dist.is_initialized()}))

    atexit.register(report)
    holder = _groups_in_a_cycle()  # noqa: F841 - on the error path the failing frame holds it
    if fail and rank == 1:
        raise ValueError("rank one fails after building its groups")
    return dist.get_world_size()


def test_teardown_joins_the_groups_threads():
    """In a rank: destroy_process_group() leaves the threads of groups held in a cycle;
    teardown() ends them all (Linux thread names, /proc)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread names come from /proc (Linux)")
    out = launch(_teardown_probe, 2)
    assert any(n.startswith("pt_gloo_runloop") for n in out["during"]), out
    assert "pt_tcpstore_uv" in out["during"], out  # rank 0 serves the store
    assert out["after_destroy"], out  # the mechanism: unregistered is not destroyed
    assert out["after_teardown"] == [] and not out["initialized"], out


@pytest.mark.slow  # two spawns of 2 ranks
@pytest.mark.parametrize("fail", [False, True])
def test_launch_leaves_no_distributed_threads_at_exit(tmp_path, fail):
    """launch spawns the ranks and returns rank 0's value, or raises one RankError for the
    rank that failed (its exception and traceback; test_cli_ranks.py: a killed rank); after
    the ranks end, on either path, no group is initialized and no group thread is left for
    the interpreter's exit."""
    if fail:
        with pytest.raises(RankError) as info:
            launch(_report_at_exit, 2, str(tmp_path), True)
        e = info.value
        message = "rank one fails after building its groups"
        assert (e.rank, e.exc_type, e.message) == (1, "ValueError", message)
        assert str(e) == f"rank 1: {message}"
        assert isinstance(e.original, ValueError) and exit_code(e) == 2  # bad usage
        assert "Traceback" in e.traceback and "_report_at_exit" in e.traceback
    else:
        assert launch(_report_at_exit, 2, str(tmp_path), False) == 2  # rank 0's value
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread names come from /proc (Linux)")
    # On the error path, torch ends the ranks still running once rank 1 has failed: rank 0
    # (its success path is the other case's) may get SIGTERM before its exit writes a report;
    # rank 1, whose failing frame held the groups, always exits through Python.
    ranks = [r for r in (0, 1) if not fail or r == 1 or (tmp_path / f"rank{r}.json").exists()]
    for rank in ranks:
        state = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert state == {"threads": [], "initialized": False}, (rank, state)


_UNDER_TORCHRUN = """
import json, os
from easy_context.launch import distributed_threads, free_port, launch
from tests.dist.test_teardown import _groups_only, _raise_after_groups
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
launch(_groups_only, 1)
ok = distributed_threads()
try:
    launch(_raise_after_groups, 1)
except ValueError:
    pass
print(json.dumps({"ok": ok, "error": distributed_threads()}))
"""


def _groups_only() -> None:
    _groups_in_a_cycle()


def _raise_after_groups() -> None:
    holder = _groups_in_a_cycle()  # noqa: F841 - the failing frame holds the groups
    raise ValueError("fails after building its groups")


@pytest.mark.slow  # a subprocess that starts torch and two process groups
def test_launch_under_torchrun_tears_down_also_on_error():
    """The torchrun path (RANK and WORLD_SIZE set: launch initialises the group in this
    process): no group thread is left after launch returns or raises (a subprocess, so
    the test's own process keeps no process group)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread names come from /proc (Linux)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _UNDER_TORCHRUN], capture_output=True,
                         text=True, timeout=300, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {"ok": [], "error": []}, run.stdout


def test_teardown_stops_a_left_open_progress_bars_monitor():
    """tqdm's monitor thread runs while any bar is open; teardown ends it (a later bar
    starts a new one)."""
    import io
    import threading

    from tqdm import tqdm
    from tqdm._monitor import TMonitor

    def monitors() -> list:
        return [t for t in threading.enumerate() if isinstance(t, TMonitor)]

    bar = tqdm(total=2, file=io.StringIO())
    try:
        assert monitors()
        teardown()  # no process group here: only the monitor to stop
        assert not monitors()
        with tqdm(total=1, file=io.StringIO()) as later:
            later.update()
    finally:
        bar.close()
