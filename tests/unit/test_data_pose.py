"""PoSE collator: skip-wise positions are monotone, bounded by T, contiguous per chunk."""

from __future__ import annotations

import pytest
import torch

from easy_context.data import PoSECollator, PoSEConfig, pose_position_ids


def _windows(b: int, w: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 1000, (w + 1,), generator=g).tolist()} for _ in range(b)]


@pytest.mark.parametrize("num_chunks", [1, 2, 4])
def test_pose_positions(num_chunks):
    W, T = 64, 1024
    cfg = PoSEConfig(target_length=T, num_chunks=num_chunks, seed=1)
    feats = _windows(16, W)
    batch = PoSECollator(cfg)(feats)
    ids = torch.tensor([f["input_ids"] for f in feats])
    assert torch.equal(batch["input_ids"], ids[:, :-1])
    assert torch.equal(batch["targets"], ids[:, 1:])  # already shifted
    pos = batch["position_ids"]
    assert pos.shape == (16, W) and pos.dtype == torch.long
    assert (pos >= 0).all() and (pos < T).all()
    steps = pos.diff(dim=1)
    assert (steps >= 1).all()  # strictly increasing within a window
    # Chunk contents contiguous: positions step by exactly 1 except at <= k-1 chunk starts.
    assert ((steps > 1).sum(dim=1) <= num_chunks - 1).all()
    if num_chunks == 1:
        assert (steps == 1).all()
    # Skips actually spread positions over the target range (not all stuck near 0).
    assert pos[:, -1].float().mean() > W + 0.25 * (T - W)


def test_pose_chunk_starts_and_edges():
    cfg = PoSEConfig(target_length=10, num_chunks=3)
    g = torch.Generator().manual_seed(3)
    pos, starts = pose_position_ids(200, 10, cfg, g)
    assert torch.equal(pos, torch.arange(10).expand(200, 10))  # T == W: no room to skip
    assert (starts[:, 0] == 0).all() and (starts.diff(dim=1) > 0).all() and (starts < 10).all()
    pos, starts = pose_position_ids(200, 8, PoSEConfig(target_length=40, num_chunks=3), g)
    for p, s in zip(pos, starts):
        bounds = s.tolist() + [8]
        for a, b in zip(bounds[:-1], bounds[1:]):
            chunk = p[a:b]
            assert torch.equal(chunk, chunk[0] + torch.arange(b - a))  # contiguous run
    assert pos.max() < 40  # bounded by T
    with pytest.raises(ValueError, match="longer than target length"):
        pose_position_ids(1, 50, PoSEConfig(target_length=40), g)


def test_pose_deterministic_by_seed_and_masks_document_ends():
    feats = _windows(4, 32)
    a = PoSECollator(PoSEConfig(target_length=256, seed=7))
    b = PoSECollator(PoSEConfig(target_length=256, seed=7))
    for _ in range(3):  # the same sequence of batches, call after call
        assert torch.equal(a(feats)["position_ids"], b(feats)["position_ids"])
    c = PoSECollator(PoSEConfig(target_length=256, seed=8))
    assert not torch.equal(a(feats)["position_ids"], c(feats)["position_ids"])

    pos = list(range(10)) + list(range(23))  # a document starts at index 10
    feat = {"input_ids": list(range(100, 133)), "position_ids": pos}
    out = PoSECollator(PoSEConfig(target_length=256, mask_document_ends=True))([feat])
    assert out["targets"][0, 9] == -100  # predicting the next document's first token
    assert (out["targets"][0, torch.arange(32) != 9] >= 100).all()
