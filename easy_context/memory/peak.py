"""Peak memory of a region of code, on CUDA or on the CPU.

Two numbers come out of ``with PeakMemory(device) as pm: ...``:

- ``pm.process_peak_bytes``: the process's peak, what a user running out of memory sees.
  CUDA: the caching allocator's peak of allocated bytes during the region. CPU: torch keeps
  no allocator statistics, so the resident-set high-water mark (VmHWM), which counts every
  byte the process touched, tensors or not: the peak during the region when the mark could
  be reset at its start (/proc/self/clear_refs, Linux >= 4.0), else the peak since the
  process started (containers may refuse the reset). None where it is unknown (no /proc).
- ``pm.peak_bytes``: how far the region rose above its start (benchmarks measure a step
  this way). On the CPU it needs the reset; without it, it is None rather than a number
  from another part of the process's life. The kernel's RSS counters lag by a few pages,
  so a region that allocates nothing may read slightly below its start: that counts as 0.

Large frees go back to the OS only if glibc maps big blocks directly: benchmarks set
MALLOC_MMAP_THRESHOLD_ (see benchmarks/common.py) so one measurement does not inherit the
heap left by the last.
"""

from __future__ import annotations

import os

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _reset_high_water_mark() -> bool:
    """Set VmHWM to the current resident size; False when the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as pm: ...`` then ``pm.process_peak_bytes`` (the process's
    peak) and ``pm.peak_bytes`` (above the start); see the module docstring."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.process_peak_bytes: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._reset = True
        else:
            self._reset = _reset_high_water_mark()
            self._start = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.process_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            hwm = _status_kib("VmHWM")
            self.process_peak_bytes = None if hwm is None else hwm * 1024
        if self._reset and self._start is not None and self.process_peak_bytes is not None:
            self.peak_bytes = max(0, self.process_peak_bytes - self._start)


def peak_memory_supported() -> bool:
    return torch.cuda.is_available() or os.path.exists(_STATUS)
