"""Hybrid models train sequence-parallel exactly: one step's loss and every parameter gradient
within 1e-5 (fp32) of float64 in one process, for every method at 2 ranks (Qwen3-Next at 1 too;
three methods at 4 for Qwen3-Next and LFM2), pieces shorter than the conv halo, packed documents
(gated DeltaNet, short conv, Mamba-2); unrouted recurrent layers are refused. Families: gated
DeltaNet (Qwen3-Next, Qwen3.5 dense and MoE, OLMo hybrid), short convolutions (LFM2, LFM2-MoE,
LFM3), Mamba-2 (Granite 4, Bamba, Nemotron-H, Falcon-H1, Zamba2), KDA (Kimi Linear), Mamba-1
(Jamba: every method at 1, 2 and 4 ranks, as Kimi Linear); configs of three of them with no
attention layer at all."""

import pytest

import easy_context as ec

from .hf_recurrent_cases import (check_granite_hybrid, check_hybrid, check_hybrid_documents,
                                 check_qwen3_next, check_documents_checkpointed,
                                 check_qwen3_next_documents, check_unrouted_is_refused)

TOL = 1e-5


def _assert_small(reports):
    bad = [f"rank {r} {m}: loss {le:.2e} grad {ge:.2e}" for r, rep in enumerate(reports)
           for m, (le, ge) in rep.items() if not (le <= TOL and ge <= TOL)]
    assert reports and all(reports), "no case ran"
    assert not bad, "\n".join(bad)


def test_qwen3_next_every_method_1_rank(dist1):
    _assert_small(dist1.run(check_qwen3_next, sorted(ec.METHODS)))


def test_qwen3_next_every_method_2_ranks(dist2):
    _assert_small(dist2.run(check_qwen3_next, sorted(ec.METHODS)))


@pytest.mark.slow
def test_qwen3_next_4_ranks(dist4):
    # pieces of 1 token (zigzag over 4 ranks, length 16): the halo spans 3 pieces
    _assert_small(dist4.run(check_qwen3_next, ["zigzag_ring_attn", "ulysses_attn", "usp_attn"], 1))


def test_granite_hybrid_mamba2_every_method_2_ranks(dist2):
    _assert_small(dist2.run(check_granite_hybrid, sorted(ec.METHODS)))


@pytest.mark.parametrize("method,ring_degree", [("zigzag_ring_attn", None), ("ulysses_attn", None)])
def test_qwen3_next_packed_documents_2_ranks(dist2, method, ring_degree):
    reports = dist2.run(check_qwen3_next_documents, method, ring_degree)
    assert all(le <= TOL and ge <= TOL for le, ge in reports), reports


def test_hybrid_switched_without_apply_is_refused(dist2):
    messages = dist2.run(check_unrouted_is_refused)
    assert all("apply_sequence_parallel" in m for m in messages), messages


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lfm2", "lfm2_moe",
                                    "lfm3", "bamba", "nemotron_h", "falcon_h1", "zamba2",
                                    "jamba", "kimi_linear"])
def test_hybrid_family_every_method_2_ranks(dist2, family):
    _assert_small(dist2.run(check_hybrid, family, sorted(ec.METHODS)))


@pytest.mark.parametrize("family,method", [("lfm2", "zigzag_ring_attn"),
                                           ("granite_hybrid", "ulysses_attn"),
                                           ("jamba", "zigzag_ring_attn"), ("jamba", "usp_attn"),
                                           ("kimi_linear", "ulysses_attn")])
def test_hybrid_packed_documents_2_ranks(dist2, family, method):
    # one family per kernel kind not covered above: short conv, Mamba-2, Mamba-1 (whose decoder
    # layer passes the mixer no document_ids: recorded from its caller), KDA
    ring_degree = 2 if method == "usp_attn" else None
    reports = dist2.run(check_hybrid_documents, family, method, ring_degree)
    assert all(le <= TOL and ge <= TOL for le, ge in reports), reports


@pytest.mark.slow
def test_lfm2_4_ranks(dist4):
    # pieces of 1 token (zigzag over 4 ranks): the short conv's halo of 3 spans 3 pieces
    _assert_small(dist4.run(check_hybrid, "lfm2", ["zigzag_ring_attn", "ulysses_attn",
                                                   "usp_attn"], 1))


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next", "granite_hybrid", "lfm2"])
def test_chunked_loss_2_ranks(dist2, family):
    # the chunked loss (the decoder's last hidden state, the head chunk by chunk); for
    # Falcon-H1 it scales the logits by lm_head_multiplier, as Falcon-H1's forward does
    _assert_small(dist2.run(check_hybrid, family, ["zigzag_ring_attn", "ulysses_attn"], 2, True))


@pytest.mark.parametrize("family", ["jamba", "kimi_linear"])
def test_mamba1_and_kda_every_method_1_rank(dist1, family):
    _assert_small(dist1.run(check_hybrid, family, sorted(ec.METHODS)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["jamba", "kimi_linear"])
def test_mamba1_and_kda_every_method_4_ranks(dist4, family):
    # pieces of 1 token: the conv's halo of 3 spans 3 pieces; every piece a one-token map
    _assert_small(dist4.run(check_hybrid, family, sorted(ec.METHODS), 1))


@pytest.mark.parametrize("family", ["jamba", "granite_hybrid"])
def test_packed_documents_under_activation_checkpointing_2_ranks(dist2, family):
    # two packed batches forward, one backward: every recompute sees its own batch's ids (Jamba:
    # recorded from its decoder layer and replayed by the checkpoint function; Granite: in the
    # call's kwargs)
    reports = dist2.run(check_documents_checkpointed, family, "zigzag_ring_attn")
    assert all(le <= TOL and ge <= TOL for le, ge in reports), reports


@pytest.mark.parametrize("family", ["qwen3_next_no_attention", "granite_no_attention",
                                    "lfm2_no_attention"])
def test_no_attention_layer_every_method_2_ranks(dist2, family):
    # every token mixer recurrent (a hybrid config without its attention layers): runs, exact,
    # where it was refused ("found no attention layers")
    _assert_small(dist2.run(check_hybrid, family, sorted(ec.METHODS)))


def test_no_attention_layer_4_ranks(dist4):
    # USP 2 x 2, zigzag pieces of 1 token (the conv halo spans 3 pieces)
    _assert_small(dist4.run(check_hybrid, "qwen3_next_no_attention",
                            ["zigzag_ring_attn", "usp_attn"], 1))
