"""Run functions on N gloo processes on one machine, for tests and small experiments.

Starting a process group costs seconds (each rank imports torch and transformers), so a
:class:`DistPool` starts its N ranks once and then runs many functions on them. Each call
has a timeout; when one rank raises, the call fails with that rank's traceback; when a
call times out or a rank dies, the pool is torn down so the next call starts a fresh one
instead of waiting forever on a collective that will never complete.

Functions and their arguments are pickled to the ranks (spawn), so they must be defined
at module level in an importable module.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from .launch import free_port  # noqa: F401  (re-exported: tests and benchmarks import it here)


class DistError(RuntimeError):
    """A function failed (or timed out) on one or more ranks."""


def _worker(rank: int, world_size: int, port: int, threads: int, pg_timeout_s: float,
            tasks: "mp.Queue", results: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    except Exception:  # report a failed start instead of leaving the parent waiting
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                value = fn(*args, **kwargs)
                # The queue pickles in a feeder thread, where a failure is only printed and
                # the parent would wait for a result that never comes: pickle here instead.
                pickle.dumps(value)
                results.put((rank, True, value))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        from .launch import teardown

        teardown()


class DistPool:
    """``world_size`` gloo ranks kept alive between calls.

    ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank (each rank reads its rank from
    ``torch.distributed``) and returns the list of results in rank order.
    """

    def __init__(self, world_size: int, threads_per_rank: int = 1, timeout_s: float = 120.0,
                 pg_timeout_s: float = 60.0):
        self.world_size = world_size
        self.threads_per_rank = threads_per_rank
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self.threads_per_rank, self.pg_timeout_s,
                              self._tasks[r], self._results))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("process-group start", timeout_s=max(self.timeout_s, 120.0))

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        got: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(got) + len(failures) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                if dead and not failures:
                    failures.update({r: f"rank {r} died (exit code {self._procs[r].exitcode})"
                                     for r in dead})
                if left <= 0 or failures:
                    # A rank failed and the others wait on it in a collective, or all hang.
                    self.close()
                    missing = sorted(set(range(self.world_size)) - set(got) - set(failures))
                    msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
                    waited = (f"; ranks {missing} were still running after {timeout_s:.0f} s"
                              if missing else "")
                    raise DistError(f"{what} failed on ranks {sorted(failures)}{waited}{msg}"
                                    if failures else
                                    f"{what}: no rank finished within {timeout_s:.0f} s")
                continue
            (got if ok else failures)[rank] = value
        if failures:
            msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            # The failed ranks' peers may be left inside a collective: start afresh next time.
            self.close()
            raise DistError(f"{what} failed on ranks {sorted(failures)}:{msg}")
        return [got[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "function"), timeout_s or self.timeout_s)

    def close(self) -> None:
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = 120.0,
                    threads_per_rank: int = 1, **kwargs) -> list[Any]:
    """One-off: start ``world_size`` gloo ranks, run ``fn(*args, **kwargs)`` on each, stop them."""
    with DistPool(world_size, threads_per_rank, timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)
