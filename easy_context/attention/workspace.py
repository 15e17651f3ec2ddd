"""What a kernel's backward allocates besides its inputs and outputs, per call.

These transients exist only inside one backward call, but they are large and grow with the
query heads of the call, so the head groups (parallel/head_groups.py) and the planner count
them. The flash-attn 2 figures follow its ``flash_api.cpp`` ``mha_bwd``; the others are
estimates of the same kind; no GPU has measured any of them here:

- flash-attn 2 (``flash_api.cpp`` ``mha_bwd``) and torch's CUDA flash op, its copy: a float32
  ``dq_accum`` (B, Sq rounded up to 128, Hq, D rounded up to 32; 256 above 192) and the
  float32 ``softmax_d`` (B, Hq, Sq rounded); with GQA, dK and dV expanded to the query heads,
  (B, Sk, Hq, D) each in the input dtype, before they are summed over the groups. With
  deterministic backward, ``dq_accum`` is made ceil(SMs / (B x Hq)) times (one slice per
  split of the key blocks); torch's copy is counted the same (an upper bound if it does not
  split).
- torch's memory-efficient op (cuda_ops.py): its float32 gradient-of-q accumulator
  (B, Sq, Hq, D); with GQA cuda_ops.py repeats K and V to the query heads and sums the
  kernel's (B, Sk, Hq, D) dK and dV back: four such tensors in the input dtype.
- flash-attn-4 (an estimate: its backward accumulates dq in float32, and dK/dV too with
  GQA; the rounding here is assumed): ``dq_accum`` (B, Hq, Sq rounded up to 128, D rounded up
  to 64), the float32 lse and dpsum rows, and with GQA dK/dV accumulators (B, Hkv, Sk
  rounded, D rounded).
- the reference kernel (float64, or where no fused kernel runs): its scores, probabilities
  and their gradients for one tile of query rows (kernels.TILE_ELEMENTS scores, or one row
  of them when a row is wider), three such tensors in its working dtype.
- torch's CPU flash op: per-thread tiles only; not counted.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .contract import Kernel

Tensor = torch.Tensor
DEFAULT_SMS = 132  # H100 / H200 SXM: what the planner assumes for deterministic splits
FAMILIES = ("flash2", "efficient", "flash4", "reference", None)


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def backward_workspace(family: str | None, batch: int, sq: int, sk: int, hq: int, hkv: int,
                       d: int, a: int, *, deterministic: bool = False,
                       sms: int = DEFAULT_SMS) -> int:
    """Bytes one backward call of ``family`` allocates for q (batch, sq, hq, d), k and v
    (batch, sk, hkv, d) in ``a`` bytes an element (see the module docstring)."""
    gqa = hq != hkv
    if family == "flash2":
        d_r = _up(d, 32) if d <= 192 else 256
        sq_r = _up(sq, 128)
        splits = -(-sms // (batch * hq)) if deterministic else 1
        expanded = 2 * batch * sk * hq * d * a if gqa else 0
        return splits * batch * sq_r * hq * d_r * 4 + batch * hq * sq_r * 4 + expanded
    if family == "efficient":
        return batch * sq * hq * d * 4 + (4 * batch * sk * hq * d * a if gqa else 0)
    if family == "flash4":
        sq_r, sk_r, d_r = _up(sq, 128), _up(sk, 128), _up(d, 64)
        accum = 2 * batch * hkv * sk_r * d_r * 4 if gqa else 0
        return batch * hq * sq_r * d_r * 4 + 2 * batch * hq * sq_r * 4 + accum
    if family == "reference":
        from .kernels import TILE_ELEMENTS

        work = 8 if a == 8 else 4
        rows = min(sq, max(1, TILE_ELEMENTS // max(1, batch * hq * (sk + 1))))
        return 3 * batch * hq * rows * sk * work
    return 0


def planned_family(device: str, dtype: str, kernel: str | None = None) -> str | None:
    """The family the planner assumes: ``kernel`` when given (a family name), else on a GPU
    flash-attn 2 / torch's flash op for bf16 and the efficient op for fp32; none on a CPU."""
    if kernel is not None:
        if kernel not in FAMILIES:
            raise ValueError(f"unknown kernel family {kernel!r}; choose one of "
                             f"{[f for f in FAMILIES if f]}")
        return kernel
    if device == "cpu":
        return None
    return "flash2" if dtype == "bf16" else "efficient"


def runtime_family(kernel: Kernel, q: Tensor) -> str | None:
    """The family of the kernel that will run blocks like ``q``."""
    name = kernel.name
    if name == "flash_attn":
        return "flash2"
    if name == "flash_attn_4":
        return "flash4"
    if name == "reference":
        return "reference"
    if name.startswith("cuda_torch"):
        from .cuda_ops import choose_path, device_capability

        path = {"cuda_torch_flash": "flash", "cuda_torch_efficient": "efficient",
                "cuda_torch_cudnn": "cudnn"}.get(name)
        if path is None:
            path = choose_path(q, device_capability(q)) if q.is_cuda else "flash"
        # cuDNN's backward is counted as the flash op's (an assumption, not a measurement:
        # the flash figure with GQA counts dK/dV expanded to the query heads, which cuDNN's
        # native GQA may not make)
        return {"flash": "flash2", "cudnn": "flash2", "efficient": "efficient"}.get(
            path, "reference")
    return None


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block_workspace(kernel: Kernel, q: Tensor) -> Callable[[int, int, int, int], int]:
    """(sq, sk, hq, hkv) -> bytes for backward calls of ``kernel`` on blocks like ``q``
    (its batch, head dim and dtype), in torch's current deterministic setting."""
    family = runtime_family(kernel, q)
    sms = _sms(q.device.index or 0) if q.is_cuda else DEFAULT_SMS
    deterministic = torch.are_deterministic_algorithms_enabled()
    return lambda sq, sk, hq, hkv: backward_workspace(
        family, q.size(0), sq, sk, hq, hkv, q.size(-1), q.element_size(),
        deterministic=deterministic, sms=sms)
