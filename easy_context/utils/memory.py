"""Peak memory of a region of code, on CUDA or on the CPU.

CUDA: the caching allocator's peak of allocated bytes. CPU: torch keeps no allocator
statistics, so we read the process's resident-set high-water mark (VmHWM), after resetting
it through /proc/self/clear_refs, minus the resident size at the start. That counts every
byte the process touched, tensors or not, which is what a user running out of RAM sees.
Large frees go back to the OS only if glibc maps big blocks directly: benchmarks set
MALLOC_MMAP_THRESHOLD_ (see benchmarks/common.py) so one measurement does not inherit the
heap left by the last.
"""

from __future__ import annotations

import os

import torch

_STATUS = "/proc/self/status"


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


class PeakMemory:
    """``with PeakMemory(device) as pm: ...`` then ``pm.peak_bytes`` (above the start)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            try:  # reset the high-water mark to the current resident size (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self._start = rss_bytes() or 0
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            hwm = _status_kib("VmHWM")
            self.peak_bytes = None if hwm is None else hwm * 1024 - self._start


def peak_memory_supported() -> bool:
    return torch.cuda.is_available() or os.path.exists(_STATUS)
