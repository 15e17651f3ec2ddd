"""Helpers shared by the benchmark scripts: environment, timing, machine info, result files.

Memory on the CPU is measured as the resident-set high-water mark (easy_context.memory.peak).
glibc keeps freed heap blocks unless big allocations are mapped directly, so every process
that measures must start with ``MALLOC_MMAP_THRESHOLD_=65536``: then each tensor above 64 KiB
is its own mapping, freed back to the OS when the tensor dies, and one measurement does not
inherit (or hide behind) the heap left by the last. The variable is read by glibc when the
process starts, so it has to be in the environment *before* the process exists: set it here
before spawning workers (:func:`setup_env`), or re-exec the current script with it
(:func:`ensure_env`), or start a child with :func:`bench_env` / :func:`run_script`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# glibc reads these at process start. 64 KiB: every tensor bigger than that is mmapped, and
# fixing the threshold also turns off glibc's dynamic raising of it after a big free.
BENCH_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# --------------------------------------------------------------------------- environment
def bench_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) with the benchmark variables set."""
    env = dict(os.environ if base is None else base)
    env.update(BENCH_ENV)
    return env


def env_ok() -> bool:
    return all(os.environ.get(k) == v for k, v in BENCH_ENV.items())


def setup_env() -> None:
    """Put the benchmark variables into os.environ, so that processes started from now on
    (e.g. DistPool's spawned ranks) have them from their first instruction. This process
    itself keeps the allocator it started with: use :func:`ensure_env` if it measures too."""
    os.environ.update(BENCH_ENV)


def ensure_env() -> None:
    """Re-exec the running script with the benchmark variables unless it already has them.
    Call first thing in ``if __name__ == "__main__":``."""
    if env_ok():
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, bench_env())


def run_script(args: list[str], timeout_s: float | None = None, **kw) -> subprocess.CompletedProcess:
    """Run ``python <args>`` in a child with the benchmark environment, from the repo root."""
    return subprocess.run([sys.executable, *args], env=bench_env(), cwd=REPO, timeout=timeout_s,
                          capture_output=True, text=True, **kw)


# --------------------------------------------------------------------------- timing
def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def time_call(fn: Callable[[], Any], warmup: int = 1, repeats: int = 3,
              sync: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Wall time of ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones.
    ``sync`` (e.g. a barrier or cuda.synchronize) runs before and after each timed call,
    outside the timed span. Returns {"median_s", "times_s"}."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": median(times), "times_s": times}


# --------------------------------------------------------------------------- machine info
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# The instruction sets that pick different kernels in torch, oneDNN, MKL and bitsandbytes: a
# "Xeon" model name alone does not say which CPU a figure was measured on.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
                "amx_bf16", "amx_int8")


def cpu_flags() -> list[str] | None:
    """Which of KERNEL_FLAGS this CPU has (from /proc/cpuinfo), or None where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in KERNEL_FLAGS if flag in have]
    except OSError:
        pass
    return None


def cpu_description() -> str:
    """The CPU in one line, for tables: model name, logical CPUs and its vector extensions."""
    flags = cpu_flags()
    vec = ("AMX" if flags and "amx_tile" in flags else "AVX-512" if flags and "avx512f" in flags
           else "AVX2" if flags and "avx2" in flags else None)
    if vec and flags and "avx512_bf16" in flags:
        vec += " with AVX-512 BF16" if vec == "AMX" else " BF16"
    return f"{_cpu_model() or 'unknown CPU'}, {os.cpu_count()} logical CPUs" + (
        f", {vec}" if vec else "")


def spread(xs: Iterable[float]) -> dict[str, float]:
    """min, median and max of repeated measurements (what a side-by-side figure varies by)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    return {"min": xs[0], "median": statistics.median(xs), "max": xs[-1]}


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_description": cpu_description(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "torch": torch.__version__,
        "deepspeed": _package_version("deepspeed"),
        "cuda": torch.cuda.is_available(),
        # the instruction set of the CPU kernels torch runs (ATEN_CPU_CAPABILITY can lower it)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "git_commit": _git_commit(),
        "env": {k: os.environ.get(k) for k in BENCH_ENV},
        "load_average_1_5_15": load_average(),
    }


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# --------------------------------------------------------------------------- result files
def results_path(name_or_path: str | os.PathLike) -> Path:
    """``attention`` -> benchmarks/results/attention.json; a path with a suffix stays as is."""
    p = Path(name_or_path)
    if p.suffix:
        return p
    return RESULTS_DIR / f"{p.name}.json"


