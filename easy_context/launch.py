"""Start a command on N ranks: in this process, under torchrun, or by spawning them itself.

    launch(fn, nproc_per_node, *args) -> fn's return value on rank 0

- torchrun (or any launcher that sets RANK and WORLD_SIZE): this process is one rank;
  the process group is initialised here and ``fn`` runs once.
- a process group already initialised (tests' DistPool, a trainer): ``fn`` just runs.
- ``nproc_per_node <= 1``: ``fn`` runs in this process without torch.distributed.
- otherwise: ``nproc_per_node`` ranks are spawned on a free local port; each initialises
  the process group (:func:`backend_for`: NCCL for CUDA tensors and gloo for host tensors
  when CUDA is available, else gloo), runs ``fn`` and tears down.

Inside ``fn``, :func:`device` gives the rank's device (``cuda:{local_rank}`` or cpu).
``fn`` and its arguments are pickled to the spawned ranks, so ``fn`` must be importable
(defined at module level). When spawned ranks fail, :func:`launch` raises one
:class:`~easy_context.errors.RankError` for the first rank that failed: the root cause, since
its peers then fail on broken connections. No rank prints a traceback; the error keeps it.

Every rank this module starts ends with :func:`teardown` (also on an error): the process
groups' native threads (gloo's work and I/O loops, rank 0's TCPStore server) are stopped and
joined before the rank returns, never left to the interpreter's exit.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import RankError


def free_port() -> int:
    """A TCP port that is free now on localhost (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """This rank's device, chosen at run time: ``cuda:{LOCAL_RANK}`` if CUDA is there, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_for(device_type: str) -> str:
    """The process group's backend for ranks on ``device_type``.

    On CUDA one group with a backend per device type, NCCL for CUDA tensors and gloo for host
    tensors (what torchtitan does): NCCL carries CUDA tensors only, and host tensors do reach
    collectives there. FSDP2's ``CPUOffloadPolicy`` leaves gradients on the host, so
    ``clip_grad_norm_`` all-reduces host tensors, and ``set_model_state_dict(...,
    broadcast_from_rank0=True)`` broadcasts from where the values are; over NCCL alone both
    raise "No backend type associated with device type cpu" (pytorch/pytorch#148532).
    Sub-groups (the mesh's) inherit the same pair."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def check_local_devices(nproc_per_node: int) -> None:
    """On a CUDA machine, one GPU per local rank: NCCL refuses two ranks on one GPU, and a rank
    beyond the last GPU fails with "invalid device ordinal" after the others have started."""
    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if nproc_per_node > count:
        raise ValueError(f"--nproc-per-node {nproc_per_node} asks for more ranks than this "
                         f"machine has GPUs ({count}): use --nproc-per-node {count} or fewer "
                         "(one rank per GPU), or set CUDA_VISIBLE_DEVICES to show more GPUs")


def init_distributed(timeout_minutes: float = 10) -> torch.device:
    """Initialise the default process group from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK, as torchrun sets them) unless it already is.

    The timeout is how long a collective may wait for a stuck peer before failing: minutes,
    so a dead rank ends the job instead of holding the others for days. Returns the device.
    """
    dev = device()
    if not dist.is_initialized():
        if dev.type == "cuda":
            if dev.index >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK {dev.index} has no GPU: this machine shows "
                    f"{torch.cuda.device_count()}. Start at most one rank per GPU "
                    "(--nproc-per-node, torchrun's --nproc-per-node) or set CUDA_VISIBLE_DEVICES")
            torch.cuda.set_device(dev)
        dist.init_process_group(backend_for(dev.type),
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return dev


# Names (Linux thread names, /proc) of the native threads a process group owns: gloo's work
# loops and I/O loops, and the TCPStore server (rank 0; the libuv backend).
DIST_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def native_threads() -> list[str]:
    """The names of this process's threads, native ones included (Linux: /proc/self/task;
    elsewhere an empty list)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we listed
            pass
    return sorted(names)


def distributed_threads() -> list[str]:
    """Threads of this process that belong to a process group (empty once :func:`teardown`
    has run)."""
    return [n for n in native_threads() if n.startswith(DIST_THREADS)]


def _stop_progress_monitors() -> None:
    # tqdm starts a monitor thread with its first bar (one per bar class) and stops it when
    # the last bar closes; a bar that a library left open keeps it running until exit.
    import threading

    try:
        from tqdm._monitor import TMonitor
    except ImportError:  # a tqdm without its monitor module starts no such thread
        return
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()


def teardown(synchronize: bool = False) -> None:
    """End this rank's distributed state now rather than at interpreter exit.

    ``dist.destroy_process_group()`` only unregisters the groups: their C++ objects, and with
    them gloo's threads and rank 0's TCPStore server thread, live as long as a Python object
    refers to them, and a model holding its sequence-parallel group in a reference cycle does
    until the interpreter's last collection at exit, where they are torn down in no set order
    while the interpreter finalizes: the likely source of a rare "terminate called without an
    active exception" after a finished run (issue 45). So: wait for the peers (``synchronize``, only
    when every rank gets here: a success), destroy the groups, drop our cached subgroups
    (easy_context.mesh), collect the cycles so the groups' destructors join their threads
    here, and stop tqdm's monitor thread."""
    try:
        if synchronize and dist.is_initialized():
            # no rank closes its connections while a peer still uses them
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        from .mesh import forget_groups

        forget_groups()
        gc.collect()
        _stop_progress_monitors()


def _spawned(local_rank: int, world: int, port: int, timeout_minutes: float, fn: Callable,
             args: tuple, results: "mp.SimpleQueue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    # Spawned CPU ranks would each take every core; share them instead.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ok = False
    try:
        try:
            init_distributed(timeout_minutes)
            value = fn(*args)
            if local_rank == 0:
                results.put((True, value))
            del value  # what fn returned may hold the groups too
            ok = True
        except Exception as e:
            # The queue is written in the order the ranks fail, so the parent reads the root
            # cause first.
            results.put((False, RankError.from_exception(local_rank, e, traceback.format_exc())))
    finally:
        # Past the except clause the exception and its traceback (fn's frames, their
        # locals) are gone, so teardown can collect what held the groups.
        teardown(synchronize=ok)
    if not ok:
        # Exit quietly: torch.multiprocessing would hand a traceback to the parent, which
        # reports the error put above instead.
        raise SystemExit(1)


def launch(fn: Callable, nproc_per_node: int, *args: Any, timeout_minutes: float = 10) -> Any:
    """Run ``fn(*args)`` on ``nproc_per_node`` ranks (see the module docstring); return what
    rank 0 returned. A failure raises the exception itself (in this process, or under torchrun)
    or, for spawned ranks, one RankError for the first rank that failed."""
    if dist.is_initialized():
        return fn(*args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_distributed(timeout_minutes)
        ok = False
        try:
            value = fn(*args)
            ok = True
            return value
        except BaseException as e:
            # The error goes up with its traceback; fn's locals (a model holding the groups)
            # need not: teardown collects them now.
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            teardown(synchronize=ok)
    if nproc_per_node <= 1:
        return fn(*args)
    check_local_devices(nproc_per_node)  # before any rank starts
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    # When a rank fails, torch logs a warning per peer it terminates; the RankError raised
    # below is the report.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        context = mp.start_processes(
            _spawned, args=(nproc_per_node, free_port(), timeout_minutes, fn, args, results),
            nprocs=nproc_per_node, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            # join has ended every rank by now: their exit codes say who died how
            raise _first_failure(results, [p.exitcode for p in context.processes]) from None
    finally:
        spawn_log.setLevel(level)
    ok, value = results.get()
    if not ok:
        raise value
    return value


def _first_failure(results: "mp.SimpleQueue", exit_codes: list[int | None]) -> RankError:
    """The root cause of a failed launch.

    A rank killed by a signal (the out-of-memory killer's SIGKILL, a segfault) could not
    report, and its peers' reports are consequences (a closed connection): it comes first.
    Otherwise the first failure a rank reported, in the order they were reported. SIGTERM
    is how torch ends the ranks still running after a failure, so it is no cause.
    """
    for rank, code in enumerate(exit_codes):
        if code is not None and code < 0 and code != -signal.SIGTERM:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            hint = " (the out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
            return RankError(rank, "ProcessExited", f"the process was killed by {name}{hint}")
    # A report written just before its rank exited may still be in the pipe.
    deadline = time.monotonic() + 5
    while results.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    while not results.empty():
        ok, value = results.get()
        if not ok:
            return value
    rank, code = next(((r, c) for r, c in enumerate(exit_codes) if c), (0, None))
    return RankError(rank, "ProcessExited",
                     f"the process exited with code {code} before it could report an error")
