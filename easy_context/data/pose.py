"""PoSE collator (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via
Positional Skip-wise Training").

PoSE trains a target context T with windows of only W < T tokens: the window is split into
chunks, and each chunk's position ids are shifted by a random skip, so that over training
the model sees relative distances (and absolute positions) spanning all of [0, T) while
attention only ever costs W tokens.

For chunk i with cut points 0 = c_0 < c_1 < ... < c_k = W and skips u_1 <= ... <= u_k drawn
uniformly from [0, T - W]:

    position of token j (c_{i-1} <= j < c_i) = j + u_i

so positions increase strictly through the window (the skips are sorted), each chunk is a
run of consecutive positions, and the largest is W - 1 + u_k <= T - 1 < T.

The collator takes the packed windows of prepare-data (length W + 1: one extra target) and
returns ``input_ids`` (B, W), ``targets`` (B, W) already shifted (targets[:, t] is the
token after input t; give them to a Hugging Face model as ``shift_labels``, not ``labels``,
which it would shift again) and ``position_ids`` (B, W). With ``mask_document_ends`` the
first target of every document (an EOS->BOS prediction across documents) is -100.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PoSEConfig:
    """Positional skip-wise training."""

    target_length: int
    """T: the context length to extend to; every position id is < T."""
    num_chunks: int = 2
    """Chunks per window (the paper uses 2)."""
    seed: int = 0
    """Seed of the collator's own generator: batch n is the same on every run."""
    mask_document_ends: bool = False
    """Use -100 as the target of the last token of each packed document."""


def pose_position_ids(batch_size: int, window: int, cfg: PoSEConfig,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-wise position ids (B, W) and the chunk start indices (B, num_chunks)."""
    if window > cfg.target_length:
        raise ValueError(f"PoSE window {window} is longer than target length {cfg.target_length}; "
                         f"raise target_length or use shorter windows")
    if not 1 <= cfg.num_chunks <= window:
        raise ValueError(f"num_chunks must be in [1, window={window}], got {cfg.num_chunks}")
    k, budget = cfg.num_chunks, cfg.target_length - window
    # Cut points: k-1 distinct interior positions per row, sorted; chunk 0 starts at 0.
    interior = torch.rand(batch_size, window - 1, generator=generator).argsort(dim=1)[:, : k - 1] + 1
    starts = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), interior.sort(dim=1).values], 1)
    # Sorted skips in [0, budget]: non-decreasing, so positions stay strictly increasing.
    skips = torch.randint(0, budget + 1, (batch_size, k), generator=generator).sort(dim=1).values
    j = torch.arange(window).expand(batch_size, window)
    chunk = (j.unsqueeze(-1) >= starts.unsqueeze(1)).sum(-1) - 1  # (B, W) chunk of each token
    return j + skips.gather(1, chunk), starts


class PoSECollator:
    """Batch packed windows with skip-wise position ids; deterministic in call order."""

    def __init__(self, cfg: PoSEConfig) -> None:
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        if ids.shape[1] < 2:
            raise ValueError("PoSE needs windows of at least 2 tokens (seq_length + 1)")
        inputs, targets = ids[:, :-1], ids[:, 1:].clone()  # (B, W) each
        if self.cfg.mask_document_ends and "position_ids" in features[0]:
            doc_pos = torch.stack([torch.as_tensor(f["position_ids"]) for f in features])
            # Target t crosses into a new document when token t+1 starts one (position 0).
            targets[doc_pos[:, 1:] == 0] = -100
        position_ids, _ = pose_position_ids(inputs.shape[0], inputs.shape[1], self.cfg,
                                            self.generator)
        return {"input_ids": inputs, "targets": targets, "position_ids": position_ids}
