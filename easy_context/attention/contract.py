"""Block attention kernels that return ``(out, lse)``, one per backend, chosen at run time.

Every sequence-parallel method computes attention block by block and merges the partial
results, so each kernel returns the log-sum-exp of its scores next to its output, and has a
backward that takes the *final* (merged) output and lse: with those, the per-block
gradients it returns are exactly the block's share of the full-attention gradients.

The contract every backend meets (tested on CPU for all of them, see tests/unit/test_kernels*):
    q:   (B, Sq, Hq, D)          k, v: (B, Sk, Hkv, D), Hq % Hkv == 0 (GQA, never repeated
         by the caller); any strides with a contiguous last dim (head-group and row views)
    forward(q, k, v, causal, scale)  -> out (B, Sq, Hq, Dv) in q's dtype,
                                        lse (B, Hq, Sq) float32, natural log
    backward(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv shaped like q, k, v
``causal=True`` is only ever handed a *square* block (Sq == Sk, the same tokens on both
sides): there the top-left alignment of torch's ops and the bottom-right alignment of
flash-attn agree, so no backend's convention matters. Kernels refuse anything else.
No block takes a mask: packed documents are cut into sub-blocks that are each either full
or causal-square (easy_context.attention.documents), so no (Sq, Sk) tensor ever exists.

What models add beyond that (attention/variants.py turns any kernel into one that does all
of it, exactly, with what the kernel lacks done around it):
- ``window=(left, right)``, flash-attn's sliding window, bottom-right aligned: query i sees
  key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded); with ``causal``
  False. Callers (documents.py) trim a call first, so that a bounded side is >= 0 and every
  query sees a key.
- ``softcap=c``: scores s -> c * tanh(s / c) before the softmax (Gemma 2).
- v's head dim Dv may differ from q's and k's (multi-head latent attention: 192 and 128).
A kernel says which of these it does itself (:class:`Kernel` flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    """A backend: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    windows: bool = False
    """takes ``window=(left, right)`` itself"""
    softcap: bool = False
    """takes ``softcap=`` itself"""
    value_dim: bool = False
    """runs a v head dim different from q's"""
    additive_mask: bool = False
    """takes ``attn_mask=``, an additive float (Sq, Sk) mask in q's dtype (0 or -inf), on a
    call with ``causal`` False: only bands.py passes one, to run a sliding band as short
    masked tiles (a few hundred rows: no (Sq, Sk) mask of a whole block is ever made)"""


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def check_block(q: Tensor, k: Tensor, causal: bool,
                window: tuple[int, int] | None = None) -> None:
    """The shape rules of the contract: causal blocks are square, a window comes without
    ``causal`` (see the module doc)."""
    if window is not None and causal:
        raise ValueError("a windowed call says its whole band in window=(left, right); "
                         "pass causal=False with it")
    if causal and q.size(1) != k.size(1):
        raise ValueError(f"a causal block must be square (the same tokens on both sides); got "
                         f"{q.size(1)} query rows and {k.size(1)} key rows")


def grouped(q: Tensor, k: Tensor) -> tuple[int, int]:
    """(KV heads, query heads per KV head)."""
    hq, hkv = q.size(2), k.size(2)
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return hkv, hq // hkv


def finite_lse(lse: Tensor) -> Tensor:
    # Backward ops compute exp(s - lse): a row that saw no key in any block (lse = -inf) has
    # no gradient, and 0 keeps it finite (no sub-block contains such a row, so no score of it
    # is ever formed).
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def heads_first(t: Tensor) -> Tensor:
    # (B, S, H, D) -> (B, H, S, D) as a view; the CPU op keeps its input's memory layout for
    # its output, so transposing back gives a contiguous (B, S, H, D) tensor without a copy.
    return t.transpose(1, 2)
