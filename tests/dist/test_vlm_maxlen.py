"""Max-length mode with images equals the plain model in one process (fp32).

The tower runs as without max-length mode (each rank encodes the images overlapping its
shard); the decoder's layers run tiled (MLP tiles of 3-5 tokens against shards of 24 and 48)
and head-chunked (one query head per chunk where the method allows), with offloaded inputs,
kept attention and the nested recompute, the final norm applied in the loss's chunks. Tiny
Qwen2.5-VL (multimodal RoPE positions (3, B, L) through the fused and the generic path),
LLaVA (a Llama decoder after a CLIP tower) and Gemma 3 (image spans, bidirectional inside,
reaching each head chunk's attention; its sandwich norms take the generic path), images
straddling the shard boundaries: the loss within 1e-5 relative of the model's own forward on
the whole step, and every gradient, vision tower included, summed over ranks, within 1e-5 of
its max |grad| (vlm_maxlen_cases.py; measured ~1e-7 and ~1e-6).
"""

import pytest

from .vlm_maxlen_cases import check_vlm_max_length, max_length_vlm_error

TOL = 1e-5
# (mlp_tile, heads_per_chunk, checkpointing, keep_every) on 4 query / 2 KV heads
CASES = [(5, 1, "full", 1), (3, 2, "offload", 1), (4, 2, "attention", 2)]
ULYSSES = [(5, 2, "full", 1), (3, 2, "offload", 2)]  # a chunk must split over 2 ranks
PATHS = {"qwen2_5_vl": {"fused"}, "llava": {"fused"}, "gemma3": {"generic"}}


def _assert(reports, straddles: bool):
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}, vision grad {vg:.1e}"
           for r, rep in enumerate(reports) for case, (le, ge, vg, *_) in rep.items()
           if not (le <= TOL and ge <= TOL and vg > 0)]
    assert not bad, "\n".join(bad)
    if straddles:  # some image was encoded by both ranks
        encoded = [sum(v[3] for v in rep.values()) // len(rep)
                   for rep in reports]
        assert 5 < sum(encoded), encoded


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3"])
def test_vlm_max_length_one_rank(dist1, family):
    reports = dist1.run(check_vlm_max_length, family, "local", CASES)
    _assert(reports, False)
    assert {p for v in reports[0].values() for p in v[4]} == PATHS[family], reports


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_vlm_max_length_whole_logits(dist1, family):
    """causal_lm_loss(chunked=False): the tiled layers, then the decoder's own final norm and
    the head on the whole logits."""
    _assert(dist1.run(check_vlm_max_length, family, "local", CASES[:1], chunked=False), False)


def test_vlm_max_length_generic_path_multimodal_rope(dist1):
    """Qwen2.5-VL's layers forced onto the generic path: the multimodal RoPE tables reach the
    layer's own attention, and are computed again in backward."""
    _assert(dist1.run(check_vlm_max_length, "qwen2_5_vl", "local", CASES[:2], False,
                      "generic"), False)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3"])
def test_vlm_max_length_two_ranks(dist2, family):
    _assert(dist2.run(check_vlm_max_length, family, "zigzag_ring_attn", CASES), True)
    _assert(dist2.run(check_vlm_max_length, family, "ulysses_attn", ULYSSES), True)


def test_vlm_max_length_packed_two_ranks(dist2):
    """Two conversations, the second starting inside an image's run, with multimodal RoPE."""
    _assert(dist2.run(check_vlm_max_length, "qwen2_5_vl", "zigzag_ring_attn", CASES[:1], True),
            True)


def test_gemma3_max_length_without_spans_differs(dist2):
    """The Gemma 3 case is one where the spans matter: dropped, the loss is off."""
    reports = dist2.run(check_vlm_max_length, "gemma3", "zigzag_ring_attn", CASES[:1], False,
                        "auto", True)
    assert all(not (le <= TOL) for rep in reports for le, *_ in rep.values()), reports


def test_qwen3_vl_deepstack_max_length(dist2):
    """Qwen3-VL's deepstack features, added to the hidden states after layer 0, are exact
    with every layer input kept; the nested recompute (which regenerates a layer's input by
    running the layer before it, without them) is refused up front on every rank."""
    _assert(dist2.run(check_vlm_max_length, "qwen3_vl", "zigzag_ring_attn", CASES[:2]), True)
    for said in dist2.run(max_length_vlm_error, "qwen3_vl", "zigzag_ring_attn", 2):
        assert said.startswith("ValueError") and "deepstack" in said and "keep_every=1" in said
    # one decoder layer: the features land on the last layer's output, before the final
    # norm that the loss applies; refused up front, on every rank alike (without it a rank
    # with images would stop mid-step, inside the decoder, and one without would go on)
    for said in dist2.run(max_length_vlm_error, "qwen3_vl", "zigzag_ring_attn", 1,
                          num_hidden_layers=1):
        assert said.startswith("ValueError") and "the last (1) included" in said, said
