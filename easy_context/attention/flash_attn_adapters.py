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
that equals the top-left mask of the CPU op.

Sliding windows and soft-capping run in the kernels themselves. The window is flash-attn's
own (left, right), bottom-right aligned; 2.x says "unbounded" with -1 and resets a side
>= seqlen_k to -1 (flash_api.cpp), flash-attn-4 with None (its _resolve_causal_local_window
reads a negative side as a bound, or clears the window when left + right < 0), so -1 becomes
None there. softcap: 0.0 is off in 2.x, None in 4. flash-attn 2 needs v's head dim equal to
q's (CHECK_SHAPE(v, ..., head_size)), so variants.adapt pads v for it; flash-attn-4 takes its
own v head dim (within its per-architecture limits: 8..256 on SM90; up to 128, or DeepSeek's
192/128, on SM100; a shape it refuses fails its first call and the next kernel runs it). Stand-in modules with each generation's exact
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


def _fa2_args(window, softcap) -> tuple[tuple[int, int], float]:
    return (window or (-1, -1)), (0.0 if softcap is None else float(softcap))


def adapter_2_6(fai: ModuleType) -> Kernel:
    """flash-attn 2.6.x: ``fai`` is its flash_attn_interface module."""
    def forward(q, k, v, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        win, cap = _fa2_args(window, softcap)
        res = fai._flash_attn_forward(q, k, v, 0.0, _scale(q, scale), bool(causal), win, cap,
                                      None, False)
        return res[0], res[5]

    def backward(dout, q, k, v, out, lse, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        win, cap = _fa2_args(window, softcap)
        dq, dk, dv = _fresh(q), _fresh(k), _fresh(v)
        fai._flash_attn_backward(dout, q, k, v, out, finite_lse(lse).contiguous(), dq, dk, dv,
                                 0.0, _scale(q, scale), bool(causal), win, cap, None,
                                 deterministic(), None)
        return dq, dk, dv

    return Kernel(FA2, forward, backward, windows=True, softcap=True)


def adapter_2_7(fai: ModuleType) -> Kernel:
    """flash-attn 2.7.x and 2.8.x (custom ops: positional arguments only)."""
    def forward(q, k, v, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        (left, right), cap = _fa2_args(window, softcap)
        out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, _scale(q, scale), bool(causal),
                                                 left, right, cap, None, False)
        return out, lse

    def backward(dout, q, k, v, out, lse, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        (left, right), cap = _fa2_args(window, softcap)
        dq, dk, dv = _fresh(q), _fresh(k), _fresh(v)
        fai._flash_attn_backward(dout, q, k, v, out, finite_lse(lse).contiguous(), dq, dk, dv,
                                 0.0, _scale(q, scale), bool(causal), left, right, cap, None,
                                 deterministic(), None)
        return dq, dk, dv

    return Kernel(FA2, forward, backward, windows=True, softcap=True)


def _fa4_window(window) -> dict:
    if window is None:
        return {}
    left, right = window
    return {"window_size_left": None if left < 0 else left,
            "window_size_right": None if right < 0 else right}


def adapter_4(cute: ModuleType) -> Kernel:
    """flash-attn-4: ``cute`` is flash_attn.cute.interface."""
    def forward(q, k, v, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        extra = _fa4_window(window)
        if softcap is not None:
            extra["softcap"] = float(softcap)
        res = cute._flash_attn_fwd(q, k, v, softmax_scale=_scale(q, scale), causal=bool(causal),
                                   return_lse=True, **extra)
        return res[0], res[1]

    def backward(dout, q, k, v, out, lse, causal=False, scale=None, window=None, softcap=None):
        check_block(q, k, causal, window)
        extra = _fa4_window(window)
        if softcap is not None:
            extra["softcap"] = float(softcap)
        res = cute._flash_attn_bwd(q, k, v, out, dout, finite_lse(lse).contiguous(),
                                   softmax_scale=_scale(q, scale), causal=bool(causal),
                                   deterministic=deterministic(), **extra)
        return res[0], res[1], res[2]

    return Kernel(FA4, forward, backward, windows=True, softcap=True, value_dim=True)


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
    if fa4_version() is not None:
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


@functools.lru_cache(maxsize=None)
def fa4_version() -> str | None:
    """The installed flash-attn-4 version (its first betas were named flash-attn4); read once,
    as ``usable`` asks for it on every CUDA attention call."""
    return _version("flash-attn-4") or _version("flash-attn4")


def _fa4_at_least(version: str | None, release: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) >= Version(release)
    except InvalidVersion:
        return False


def fa4_runs(d: int, capability: tuple[int, int], version: str | None,
             deterministic_backward: bool = False) -> bool:
    """Whether flash-attn-4 ``version`` runs forward AND backward at head dim ``d`` (q, k and
    v alike) on ``capability``, as its sources say (flash_attn/cute/interface.py and
    flash_bwd_sm90.py / flash_bwd_sm100.py at the fa4-v4.0.0.betaN tags; no GPU ran this):

    - Hopper (sm90): the backward ran head dim 128 only before 4.0.0b5 (its tests xfail 64,
      and deterministic backward asserted off); from b5 its tuned tiles are 64, 96, 128 and
      192, deterministic allowed; above 192 still xfailed ("SM90 not supported yet").
    - Blackwell (sm100, sm110): backward up to 128, 256 from b11 (sm100) / b15 (sm110).
    - anything else (sm120 skips the head-dim checks and refuses deterministic): not used.
    """
    major = capability[0]
    if major == 9:
        if not _fa4_at_least(version, "4.0.0b5"):
            return d == 128 and not deterministic_backward
        return d in (64, 96, 128, 192)
    if major in (10, 11):
        if d <= 128 and d % 8 == 0:
            return True
        return d == 256 and _fa4_at_least(version, "4.0.0b11" if major == 10 else "4.0.0b15")
    return False


def usable(name: str, q: Tensor, capability: tuple[int, int] | None = None,
           version: str | None = None) -> bool:
    """Whether the adapter ``name`` runs blocks like ``q`` (CUDA, fp16/bf16, head dim;
    flash-attn-4: its ``version``, default the installed one)."""
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
    if name == FA4:
        return fa4_runs(d, capability, fa4_version() if version is None else version,
                        deterministic())
    return capability >= (8, 0) and d <= 256
