"""easy_context.generate after an image prompt: token for token (and every step's logits
within 1e-5, relative) what transformers' greedy ``generate(**inputs)`` gives in one process,
for tiny Qwen2.5-VL (multimodal RoPE: positions from get_rope_index, decode positions past
rope_deltas), Qwen3-VL (and its deepstack features) and LLaVA, every method at 1 and 2 ranks
and two at 4, with images straddling the shard boundaries; Qwen3.5 and InternVL with two
methods at 2; Gemma 3 and Gemma 4 (images both ways: every layer, sliding layers only); a
left-padded batch of two rows; and the up-front refusals."""

from __future__ import annotations

import pytest

import easy_context as ec

from .vlm_generate_cases import compare_image_prompt, different_images, images_encoded, refused

METHODS = sorted(ec.METHODS)


def _assert_equal(reports):
    bad = [f"rank {r} {method}:\n  want {want}\n  got  {got}"
           for r, rep in enumerate(reports) for method, (want, got) in rep.items() if want != got]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3"])
def test_image_prompt_every_method_one_rank(dist1, family):
    _assert_equal(dist1.run(compare_image_prompt, family, METHODS))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "gemma3"])
def test_image_prompt_every_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_image_prompt, family, METHODS, 1, 2))


def test_images_straddle_the_shard_boundaries(dist2):
    """The prompts above put an image across a boundary of every layout: more images are
    encoded over the two ranks than the prompt holds (5)."""
    for method in ("zigzag_ring_attn", "ring_attn"):
        assert sum(dist2.run(images_encoded, "qwen2_5_vl", method)) > 5, method


def test_image_prompt_four_ranks(dist4):
    _assert_equal(dist4.run(compare_image_prompt, "qwen2_5_vl",
                            ["zigzag_ring_attn", "usp_attn"], 1, 2))


def test_gemma3_image_prompt_four_ranks_and_padded_batch(dist4, dist2):
    """Gemma 3 (images both ways inside, a window of 3 shorter than an image): at 4 ranks,
    and a left-padded batch of two rows at 2."""
    _assert_equal(dist4.run(compare_image_prompt, "gemma3",
                            ["zigzag_ring_attn", "dist_flash_attn", "usp_attn"], 1, 2))
    _assert_equal(dist2.run(compare_image_prompt, "gemma3", ["ring_attn", "ulysses_attn"], 2))


def test_gemma3_token_type_ids_must_mark_the_images(dist1):
    bad = {"token_type_ids": "shifted"}
    for said in dist1.run(refused, "gemma3", **bad):
        assert said.startswith("ValueError") and "token_type_ids" in said, said


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_left_padded_batch_with_images_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_image_prompt, family, ["zigzag_ring_attn", "ulysses_attn"],
                            2))


@pytest.mark.parametrize("family,extra,says", [
    ("paligemma", {}, "prefix"),
    ("gemma3", {"token_type_ids": None}, "token_type_ids"),
    ("llava_next", {}, "pass image_sizes"),  # an any-resolution tower's images need them
    ("qwen2_5_vl", {"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
])
def test_image_prompts_refused_up_front(dist1, family, extra, says):
    for said in dist1.run(refused, family, **extra):
        assert said.startswith("ValueError") and says in said, said


def test_ranks_given_different_images_are_refused_before_prefill(dist2):
    for said in dist2.run(different_images):
        assert said.startswith("ValueError") and "different prompts" in said, said


@pytest.mark.parametrize("family", ["qwen3_5", "internvl", "glm4v"])
def test_image_prompt_other_families_two_ranks(dist2, family):
    """Qwen3.5 (gated DeltaNet layers beside attention, multimodal RoPE), InternVL (tiles,
    pixel shuffle, a Qwen2 decoder) and GLM-4V (grids, multimodal RoPE, partial rotary)."""
    _assert_equal(dist2.run(compare_image_prompt, family, ["zigzag_ring_attn", "ulysses_attn"],
                            1, 2))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_prompt_two_ranks(dist2, family):
    """A video of two frames across the middle of the prompt, beside images (Qwen2.5-VL with
    its seconds per grid step, Qwen3-VL with its frames between timestamp text)."""
    _assert_equal(dist2.run(compare_image_prompt, family, ["zigzag_ring_attn", "ulysses_attn"],
                            1, 2, True))


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "mistral3"])
def test_any_resolution_image_prompt_two_ranks(dist2, family):
    """Towers that take image_sizes (LLaVA-NeXT's and OneVision's tiles, Mistral 3's cropped
    padded batch): three images of different sizes, each across a shard boundary, at 2
    ranks: tokens and every step's logits as transformers' generate."""
    _assert_equal(dist2.run(compare_image_prompt, family, ["zigzag_ring_attn", "ring_attn",
                                                           "ulysses_attn"], 1, 2))


def test_gemma4_image_prompt(dist2):
    """Gemma 4 (images both ways on its sliding layers only, per-layer inputs, padded patch
    rows): every method at 2 ranks, and a left-padded batch of two rows."""
    _assert_equal(dist2.run(compare_image_prompt, "gemma4", METHODS, 1, 2))
    _assert_equal(dist2.run(compare_image_prompt, "gemma4", ["zigzag_ring_attn"], 2))


def test_gemma4_needs_mm_token_type_ids(dist1):
    for said in dist1.run(refused, "gemma4", mm_token_type_ids=None):
        assert said.startswith("ValueError") and "mm_token_type_ids" in said, said
