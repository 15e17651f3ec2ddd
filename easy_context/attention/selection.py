"""Which kernel runs a block: by name, or by the block's device, dtype and head dim."""

from __future__ import annotations

import torch

from .contract import Kernel
from .cuda_ops import CUDA_TORCH, CUDA_TORCH_EFFICIENT, CUDA_TORCH_FLASH
from .flash_attn_adapters import flash_attn_for, installed_flash_attn_kernels
from .kernels import CPU_FLASH, KERNELS, REFERENCE

Tensor = torch.Tensor


def available_kernels() -> dict[str, Kernel]:
    """Every kernel this machine can name: the CPU ones, torch's CUDA ops, and the installed
    flash-attn adapters (whether a GPU is present or not)."""
    return {**KERNELS, **{k.name: k for k in (CUDA_TORCH, CUDA_TORCH_FLASH, CUDA_TORCH_EFFICIENT)},
            **{k.name: k for k in installed_flash_attn_kernels()}}


def select_kernel(q: Tensor, name: str | None = None) -> Kernel:
    """The kernel for ``q``'s device, dtype and head dim, or the one called ``name``.

    CPU: torch's flash op (float64: the reference). CUDA, fp16/bf16: flash-attn-4 on sm90+
    or flash-attn 2.6+ on sm80+ when installed and the head dim suits it
    (flash_attn_adapters.usable), else torch's CUDA ops, which pick their flash or
    memory-efficient kernel per call and fall back to the reference rather than fail
    (cuda_ops.py). Anything else: the reference.
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
        return flash_attn_for(q) or CUDA_TORCH
    return REFERENCE
