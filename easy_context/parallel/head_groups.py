"""Run a sequence-parallel method one KV-head group at a time.

A block method keeps working buffers the size of its inputs (the float32 out accumulator in
forward; K/V in flight and the kernel's per-block gradients in backward): several times the
memory of the bf16 tensors themselves. Attention heads are independent, so the same method
run on one KV head and its query heads at a time gives identical results while those buffers
shrink by the number of KV heads. The cost is more, smaller messages and kernel calls; at the lengths
where sequence parallelism matters the calls stay large.

``forward_by_heads`` / ``backward_by_heads`` wrap a method's forward ``(q, k, v) -> (out,
lse)`` and backward ``(dout, q, k, v, out, lse) -> (dq, dk, dv)`` (shapes (B, S, H, D), lse
(B, H, S)) and write each group's result into full-size outputs in the inputs' dtypes.
``backward_into_heads`` takes a backward that writes a group's gradients straight into views
of the full-size outputs, ``(dout, q, k, v, out, lse, dq, dk, dv) -> None``: no per-group
result tensors exist beside the outputs (see accumulate.py for summing into them exactly).
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


def kv_head_groups(hq: int, hkv: int) -> list[tuple[slice, slice]]:
    """(query-head slice, kv-head slice) per KV head: q head h uses KV head h // (hq // hkv)."""
    g = hq // hkv
    return [(slice(i * g, (i + 1) * g), slice(i, i + 1)) for i in range(hkv)]


def forward_by_heads(forward: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
                     q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    groups = kv_head_groups(q.size(2), k.size(2))
    if len(groups) == 1:
        return forward(q, k, v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.size(0), q.size(2), q.size(1), dtype=torch.float32, device=q.device)
    for qs, ks in groups:
        o, l = forward(q[:, :, qs], k[:, :, ks], v[:, :, ks])
        out[:, :, qs] = o
        lse[:, qs] = l
        del o, l
    return out, lse


def backward_by_heads(backward: Callable[..., tuple[Tensor, Tensor, Tensor]], dout: Tensor,
                      q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    groups = kv_head_groups(q.size(2), k.size(2))
    if len(groups) == 1:
        return backward(dout, q, k, v, out, lse)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qs, ks in groups:
        dq_g, dk_g, dv_g = backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                    out[:, :, qs], lse[:, qs])
        dq[:, :, qs] = dq_g
        dk[:, :, ks] = dk_g
        dv[:, :, ks] = dv_g
        del dq_g, dk_g, dv_g  # not alive during the next group's backward
    return dq, dk, dv


def backward_into_heads(backward: Callable[..., None], dout: Tensor, q: Tensor, k: Tensor,
                        v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qs, ks in kv_head_groups(q.size(2), k.size(2)):
        backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, qs],
                 dq[:, :, qs], dk[:, :, ks], dv[:, :, ks])
    return dq, dk, dv
