"""easy_context.generate: token for token what transformers' greedy generate gives in one
process, for every method at 1, 2 and 4 gloo ranks, on tiny models of each family (sliding
windows, soft-capping, sinks, chunks, MLA included), with left-padded prompts whose lengths
do not divide the ranks, and 23 new tokens (they go to the ranks in turn, so every rank's
cache grows). fp32; a random tiny model's top two logits are rarely within rounding of each
other, and the comparison is exact (the same ids)."""

from __future__ import annotations

import pytest

import easy_context as ec

from .generate_cases import NEW_TOKENS, cache_shares, compare_methods, sampled, stops
from .hf_cases import FAMILIES, VARIANT_FAMILIES

METHODS = sorted(ec.METHODS)


def _assert_equal(reports):
    bad = [f"rank {r} {method}:\n  want {want}\n  got  {got}"
           for r, rep in enumerate(reports) for method, (want, got) in rep.items() if want != got]
    assert not bad, "\n".join(bad)


def test_every_method_one_rank(dist1):
    _assert_equal(dist1.run(compare_methods, "llama", METHODS, (13, 9)))


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(VARIANT_FAMILIES))
def test_every_family_and_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_methods, family, METHODS, (13, 9), 2))


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_every_method_four_ranks(dist4, family):
    _assert_equal(dist4.run(compare_methods, family, METHODS, (13, 7, 10), 2))


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_share_of_the_cache(dist1, dist2, dist4, world):
    """At 64 prompt tokens and 24 new ones, a rank's cache holds 64/N + 24/N slots (the
    buffers are sized for exactly that), against one process's 64 + 24; the tokens agree."""
    one = dist1.run(cache_shares, "zigzag_ring_attn", 64, 24)[0]
    many = (dist2 if world == 2 else dist4).run(cache_shares, "zigzag_ring_attn", 64, 24)
    for rank in many:
        assert rank["tokens"] == one["tokens"]
        assert rank["bytes"] * world == one["bytes"], (rank["bytes"], one["bytes"])


def test_sampling_is_the_same_on_any_number_of_ranks(dist1, dist2, dist4):
    """The same seed gives the same tokens at 1, 2 and 4 ranks; another seed other tokens;
    top_p small enough to keep only the top token is greedy."""
    kw = dict(temperature=0.8, top_p=0.95, top_k=40)
    one = dist1.run(sampled, "zigzag_ring_attn", 3, (13, 9), **kw)[0]
    for pool, method in ((dist2, "ring_attn"), (dist4, "ulysses_attn")):
        assert all(r == one for r in pool.run(sampled, method, 3, (13, 9), **kw))
    assert dist1.run(sampled, "zigzag_ring_attn", 4, (13, 9), **kw)[0] != one
    greedy = dist2.run(compare_methods, "llama", ["zigzag_ring_attn"], (13, 9))[0]
    top = dist2.run(sampled, "zigzag_ring_attn", 3, (13, 9), top_p=1e-6)[0]
    assert top == greedy["zigzag_ring_attn"][1]


def test_eos_ends_a_row_and_pads_it(dist2):
    for rep in dist2.run(stops, "zigzag_ring_attn"):
        free, ended, eos = rep["free"], rep["ended"], rep["eos"]
        first = free[0].index(eos)  # row 0 stops at its first EOS, which it keeps
        assert ended[0][:first + 1] == free[0][:first + 1]
        assert ended[0][first + 1:] == [1] * (len(ended[0]) - first - 1)
        if eos in free[1]:
            second = free[1].index(eos)
            assert ended[1][:second + 1] == free[1][:second + 1]
        else:  # row 1 never meets it: the whole generation is there
            assert ended[1] == free[1] and len(ended[1]) == NEW_TOKENS
