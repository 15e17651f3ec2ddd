"""Run an attention algorithm a group of KV heads at a time.

A block method keeps working buffers the size of its inputs (the float32 out accumulator in
forward; K/V in flight and the kernel's per-block gradients in backward): several times the
memory of the bf16 tensors themselves. Attention heads are independent, so the same method
run on a few KV heads (and their query heads) at a time gives identical results while those
buffers shrink by the number of groups. The cost is more, smaller messages and kernel calls:
worth it where memory is the limit (a CPU, a long sequence), not where a GPU would launch
32 x N tiny kernels per layer. :func:`kv_heads_per_group` picks the size.

``forward_by_heads`` takes a forward ``(q, k, v, doc) -> (out, lse)`` (shapes (B, S, H, D),
lse (B, H, S)) and writes each group's result into full-size outputs in the inputs' dtype.
``backward_into_heads`` takes a backward that writes a group's gradients straight into views
of the full-size outputs, ``(dout, q, k, v, out, lse, doc, dq, dk, dv) -> None``: no per-group
result tensors exist beside the outputs (see accumulate.py for summing into them exactly).
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


def kv_head_groups(hq: int, hkv: int, per_group: int = 1) -> list[tuple[slice, slice]]:
    """(query-head slice, kv-head slice) per group of ``per_group`` KV heads; q head h uses
    KV head h // (hq // hkv)."""
    g = hq // hkv
    return [(slice(i * g, min(i + per_group, hkv) * g), slice(i, min(i + per_group, hkv)))
            for i in range(0, hkv, per_group)]


def forward_by_heads(forward: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor,
                     v: Tensor, doc: Tensor | None, per_group: int) -> tuple[Tensor, Tensor]:
    groups = kv_head_groups(q.size(2), k.size(2), per_group)
    if len(groups) == 1:
        return forward(q, k, v, doc)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.size(0), q.size(2), q.size(1), dtype=torch.float32, device=q.device)
    for qs, ks in groups:
        o, l = forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], doc)
        out[:, :, qs] = o
        lse[:, qs] = l
        del o, l  # not alive during the next group's call
    return out, lse


def backward_into_heads(backward: Callable[..., None], dout: Tensor, q: Tensor, k: Tensor,
                        v: Tensor, out: Tensor, lse: Tensor, doc: Tensor | None,
                        per_group: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qs, ks in kv_head_groups(q.size(2), k.size(2), per_group):
        backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                 lse[:, qs], doc, dq[:, :, qs], dk[:, :, ks], dv[:, :, ks])
    return dq, dk, dv
