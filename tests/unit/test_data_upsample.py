"""Per-source length upsampling (Fu et al. 2024): shares preserved, long docs upsampled."""

from __future__ import annotations

import json

import numpy as np
import pytest

from easy_context.data import PrepareConfig, UpsampleConfig, length_histogram, plan_copies, prepare_data
from tests.unit.data_fixtures import tokenizer_dir, write_jsonl


def test_plan_preserves_source_tokens_and_upsamples_long():
    rng = np.random.default_rng(0)
    # A web-like source: many short documents, a few long ones.
    lengths = np.concatenate([rng.integers(50, 1000, 20000), rng.integers(4000, 40000, 300)])
    rng.shuffle(lengths)
    cfg = UpsampleConfig(threshold=2000, keep_prob=0.3)
    copies = plan_copies(lengths, cfg, seed=1)
    before, after = lengths.sum(), (lengths * copies).sum()
    # Tolerance: the token count is a sum of ~20k random terms dominated by the long docs'
    # rounding; its relative std here is ~1%, so 4% is a >3-sigma bound.
    assert abs(after / before - 1) < 0.04
    short = lengths < 2000
    assert abs((copies[short] > 0).mean() - 0.3) < 0.02  # short kept with probability p
    long_share_before = lengths[~short].sum() / before
    long_share_after = (lengths * copies)[~short].sum() / after
    assert long_share_after > 2 * long_share_before
    r = 1 + 0.7 * lengths[short].sum() / lengths[~short].sum()
    assert set(np.unique(copies[~short])) <= {int(np.floor(r)), int(np.floor(r)) + 1}
    np.testing.assert_array_equal(copies, plan_copies(lengths, cfg, seed=1))  # deterministic
    assert not np.array_equal(copies, plan_copies(lengths, cfg, seed=2))


def test_plan_min_length_and_edge_cases():
    lengths = np.array([1, 5, 10, 100])
    np.testing.assert_array_equal(plan_copies(lengths, UpsampleConfig(), min_length=10), [0, 0, 1, 1])
    # No long documents: nothing to upsample, so nothing is dropped either.
    np.testing.assert_array_equal(plan_copies(lengths, UpsampleConfig(threshold=1000)), [1, 1, 1, 1])
    with pytest.raises(ValueError, match="--upsample-keep-prob must be in"):
        UpsampleConfig(threshold=10, keep_prob=1.5)
    assert length_histogram(np.array([1, 2, 3, 4, 7, 8])) == {"0-1": 1, "2-3": 2, "4-7": 2, "8-15": 1}


def test_prepare_keeps_source_shares(tmp_path):
    # Two sources of different length profiles and sizes; upsampling must not shift the mix.
    write_jsonl(tmp_path / "short.jsonl", n=240, length=1600, seed=3, kind="haystack")
    write_jsonl(tmp_path / "mixed.jsonl", n=120, length=4000, seed=4, kind="mix")
    out = tmp_path / "out"
    stats = prepare_data(PrepareConfig(
        inputs=[f"s={tmp_path / 'short.jsonl'}", f"m={tmp_path / 'mixed.jsonl'}"],
        tokenizer=tokenizer_dir(), output=str(out), seq_length=512,
        upsample=UpsampleConfig(threshold=400, keep_prob=0.3), seed=7))
    saved = json.loads((out / "stats.json").read_text())
    assert saved == {**stats, "seconds": saved["seconds"]}
    for s in saved["sources"]:
        # Stated tolerance: each source's emitted token share within 3 percentage points of
        # its share before sampling (expected difference 0; spread from ~100 random draws).
        assert abs(s["token_share_emitted"] - s["token_share_read"]) < 0.03, s["name"]
        assert abs(s["tokens_emitted"] / s["tokens_read"] - 1) < 0.1, s["name"]
        assert s["documents_kept"] < s["documents_read"]  # short documents were dropped
        assert s["max_copies"] >= 2  # long documents were repeated
        assert sum(s["length_histogram_emitted"].values()) == s["documents_emitted"]