def load_results(path: str | os.PathLike) -> dict[str, Any] | None:
    p = results_path(path)
    if not p.exists():
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def merge_rows(old: list[dict], new: list[dict], key: Callable[[dict], Any]) -> list[dict]:
    """``old`` rows whose key is not in ``new``, then ``new``; order of first appearance kept."""
    fresh = {key(r): r for r in new}
    out, seen = [], set()
    for r in old:
        k = key(r)
        out.append(fresh.get(k, r))
        seen.add(k)
    out.extend(r for r in new if key(r) not in seen)
    return out


def write_results(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write JSON atomically (a half-written file never replaces a good one)."""
    p = results_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(_clean(payload), f, indent=1, sort_keys=False, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, p)
    return p


def _clean(x: Any) -> Any:
    """NaN and infinities become null (JSON has neither); tuples become lists."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def fmt_table(header: list[str], rows: list[list[Any]], markdown: bool = False) -> str:
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    if markdown:
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    else:
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def meminfo_bytes(field: str) -> int:
    """A field of /proc/meminfo (MemTotal, MemAvailable, ...) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def cap_address_space(share: float = 1.0) -> None:
    """Let this process grow by at most 90% of ``share`` of the memory free now, so a run
    that does not fit fails with MemoryError instead of waking the OOM killer on others."""
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + int(0.9 * share * meminfo_bytes("MemAvailable"))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


# --------------------------------------------------------------------------- ranks seen from outside
def _hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def watch_ranks(cmd: list[str], env: dict[str, str] | None = None, timeout_s: float = 3600.0,
                interval_s: float = 0.05,
                is_rank: Callable[[list[str]], bool] | None = None) -> dict[str, Any]:
    """Run ``cmd`` and read, from /proc, the resident high-water mark (VmHWM) of every process
    it starts, until it exits: what a user watching ``top`` would see, with no help from the
    program. Ranks are the processes started by multiprocessing's spawn (``spawn_main`` in
    their command line; not its resource tracker), or those whose argument list ``is_rank``
    accepts (for ranks started by torchrun or ``accelerate launch``), or the process itself
    when it starts none.
    VmHWM only grows, so the last value read before a rank exits is its peak (a step's peak
    comes long before the exit).
    Returns {"returncode", "stdout", "stderr", "wall_s", "rank_peaks_bytes" (sorted, largest
    first), "launcher_peak_bytes"}."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    root = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    ranks: set[int] = set()
    import threading

    out: dict[str, str] = {}
    readers = [threading.Thread(target=lambda k=k, s=s: out.__setitem__(k, s.read()), daemon=True)
               for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    while proc.poll() is None:
        if time.perf_counter() - t0 > timeout_s:
            for child in root.children(recursive=True):
                child.kill()
            proc.kill()
            break
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            children = []
        for p in [root, *children]:
            hwm = _hwm_bytes(p.pid)
            if hwm is None:
                continue
            peaks[p.pid] = max(peaks.get(p.pid, 0), hwm)
            if p.pid not in ranks and p.pid != proc.pid:
                try:
                    argv = p.cmdline()
                except psutil.Error:
                    continue
                line = " ".join(argv)
                if (is_rank(argv) if is_rank is not None
                        else "spawn_main" in line and "resource_tracker" not in line):
                    ranks.add(p.pid)
        time.sleep(interval_s)
    proc.wait()
    for r in readers:
        r.join(timeout=10)
    # one process (no spawned ranks): the launcher is the rank
    rank_peaks = [peaks[p] for p in ranks] or [peaks.get(proc.pid, 0)]
    return {"returncode": proc.returncode, "stdout": out.get("stdout", ""),
            "stderr": out.get("stderr", ""), "wall_s": time.perf_counter() - t0,
            "rank_peaks_bytes": sorted(rank_peaks, reverse=True),
            "launcher_peak_bytes": peaks.get(proc.pid)}
