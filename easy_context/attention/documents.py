"""Packed documents: which keys each query may see when one sequence holds several documents.

Each token carries a document id (equal within a document). A query attends only to keys of
its own document (and, under the causal mask, not to later ones). Ids come from position ids
that restart at 0 at each document start: see :func:`document_ids_from_positions`.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def document_ids_from_positions(position_ids: Tensor) -> Tensor:
    """(B, S) position ids of the *whole* sequence -> (B, S) document ids (0, 1, 2, ...).

    A document starts where the position does not increase (a restart). Position ids with
    skips (PoSE) still increase, so they stay one document.
    """
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]).long()
    return starts.cumsum(dim=1) - 1


def is_packed(position_ids: Tensor) -> bool:
    """Whether any row of (B, S) *whole-sequence* position ids restarts (holds several
    documents). One host sync; decide it where every rank holds the whole batch."""
    return bool((position_ids[:, 1:] <= position_ids[:, :-1]).any())


def document_mask(q_doc: Tensor | None, kv_doc: Tensor | None, causal: bool):
    """How to run one block when sequences pack several documents.

    q_doc (B, Sq), kv_doc (B, Sk): per-token document ids. Returns ``(skip, causal, mask)``:
    skip when no query can see any key, else the causal flag and an additive float mask
    (B, 1, Sq, Sk) that keeps each query inside its document, or None when every token of
    the block is in one document (the common case, which keeps the fast unmasked kernel).
    """
    if q_doc is None:
        return False, causal, None
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in torch.stack(
        [q_doc.min(), q_doc.max(), kv_doc.min(), kv_doc.max()]).tolist())
    if q_hi < k_lo or k_hi < q_lo:
        return True, causal, None
    if q_lo == q_hi == k_lo == k_hi:
        return False, causal, None
    keep = q_doc[:, None, :, None] == kv_doc[:, None, None, :]
    if causal:  # fold the causal mask in: the kernels take one mask or the other
        keep = keep & torch.ones(q_doc.size(1), kv_doc.size(1), dtype=torch.bool,
                                 device=q_doc.device).tril()
    mask = torch.zeros(keep.shape, dtype=torch.float32, device=q_doc.device)
    return False, False, mask.masked_fill_(~keep, float("-inf"))
