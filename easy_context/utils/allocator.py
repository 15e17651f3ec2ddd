"""Set each rank's memory allocator up the way the memory planner assumes.

The planner (easy_context.plan) counts live tensors. Whether a process's memory follows them
depends on the allocator:

- CPU, glibc: blocks below malloc's mmap threshold come from the heap, which keeps freed
  memory, and glibc raises that threshold each time a big mapped block is freed (up to
  32 MiB), so after a few steps tensors of tens of MB live in a heap that never shrinks: a
  training step's resident peak then grew 24% faster with the sequence than the tensors did
  (benchmarks/results/plan_validation.json, the trainer rows). ``mallopt(M_MMAP_THRESHOLD,
  64 KiB)`` maps every block above 64 KiB on its own and fixes the threshold, exactly what
  ``MALLOC_MMAP_THRESHOLD_=65536`` does at process start (which the benchmarks set), but it
  also works in a rank that torchrun or another launcher started.
- CUDA: the caching allocator splits fixed-size segments, and a long sequence's tensors of
  many sizes fragment them; ``expandable_segments:True`` grows segments in place instead.

Either is left alone when the user set their own (any ``MALLOC_*_`` variable, or
``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_CUDA_SETTING = "expandable_segments:True"


def _user_malloc_settings() -> list[str]:
    """MALLOC_*_ variables other than the threshold this module itself exports."""
    return [k for k in os.environ if k.startswith("MALLOC_") and k.endswith("_")
            and (k, os.environ[k]) != ("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))]


def export_for_children() -> None:
    """Put the settings in the environment of the ranks a launcher is about to start, so they
    hold from each rank's first allocation (glibc reads MALLOC_* at process start)."""
    if not _user_malloc_settings():
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = _CUDA_SETTING


def configure_cpu_allocator() -> str:
    """Map heap blocks above 64 KiB directly (see the module docstring); what was done."""
    user = _user_malloc_settings()
    if user:
        return f"glibc malloc left as set by the user ({', '.join(sorted(user))})"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return "not glibc: malloc left as it is"
    if ok != 1:
        return "mallopt(M_MMAP_THRESHOLD) refused: malloc left as it is"
    # Processes this rank starts (data workers) get the same from the first instruction.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return f"glibc malloc: blocks above {MMAP_THRESHOLD // 1024} KiB mapped directly"


def configure_cuda_allocator() -> str:
    """expandable_segments for the CUDA caching allocator, unless the user configured it."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if os.environ.get(key) and os.environ[key] != _CUDA_SETTING:
            return f"CUDA allocator left as set by the user ({key}={os.environ[key]})"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = _CUDA_SETTING  # read when CUDA allocates first
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:  # already started: change the live allocator
            torch.cuda.memory._set_allocator_settings(_CUDA_SETTING)
        except (AttributeError, RuntimeError) as e:
            return f"CUDA allocator already started; expandable segments not set ({e})"
    return f"CUDA allocator: {_CUDA_SETTING}"


def configure_allocator(device: torch.device | str) -> str:
    """The allocator settings the planner assumes, for this rank's device (see above)."""
    device = torch.device(device)
    what = configure_cpu_allocator()
    if device.type == "cuda":
        what += "; " + configure_cuda_allocator()
    log.debug(what)
    return what
