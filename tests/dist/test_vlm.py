"""Sequence-parallel training of vision-language models equals one process (fp32).

Tiny Qwen2.5-VL (multimodal RoPE), Qwen3-VL (multimodal RoPE and deepstack features),
Qwen3.5 (its text layers gated DeltaNet and attention), LLaVA (a CLIP tower and a projector
before a Llama decoder), InternVL (tiles, pixel shuffle, a Qwen2 decoder), Gemma 3 (images
both ways) and Gemma 4 (images both ways on its sliding layers only), with images
straddling shard boundaries, a video, a batch of two rows, and packed conversations: for
every method at 2 ranks (and at 4 ranks for some), the loss within 1e-5 relative of the
model's own forward on the whole step, and every parameter's gradient, vision tower
included, summed over ranks, within 1e-5 relative (integrations/vision.py says where images
are encoded).
"""

import pytest

import easy_context as ec

from .vlm_cases import check_anyres, check_vlm, own_forward_with_images, refusal

TOL = 1e-5
METHODS = sorted(ec.METHODS)


def _assert(reports, straddles: bool = True):
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}, vision grad {vg:.1e}"
           for r, rep in enumerate(reports) for case, (le, ge, vg, _) in rep.items()
           if not (le <= TOL and ge <= TOL and vg > 0)]
    assert not bad, "\n".join(bad)
    if straddles:  # some image was encoded by more than one rank (and none by every rank)
        encoded = [sum(n for *_, n in rep.values()) // len(rep) for rep in reports]
        assert 5 < sum(encoded), encoded


FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "internvl", "gemma3", "gemma4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_every_method_2_ranks(dist2, family):
    _assert(dist2.run(check_vlm, family, METHODS))


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_packed_conversations_2_ranks(dist2, family):
    methods = sorted(n for n, m in ec.METHODS.items() if m.documents)
    _assert(dist2.run(check_vlm, family, methods, 1, True, (True,)))


@pytest.mark.parametrize("family", ["llava", "internvl"])
def test_vlm_packed_by_positions_2_ranks(dist2, family):
    """Conversations packed by restarting position_ids alone, as padding-free collators give
    them (models without multimodal RoPE): attention stays inside each."""
    methods = sorted(n for n, m in ec.METHODS.items() if m.documents)
    _assert(dist2.run(check_vlm, family, methods, 1, True, (True,), False, True))


def test_vlm_batch_of_two_rows_2_ranks(dist2):
    _assert(dist2.run(check_vlm, "qwen2_5_vl", ["zigzag_ring_attn", "ulysses_attn"], 2, False,
                      (True,)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "gemma3"])
def test_vlm_every_method_4_ranks(dist4, family):
    _assert(dist4.run(check_vlm, family, METHODS, 1, False, (True,)))


def test_gemma3_packed_at_4_ranks(dist4):
    """Gemma 3 (images bidirectional inside, a sliding window of 3 shorter than an image,
    which cuts an image token's earlier keys but never its later ones) with two packed
    conversations at 4 ranks: the images' spans stay inside their conversation."""
    methods = sorted(n for n, m in ec.METHODS.items() if m.documents)
    _assert(dist4.run(check_vlm, "gemma3", methods, 1, True, (True,)))


def test_gemma3_without_spans_differs(dist2):
    """The Gemma 3 cases are ones where the spans matter: with them dropped on the way to
    the kernels (vision_language_loss hands none), the loss is off."""
    reports = dist2.run(check_vlm, "gemma3", ["zigzag_ring_attn"], 1, False, (True,), False,
                        False, True)
    assert all(not (le <= TOL) for rep in reports for le, *_ in rep.values()), reports


def test_prefix_bidirectional_images_refused(dist2):
    """PaliGemma's token_type_ids mark a bidirectional prefix (image and prompt), not image
    spans: refused with images."""
    for said in dist2.run(refusal, "paligemma"):
        assert said.startswith("ValueError") and "prefix" in said, said


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_video_2_ranks(dist2, family):
    """A video of two frames across the middle of the sequence (Qwen2.5-VL with its seconds
    per grid step), beside images."""
    _assert(dist2.run(check_vlm, family, ["zigzag_ring_attn", "ulysses_attn", "ring_attn"], 1,
                      False, (True,), True))


def test_own_forward_with_images_refused(dist2):
    """The model's own forward, handed a shard and every image, would scatter the images
    into the wrong tokens: a refusal that names the way that works."""
    for family in ("qwen2_5_vl", "llava"):
        for said in dist2.run(own_forward_with_images, family, "zigzag_ring_attn"):
            assert said.startswith("ValueError") and "prepare_vision_inputs" in said, said


def _assert_anyres(reports):
    """Every case exact, the tower's and image_newline's gradients compared (nonzero), and
    every image encoded by some rank, one (at least) by two: each straddles a boundary."""
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}, vision grad {vg:.1e}, "
           f"newline grad {ng}"
           for r, rep in enumerate(reports) for case, (le, ge, vg, _, ng) in rep.items()
           if not (le <= TOL and ge <= TOL and vg > 0 and (ng is None or ng > 0))]
    assert not bad, "\n".join(bad)
    encoded = [sum(n for *_, n, _ in rep.values()) // len(rep) for rep in reports]
    assert 3 < sum(encoded), encoded


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_anyres_every_method_2_ranks(dist2, family):
    """Any-resolution towers (image_sizes): LLaVA-NeXT (CLIP, unpadding, newline tokens) and
    LLaVA-OneVision (SigLIP, its features downscaled past anyres_max_1), three images of
    different sizes, each across a shard boundary."""
    _assert_anyres(dist2.run(check_anyres, family, METHODS, False, (True, False)))


def test_cropping_tower_every_method_2_ranks(dist2):
    """Mistral 3 (Pixtral): images of any size padded into one (N, C, H, W) batch, each
    cropped to its image_sizes by the tower, 2x2 patches merged: three images of 12, 6 and
    16 tokens, each across a shard boundary."""
    _assert_anyres(dist2.run(check_anyres, "mistral3", METHODS))


def test_anyres_tiles_concatenated_2_ranks(dist2):
    """Pixel values as every image's tiles in one (tiles, C, H, W), as get_image_features
    also takes them."""
    _assert_anyres(dist2.run(check_anyres, "llava_next", ["zigzag_ring_attn", "ulysses_attn"],
                             True))


def test_anyres_every_method_4_ranks(dist4):
    _assert_anyres(dist4.run(check_anyres, "llava_next", METHODS))


def test_glm4v_every_method_2_ranks(dist2):
    """GLM-4V: Qwen2-VL-style grids and multimodal RoPE (its own get_rope_index), a partial
    rotary decoder: the grid path as it is; every method, and packed conversations."""
    _assert(dist2.run(check_vlm, "glm4v", METHODS, 1, False, (True,)))
    methods = sorted(n for n, m in ec.METHODS.items() if m.documents)
    _assert(dist2.run(check_vlm, "glm4v", methods, 1, True, (True,)))  # packed conversations


def test_gemma4_at_4_ranks(dist4):
    """Gemma 4 (images bidirectional on its sliding layers only, per-layer inputs, padded
    patch rows per image) at 4 ranks, plain and packed."""
    _assert(dist4.run(check_vlm, "gemma4", ["zigzag_ring_attn", "usp_attn"], 1, False, (True,)))
    _assert(dist4.run(check_vlm, "gemma4", ["ring_attn", "ulysses_attn"], 1, True, (True,)))


def test_gemma4_without_spans_differs(dist2):
    """The Gemma 4 cases are ones where the spans matter (its sliding layer's images attend
    both ways): with them dropped, the loss is off."""
    reports = dist2.run(check_vlm, "gemma4", ["zigzag_ring_attn"], 1, False, (True,), False,
                        False, True)
    assert all(not (le <= TOL) for rep in reports for le, *_ in rep.values()), reports
