"""Which kernel runs a block: by name, or by the block's device, dtype and head dim.

On CUDA the choice is a list, best first (flash-attn-4 where its version runs the head dim,
flash-attn 2, torch's ops). A kernel that raises on its first call for a (device, dtype,
head dim) is dropped for that key with one log line, and the next one runs the call: a
package whose build or version cannot run a shape costs a warning, not the job. Once a
kernel has run a key, its errors are the job's (an out-of-memory error never falls back).
"""

from __future__ import annotations

import functools
import logging

import torch

from .contract import Kernel
from .cuda_ops import CUDA_TORCH, CUDA_TORCH_CUDNN, CUDA_TORCH_EFFICIENT, CUDA_TORCH_FLASH
from .flash_attn_adapters import installed_flash_attn_kernels, usable
from .kernels import CPU_FLASH, KERNELS, REFERENCE
from .variants import adapt

Tensor = torch.Tensor
log = logging.getLogger(__name__)
# (kernel name, key) -> "ok" once it ran, "failed" once it raised on its first call
_TRIALS: dict[tuple[str, tuple], str] = {}


def available_kernels() -> dict[str, Kernel]:
    """Every kernel this machine can name: the CPU ones, torch's CUDA ops, and the installed
    flash-attn adapters (whether a GPU is present or not)."""
    return {**KERNELS, **{k.name: k for k in (CUDA_TORCH, CUDA_TORCH_CUDNN, CUDA_TORCH_FLASH,
                                          CUDA_TORCH_EFFICIENT)},
            **{k.name: k for k in installed_flash_attn_kernels()}}


def select_kernel(q: Tensor, name: str | None = None) -> Kernel:
    """The kernel for ``q``'s device, dtype and head dim, or the one called ``name``.

    CPU: torch's flash op (float64: the reference). CUDA, fp16/bf16: flash-attn-4 on sm90+
    where its version runs the head dim, flash-attn 2.6+ on sm80+, when installed
    (flash_attn_adapters.usable), then torch's CUDA ops, which pick their cuDNN (sm90+),
    flash or memory-efficient kernel per call and fall back to the reference rather than fail
    (cuda_ops.py), each dropped for the key if its first call raises (first_that_runs).
    Anything else: the reference.
    """
    if name is not None:
        kernels = KERNELS if name in KERNELS else available_kernels()
        if name not in kernels:
            raise ValueError(f"unknown or unavailable attention kernel {name!r}; choose one of "
                             f"{sorted(available_kernels())}")
        return kernels[name]
    if q.device.type == "cpu":
        return CPU_FLASH if q.dtype != torch.float64 else REFERENCE
    if q.device.type == "cuda":
        candidates = tuple(k for k in installed_flash_attn_kernels() if usable(k.name, q))
        return first_that_runs(candidates + (CUDA_TORCH,), _key(q))
    return REFERENCE


def _key(q: Tensor) -> tuple:
    return (q.device.type, q.device.index, q.dtype, q.size(-1))


@functools.lru_cache(maxsize=None)
def first_that_runs(kernels: tuple[Kernel, ...], key: tuple) -> Kernel:
    """A kernel that runs each call with the first of ``kernels`` not dropped for ``key``
    (see the module docstring); the last one is never dropped."""
    def live() -> list[Kernel]:
        alive = [k for k in kernels[:-1] if _TRIALS.get((k.name, key)) != "failed"]
        return alive + [kernels[-1]]

    def call(direction: str, *args, **kwargs):
        for kernel in live():
            trial = (kernel.name, key)
            if kernel is kernels[-1] or _TRIALS.get(trial) == "ok":
                return getattr(kernel, direction)(*args, **kwargs)
            try:
                result = getattr(kernel, direction)(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of an untried kernel
                _TRIALS[trial] = "failed"
                log.warning("attention kernel %s failed on its first %s call for %s (%s: %s); "
                            "using %s from now on", kernel.name, direction, key,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                            live()[0].name)
                continue
            if direction == "backward":  # forward and backward both ran: tried
                _TRIALS[trial] = "ok"
            return result
        raise AssertionError("unreachable: the last kernel always runs")

    # each candidate does windows, soft-capping and v head dims its own way (variants.adapt:
    # flash-attn in the kernel, torch's ops around it), so the choice can fall back on any
    kernels = tuple(adapt(k) for k in kernels)
    if len(kernels) == 1:
        return kernels[0]
    return Kernel(kernels[0].name, functools.partial(call, "forward"),
                  functools.partial(call, "backward"), windows=True, softcap=True,
                  value_dim=True)
