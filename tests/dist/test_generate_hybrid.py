"""easy_context.generate on hybrid models (recurrent or convolution layers beside attention):
token for token what transformers' greedy generate gives in one process, every method, at 1,
2 and 4 gloo ranks, for a gated DeltaNet + conv (Qwen3-Next), a Mamba-2 (Granite 4 hybrid)
and a gated short convolution (LFM2) model, with left-padded prompts (lengths 13, 5 and 2:
zigzag chunks and prompts shorter than the conv kernel of 4, ends that fall mid-shard, pads
after each prompt that the state must pass unchanged). Each step's logits are within
LOGITS_TOL (relative, fp32) of transformers' too.

The prompt's recurrent state comes from the sequence-parallel prefill (the scan's final state,
the conv's last inputs gathered across ranks), then every rank decodes with the layers' own
single-step paths on it: a zero or wrong state changes the logits far beyond LOGITS_TOL
(checked by zeroing the kept state: every family here fails)."""

from __future__ import annotations

import pytest

import easy_context as ec

from .generate_cases import compare_hybrid
from .test_generate import _assert_equal

METHODS = sorted(ec.METHODS)
CORE = ["qwen3_next", "granite_hybrid", "lfm2"]
# the other routed families: the same three mechanisms under other layers
OTHERS = ["qwen3_5", "qwen3_5_moe", "olmo_hybrid", "bamba", "falcon_h1", "zamba2",
          "nemotron_h", "lfm2_moe", "lfm3"]


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_one_rank(dist1, family):
    _assert_equal(dist1.run(compare_hybrid, family, METHODS, (13, 5, 2)))


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_hybrid, family, METHODS, (13, 5, 2), 2))


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_four_ranks(dist4, family):
    _assert_equal(dist4.run(compare_hybrid, family, METHODS, (13, 5, 2), 2))


@pytest.mark.parametrize("family", OTHERS)
def test_other_hybrid_families_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_hybrid, family, ["zigzag_ring_attn", "ulysses_attn"],
                            (11, 3)))
