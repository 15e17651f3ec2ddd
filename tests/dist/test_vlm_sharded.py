"""The vision tower sharded by FSDP2 (fully_shard on its blocks, as accelerate wraps the
model) or DeepSpeed ZeRO-3, with a rank that holds no image token (and ranks that hold
different numbers of images): every rank runs the tower once per step (a dummy image where
it has nothing to encode), so the parameter gathers and gradient reductions match, and the
loss and every gradient, the tower's included, equal one process within TOL (fp32,
relative; vlm_sharded_cases.py)."""

import pytest

from .vlm_sharded_cases import sharded_vlm_step

TOL = 1e-5


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["sharded"] and r["vision"] > 0, (rank, r)
        assert r["loss"] <= TOL and r["grads"] <= TOL, (rank, r)
    assert results[-1]["encoded"] == 0, results  # the last rank runs the tower on a dummy


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_sharded_tower_2_ranks(dist2, family, engine):
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    results = dist2.run(sharded_vlm_step, family, engine)
    assert [r["encoded"] for r in results] == [2, 0], results
    _check(results)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
@pytest.mark.parametrize("family", ["llava_next", "mistral3"])
def test_sharded_any_resolution_tower_2_ranks(dist2, family, engine):
    """Towers that take image_sizes (LLaVA-NeXT's tiles, Mistral 3's cropped padded batch):
    one image in the first shard; the second rank runs the tower on dummy_image with
    dummy_image_sizes."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    results = dist2.run(sharded_vlm_step, family, engine)
    assert [r["encoded"] for r in results] == [1, 0], results
    _check(results)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_sharded_tower_4_ranks(dist4, engine):
    """Ranks 0 and 1 hold 2 and 1 images (one straddles their edge), ranks 2 and 3 none."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    results = dist4.run(sharded_vlm_step, "qwen2_5_vl", engine)
    assert [r["encoded"] for r in results] == [2, 1, 0, 0], results
    _check(results)


def test_whole_tower_one_fsdp2_unit(dist2):
    """fully_shard on the whole tower (one unit) instead of its blocks (Qwen2.5-VL; LLaVA's
    CLIP tower as one unit loses transformers' captured hidden_states in
    get_image_features, with or without images on the rank: not this package's path)."""
    results = dist2.run(sharded_vlm_step, "qwen2_5_vl", "fsdp2", "ring_attn", "tower")
    assert [r["encoded"] for r in results] == [2, 0], results
    _check(results)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_deepstack_tower_2_ranks(dist2, engine):
    """Qwen3-VL: the dummy call's deepstack features enter the loss times zero too, so its
    deepstack mergers' reductions match."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    results = dist2.run(sharded_vlm_step, "qwen3_vl", engine)
    assert [r["encoded"] for r in results] == [2, 0], results
    _check(results)


def test_images_and_video_one_call_fsdp2(dist2):
    """Images and a video's frames on both ranks, encoded in one tower call per rank."""
    results = dist2.run(sharded_vlm_step, "qwen2_5_vl", "fsdp2", "ring_attn", "blocks", True)
    for rank, r in enumerate(results):
        assert r["sharded"] and r["loss"] <= TOL and r["grads"] <= TOL, (rank, r)
