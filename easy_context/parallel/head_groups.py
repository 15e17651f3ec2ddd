"""Run an attention algorithm a group of KV heads at a time, the group sized by a budget.

A block method keeps working buffers proportional to the heads it works on (K/V in flight,
the kernel's per-block gradients, the float32 dq sum, gathered K/V): several times the
memory of the bf16 tensors themselves. Attention heads are independent, so the same method
run on a few KV heads (and their query heads) at a time gives identical results while those
buffers shrink by the number of groups. The cost is more, smaller messages and kernel calls:
a few percent on a CPU (8K tokens on 2 ranks, one pass per KV head against one for all 8:
1.04-1.07x the time, half the peak; benchmarks/head_groups.py), but on a GPU 32 groups
(Llama-2) would launch 32 x N small kernels and transfers per layer.

So the group size comes from a byte budget for those buffers: the most KV heads whose
buffers (the method's own formula, ``Method.group_buffers``) fit, all of them when they fit
(:func:`kv_heads_per_group`). The budget is per device kind (:data:`BUDGETS`) and can be set
for a region of code with :func:`attention_buffer_budget`; the memory planner sizes the same
groups with the same function (``Method.buffers``).

``forward_by_heads`` takes a forward ``(q, k, v) -> (out, lse)`` (shapes (B, S, H, D),
lse (B, H, S)) and writes each group's result into full-size outputs in the inputs' dtype.
``backward_into_heads`` takes a backward that writes a group's gradients straight into views
of the full-size outputs, ``(dout, q, k, v, out, lse, dq, dk, dv) -> None``: no per-group
result tensors exist beside the outputs (see accumulate.py for summing into them exactly).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

Tensor = torch.Tensor

# Bytes the per-group buffers of one attention call may take. GPU: about 2.5% of an 80 GB
# device; it holds all 8 KV heads of Llama-3-8B at 64K tokens per rank (ring: 256 MiB per
# KV head), and Llama-2-7B's 32 in 4 groups. CPU: small, because there grouping costs
# nothing and memory is what runs out; it keeps tiny blocks (tests, short prompts) in one
# group and gives one KV head per group from a few thousand tokens per rank up.
BUDGETS = {"cuda": 2 * 2**30, "cpu": 4 * 2**20}
_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("attention_buffer_budget",
                                                           default=None)


def buffer_budget(device: torch.device | str) -> int:
    """The budget for ``device`` (its kind's, or the one set by attention_buffer_budget)."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    kind = torch.device(device).type
    return BUDGETS.get(kind, BUDGETS["cuda"])


@contextlib.contextmanager
def attention_buffer_budget(nbytes: int) -> Iterator[None]:
    """Use ``nbytes`` as the buffer budget of every attention call inside (0: one KV head
    per group; a huge number: all heads at once)."""
    token = _OVERRIDE.set(int(nbytes))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def kv_heads_per_group(group_bytes: Callable[[int], int], kv_heads: int, budget: int) -> int:
    """The most KV heads g (1 <= g <= kv_heads) with ``group_bytes(g) <= budget`` (where none
    fits, the g that needs least), then evened out over the groups that needs (8 heads at
    most 3 a group: 3 groups of 3, 3, 2)."""
    fit = next((g for g in range(kv_heads, 0, -1) if group_bytes(g) <= budget), None)
    if fit is None:
        # nothing fits: the group that needs least. Mostly one KV head, but not always: a
        # deterministic flash-attn backward makes its dq accumulator once per split, and
        # fewer heads a call mean more splits (attention/workspace.py)
        fit = min(range(kv_heads, 0, -1), key=group_bytes)
    groups = -(-kv_heads // fit)
    return -(-kv_heads // groups)


def kv_head_groups(hq: int, hkv: int, per_group: int = 1) -> list[tuple[slice, slice]]:
    """(query-head slice, kv-head slice) per group of ``per_group`` KV heads; q head h uses
    KV head h // (hq // hkv)."""
    g = hq // hkv
    return [(slice(i * g, min(i + per_group, hkv) * g), slice(i, min(i + per_group, hkv)))
            for i in range(0, hkv, per_group)]


def forward_by_heads(forward: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor,
                     v: Tensor, per_group: int) -> tuple[Tensor, Tensor]:
    groups = kv_head_groups(q.size(2), k.size(2), per_group)
    if len(groups) == 1:
        return forward(q, k, v)
    out = q.new_empty(*q.shape[:3], v.size(-1))  # v's head dim (MLA: not q's)
    lse = torch.empty(q.size(0), q.size(2), q.size(1), dtype=torch.float32, device=q.device)
    for qs, ks in groups:
        o, l = forward(q[:, :, qs], k[:, :, ks], v[:, :, ks])
        out[:, :, qs] = o
        lse[:, qs] = l
        del o, l  # not alive during the next group's call
    return out, lse


def backward_into_heads(backward: Callable[..., None], dout: Tensor, q: Tensor, k: Tensor,
                        v: Tensor, out: Tensor, lse: Tensor, per_group: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qs, ks in kv_head_groups(q.size(2), k.size(2), per_group):
        backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                 lse[:, qs], dq[:, :, qs], dk[:, :, ks], dv[:, :, ks])
    return dq, dk, dv
