"""Attention sinks (GPT-OSS's ``s_aux``): one learned logit per head that joins every softmax.

A sink is a key with logit ``sink[h]`` and a value of zero. So it changes nothing in any
block: it is folded in once, after the blocks are merged,

    lse' = logaddexp(lse, sink)        out' = out * exp(lse - lse')

and backward runs every block with (out', lse') as usual (a zero value adds nothing to dQ,
dK, dV; the probabilities exp(s - lse') are the right ones). Its own gradient is that of a
key with dP = dO . 0 = 0:

    d sink[h] = -sum over rows of exp(sink[h] - lse') * delta,   delta = sum_d dO * out'
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def check_sinks(sinks: Tensor, heads: int, device: torch.device) -> None:
    if sinks.dim() != 1 or sinks.numel() != heads:
        raise ValueError(f"sinks must hold one logit per query head ({heads},), got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on {device} like q, got {sinks.device}")


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out', lse') of (B, S, H, Dv) ``out`` and (B, H, S) float32 ``lse`` with the sinks."""
    s = sinks.detach().float().view(1, -1, 1)
    folded = torch.logaddexp(lse, s)
    keep = torch.exp(lse - folded)  # 0 where a row saw no key (lse = -inf)
    return (out.float() * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype), folded


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d sinks (H,) from the final ``out`` and ``lse`` (after :func:`fold_sinks`)."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, S)
    p = torch.exp(sinks.detach().float().view(1, -1, 1) - lse)
    return -(p * delta).sum((0, 2)).to(sinks.dtype)
