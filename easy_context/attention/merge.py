"""Merging partial attention results computed over disjoint sets of keys.

If block a gives (out_a, lse_a) and block b gives (out_b, lse_b) for the same queries, the
attention over both blocks is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

computed here without overflow as lse = lse_a + softplus(lse_b - lse_a) and
out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b). A row that saw no key in a block has
lse = -inf there and contributes nothing; a row that saw no key at all keeps lse = -inf, out = 0.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block into the running result, in place.

    out: (B, S, H, D) float32 accumulator; lse: (B, H, S) float32 (may be views of larger
    tensors); block_out: (B, S, H, D) any float dtype; block_lse: (B, H, S).
    """
    block_lse = block_lse.float()
    a_dead = torch.isneginf(lse)
    b_dead = torch.isneginf(block_lse)
    # d = lse_b - lse_a, with the dead cases pinned so no inf - inf appears.
    d = torch.where(a_dead | b_dead, torch.zeros_like(lse), block_lse - lse)
    # weight of block b: 1 if only b is alive, 0 if b is dead, sigmoid(d) otherwise.
    w_b = torch.sigmoid(d)
    w_b = torch.where(b_dead, torch.zeros_like(w_b), torch.where(a_dead, torch.ones_like(w_b), w_b))
    new_lse = torch.where(a_dead, block_lse, torch.where(b_dead, lse, lse + torch.nn.functional.softplus(d)))
    w = w_b.transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    # out += w * (block_out - out), with one float32 temporary
    step = block_out.to(torch.float32, copy=True)
    out.add_(step.sub_(out).mul_(w))
    lse.copy_(new_lse)


def merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge a list of (out, lse) partial results over the same queries; returns float32."""
    if not parts:
        raise ValueError("merge needs at least one (out, lse) pair")
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    lse = torch.full_like(parts[0][1], float("-inf"), dtype=torch.float32)
    for block_out, block_lse in parts:
        merge_into(out, lse, block_out, block_lse)
    return out, lse
