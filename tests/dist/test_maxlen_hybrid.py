"""Max-length mode trains hybrid models (recurrent and attention layers) exactly: the generic
path runs each recurrent layer's own forward, its mixer whole (routed to the sequence-parallel
kernels that exchange the state between ranks, recomputed in backward on every rank in the
same order) and its MLP or MoE in sequence tiles; attention layers go their own path. One
step's loss and every parameter gradient (summed over ranks) within 1e-5 (fp32) of float64 in
one process, at 1 and 2 ranks (zigzag and Ulysses), tiles smaller than a shard, one query head
per chunk, offloaded inputs, the nested recompute, kept attention; packed documents, also
between two forwards and one backward (the ids Jamba's Mamba layers get are replayed)."""

import pytest

from .maxlen_hybrid_cases import (check_documents_between_forwards, check_hybrid_max_length,
                                  forced_fused_error, hybrid_calls, hybrid_paths,
                                  train_flags_turn_it_on)

TOL = 1e-5
# (mlp_tile, heads_per_chunk, checkpointing, keep_every) on 4 query / 2 KV heads, shards of 12
# (2 ranks) and 24 tokens (1 rank): one query head per chunk; offloaded inputs with the nested
# recompute; kept attention; the nested recompute on the device
CASES = [(5, 1, "full", 1), (3, 2, "offload", 2), (4, 2, "attention", 1), (6, 2, "full", 2)]
ULYSSES = [(5, 2, "offload", 2), (4, 2, "attention", 1)]  # a chunk's heads split over 2 ranks
# gated DeltaNet, Mamba-2 (with Granite's shared MLP; Nemotron-H's Mamba, attention, MLP and
# MoE blocks; Falcon-H1's attention and Mamba side by side), short conv, Mamba-1 (with an
# MoE); Zamba2's hybrid layers: Mamba-2 fed by the shared attention block (its parameters
# tied between the layers: each layer's recompute hands back its part of their gradient,
# summed), whose MLP (shared_transformer.feed_forward, handed the layer's index) is tiled
FAMILIES = ["qwen3_next", "granite_hybrid", "nemotron_h", "lfm2", "jamba", "falcon_h1",
            "zamba2"]
MORE = ["kimi_linear", "lfm3", "bamba", "olmo_hybrid", "qwen3_5", "qwen3_5_moe"]


def _assert(reports):
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}"
           for r, rep in enumerate(reports) for case, (le, ge) in rep.items()
           if not (le <= TOL and ge <= TOL)]
    assert reports and all(reports), "no case ran"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", FAMILIES + MORE)
def test_one_rank(dist1, family):
    assert set(dist1.run(hybrid_paths, family)[0]) == {"generic"}
    _assert(dist1.run(check_hybrid_max_length, family, "local", CASES))


def test_mixer_wider_than_the_hidden_states(dist1):
    # the MLP probe's width is the MLP's own: Qwen3.5's layers hold no config, and their
    # first linear layer (the gated DeltaNet's) takes 8 value heads of 8 (64), not hidden 32
    _assert(dist1.run(check_hybrid_max_length, "qwen3_5", "local", CASES[:1],
                      linear_num_value_heads=8))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_zigzag(dist2, family):
    _assert(dist2.run(check_hybrid_max_length, family, "zigzag_ring_attn", CASES))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_ulysses(dist2, family):
    _assert(dist2.run(check_hybrid_max_length, family, "ulysses_attn", ULYSSES))


@pytest.mark.parametrize("family,method", [("qwen3_next", "zigzag_ring_attn"),
                                           ("jamba", "zigzag_ring_attn"),
                                           ("granite_hybrid", "ulysses_attn"),
                                           ("lfm2", "ulysses_attn")])
def test_packed_documents_two_ranks(dist2, family, method):
    cases = CASES[:2] if method == "zigzag_ring_attn" else ULYSSES[:1]
    _assert(dist2.run(check_hybrid_max_length, family, method, cases, packed=True))


@pytest.mark.parametrize("family", ["jamba", "granite_hybrid"])
def test_packed_documents_between_forwards_two_ranks(dist2, family):
    # two packed batches forward, one backward: each recompute sees its own batch's ids
    # (Jamba: recorded from its decoder layer's call, replayed by the generic path; Granite:
    # in the call's kwargs, kept with them). Device storage: the host storage and the nested
    # recompute hold one forward's layer inputs at a time
    reports = dist2.run(check_documents_between_forwards, family, "zigzag_ring_attn",
                        (5, 2, "full", 1))
    assert all(le <= TOL and ge <= TOL for le, ge in reports), reports


@pytest.mark.parametrize("family", ["nemotron_h", "granite_hybrid", "falcon_h1", "zamba2"])
def test_tiles_and_chunks_reach_the_modules(dist1, family):
    """24 tokens: every MLP (Granite's shared MLP, Nemotron-H's MLP and MoE blocks, Zamba2's
    shared block's) gets tiles
    of 5 (forward, and backward's recompute), every attention call one query head, and every
    recurrent mixer the whole sequence."""
    seen = dist1.run(hybrid_calls, family, 5, 1)[0]
    # 3: the tiled backward's check (memory/tiled_backward.py) on 8 tokens, of Granite's
    # attention layers (with their shared MLP); the others' attention shares a layer with a
    # recurrent mixer (Falcon-H1, Zamba2) or no MLP (Nemotron-H): never split, not checked
    want = {5, 4, 3} if family == "granite_hybrid" else {5, 4}
    assert set(seen["mlp tokens"]) == want, seen
    assert seen["heads"] and set(seen["heads"]) == {1}, seen
    assert seen["mixer tokens"] and set(seen["mixer tokens"]) == {24}, seen


def test_fused_path_forced_on_a_recurrent_layer_is_refused(dist1):
    message = dist1.run(forced_fused_error, "granite_hybrid")[0]
    assert "GraniteMoeHybridMambaLayer" in message and "fused layer does not run" in message


def test_train_flags_for_a_mixer_the_planner_does_not_read(dist1):
    # the planner reads no KDA (nor Mamba-1) sizes: given tile and chunk as numbers, train
    # turns max-length mode on without it (it refused with the planner's message)
    assert dist1.run(train_flags_turn_it_on, "kimi_linear")[0] == (True, True)
