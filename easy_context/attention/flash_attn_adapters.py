"""The flash-attn packages behind the kernel contract (kernels.py): one adapter per API
generation, chosen by the installed version.

The public flash-attn functions hide the lse from backward, so the adapters call the
per-block ops, whose argument lists and return layouts changed across releases (read from
flash_attn/flash_attn_interface.py of 2.6.0-2.6.3, 2.7.0-2.7.4 and 2.8.0-2.8.3, and from
flash_attn/cute/interface.py of flash-attn-4 4.0.0 betas):

- 2.6.x  plain functions. ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal,
  window_size, softcap, alibi_slopes, return_softmax)`` returns
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``: the lse is item 5
  (item 1 is q!). ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
  rng_state=None)`` fills dq, dk, dv.
- 2.7.x, 2.8.x  ``torch.library.custom_op``s ("flash_attn::_flash_attn_forward", CUDA):
  ``inspect.signature`` shows only ``(*args, **kwargs)``, so arguments are passed by
  position. Forward ``(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
  window_size_right, softcap, alibi_slopes, return_softmax)`` returns
  ``(out, softmax_lse, S_dmask, rng_state)``; backward ``(dout, q, k, v, out, softmax_lse,
  dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
  softcap, alibi_slopes, deterministic, rng_state)`` fills dq, dk, dv (mutated arguments).
- flash-attn-4 (``flash_attn.cute``, Hopper and Blackwell): ``_flash_attn_fwd(q, k, v, ...,
  softmax_scale=, causal=, ..., return_lse=True)`` returns ``(out, lse, ...)`` (two items in
  early betas, four later); ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=,
  causal=)`` returns ``(dq, dk, dv)``. Its lse is the natural log (it scales log2 by ln 2).
All take (B, S, H, D) with native GQA and return lse (B, H, Sq) float32. All align a causal
mask bottom-right when Sq != Sk; we only hand them square causal blocks (kernels.py), where
that equals the top-left mask of the CPU op. Stand-in modules with each generation's exact
names, signatures, registration and return layout are tested in
tests/unit/test_kernels_flash_attn.py; benchmarks/gpu_check.py runs whichever is installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import ModuleType

import torch

from .contract import Kernel, check_block, default_scale, finite_lse

Tensor = torch.Tensor
FA2, FA4 = "flash_attn", "flash_attn_4"


def _fresh(t: Tensor) -> Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def deterministic() -> bool:
    """Ask for flash-attn's deterministic backward (no atomic adds) when torch is in
    deterministic mode (--deterministic, easy_context.train.determinism)."""
    return torch.are_deterministic_algorithms_enabled()


def _scale(q: Tensor, scale: float | None) -> float:
    return float(default_scale(q.size(-1)) if scale is None else scale)


def adapter_2_6(fai: ModuleType) -> Kernel:
    """flash-attn 2.6.x: ``fai`` is its flash_attn_interface module."""
    def forward(q, k, v, causal=False, scale=None):
        check_block(q, k, causal)
        res = fai._flash_attn_forward(q, k, v, 0.0, _scale(q, scale), bool(causal), (-1, -1),
                                      0.0, None, False)
        return res[0], res[5]

    def backward(dout, q, k, v, out, lse, causal=False, scale=None):
        check_block(q, k, causal)
        dq, dk, dv = _fresh(q), _fresh(k), _fresh(v)
        fai._flash_attn_backward(dout, q, k, v, out, finite_lse(lse).contiguous(), dq, dk, dv,
                                 0.0, _scale(q, scale), bool(causal), (-1, -1), 0.0, None,
                                 deterministic(), None)
        return dq, dk, dv

    return Kernel(FA2, forward, backward)


def adapter_2_7(fai: ModuleType) -> Kernel:
    """flash-attn 2.7.x and 2.8.x (custom ops: positional arguments only)."""
    def forward(q, k, v, causal=False, scale=None):
        check_block(q, k, causal)
        out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, _scale(q, scale), bool(causal),
                                                 -1, -1, 0.0, None, False)
        return out, lse

    def backward(dout, q, k, v, out, lse, causal=False, scale=None):
        check_block(q, k, causal)
        dq, dk, dv = _fresh(q), _fresh(k), _fresh(v)
        fai._flash_attn_backward(dout, q, k, v, out, finite_lse(lse).contiguous(), dq, dk, dv,
                                 0.0, _scale(q, scale), bool(causal), -1, -1, 0.0, None,
                                 deterministic(), None)
        return dq, dk, dv

    return Kernel(FA2, forward, backward)


def adapter_4(cute: ModuleType) -> Kernel:
    """flash-attn-4: ``cute`` is flash_attn.cute.interface."""
    def forward(q, k, v, causal=False, scale=None):
        check_block(q, k, causal)
        res = cute._flash_attn_fwd(q, k, v, softmax_scale=_scale(q, scale), causal=bool(causal),
                                   return_lse=True)
        return res[0], res[1]

    def backward(dout, q, k, v, out, lse, causal=False, scale=None):
        check_block(q, k, causal)
        res = cute._flash_attn_bwd(q, k, v, out, dout, finite_lse(lse).contiguous(),
                                   softmax_scale=_scale(q, scale), causal=bool(causal),
                                   deterministic=deterministic())
        return res[0], res[1], res[2]

    return Kernel(FA4, forward, backward)


def generation(version: str) -> str | None:
    """The adapter for a flash-attn 2 version string: "2.6", "2.7" (2.7 and 2.8), or None."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    if major != 2 or minor < 6:
        return None
    return "2.6" if minor == 6 else "2.7"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def installed_flash_attn_kernels() -> tuple[Kernel, ...]:
    """Adapters for the flash-attn packages installed here, flash-attn-4 first. A package
    that fails to import (no GPU build, a broken install) is left out, not fatal."""
    found = []
    if _version("flash-attn-4") is not None:
        try:
            found.append(adapter_4(importlib.import_module("flash_attn.cute.interface")))
        except Exception:  # noqa: BLE001 - any import failure means: not usable here
            pass
    gen = generation(_version("flash-attn") or "")
    if gen is not None:
        try:
            fai = importlib.import_module("flash_attn.flash_attn_interface")
            found.append((adapter_2_6 if gen == "2.6" else adapter_2_7)(fai))
        except Exception:  # noqa: BLE001
            pass
    return tuple(found)


def installed_flash_attn() -> Kernel | None:
    kernels = installed_flash_attn_kernels()
    return kernels[0] if kernels else None


def usable(name: str, q: Tensor, capability: tuple[int, int] | None = None) -> bool:
    """Whether the adapter ``name`` runs blocks like ``q`` (CUDA, fp16/bf16, head dim)."""
    if q.device.type != "cuda" and capability is None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if capability is None:
        from .cuda_ops import device_capability
        capability = device_capability(q)
    d = q.size(-1)
    if d % 8:
        return False
    if name == FA4:  # Hopper: 8..256; Blackwell: up to 128, or 256 (its dedicated kernel)
        major = capability[0]
        return (major == 9 and d <= 256) or (major in (10, 11) and (d <= 128 or d == 256))
    return capability >= (8, 0) and d <= 256


def flash_attn_for(q: Tensor) -> Kernel | None:
    """The first installed flash-attn adapter that runs ``q``'s blocks, or None."""
    for kernel in installed_flash_attn_kernels():
        if usable(kernel.name, q):
            return kernel
    return None
