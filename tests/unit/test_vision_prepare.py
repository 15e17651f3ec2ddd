"""prepare_vision_inputs (integrations/vision.py) on one process: what each rank would encode
(pure: no collectives), and the fact its video split rests on."""

import pytest
import torch

from easy_context.integrations.vision import prepare_vision_inputs
from tests.dist.vlm_cases import make_step, tiny_vlm


def _encoded(family: str, method: str, world: int, modality: str) -> list[tuple[int, ...]]:
    model = tiny_vlm(family)
    step = make_step(family, video=True)
    out = []
    for rank in range(world):
        local = prepare_vision_inputs(
            model, method, step["input_ids"], step["target_ids"], rank, world,
            pixel_values=step["pixel_values"], image_grid_thw=step["image_grid_thw"],
            pixel_values_videos=step["pixel_values_videos"],
            video_grid_thw=step["video_grid_thw"])
        media = [m for m in local["vision"].media if m.modality == modality]
        out.append(media[0].encoded if media else ())
    return out


def test_a_video_across_two_shards_is_encoded_frame_by_frame():
    """The video (two frames, tokens 22-25) straddles the middle (24): with contiguous shards
    each rank encodes only its own frame, not the whole video."""
    assert _encoded("qwen2_5_vl", "ring_attn", 2, "video") == [(0,), (1,)]


def test_images_are_encoded_where_their_tokens_are():
    """Images at 4-7, 10-15, 33-38, 40-43 (the video at 22-25) across 48 tokens. Two
    contiguous shards of 24: rank 0 holds the first two, rank 1 the others. Zigzag (chunks of
    12; rank 0 holds 0-11 and 36-47, rank 1 12-35): rank 0 all four (the second and third in
    part), rank 1 the second (across 12) and the third (across 36)."""
    assert _encoded("qwen2_5_vl", "ring_attn", 2, "image") == [(0, 1), (2, 3)]
    assert _encoded("qwen2_5_vl", "zigzag_ring_attn", 2, "image") == [(0, 1, 2, 3), (1, 2)]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_towers_encode_each_temporal_step_alone(family):
    """A video of T grid steps gives the features of T one-step videos (deepstack included):
    what lets a rank encode only its frames (the towers attend within each step)."""
    model = tiny_vlm(family)
    pixels = torch.randn(72, 12, generator=torch.Generator().manual_seed(0))
    whole = model.get_video_features(pixels, torch.tensor([[3, 4, 6]]), return_dict=True)
    steps = model.get_video_features(pixels, torch.tensor([[1, 4, 6]] * 3), return_dict=True)
    assert torch.equal(torch.cat(list(whole.pooler_output)), torch.cat(list(steps.pooler_output)))
    for a, b in zip(getattr(whole, "deepstack_features", None) or [],
                    getattr(steps, "deepstack_features", None) or []):
        assert torch.equal(torch.cat(list(a)), torch.cat(list(b)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_a_rank_without_images_gives_the_tower_zero_gradients(family):
    """A shard with no image token still gives every tower parameter a gradient (zeros), so
    that DDP's and FSDP's reductions see the same parameters on every rank."""
    from easy_context.integrations.vision import tower_parameters, vision_embeddings

    model = tiny_vlm(family)
    step = make_step(family)
    ids = step["input_ids"].clone()
    ids[:, 22:] = 5                          # the first two images only: none in 24-47
    n = int((ids == 90).sum())
    pixels = (step["pixel_values"][:24] if family == "qwen2_5_vl"  # the first two images
              else step["pixel_values"][:2])
    grid = {"image_grid_thw": step["image_grid_thw"][:2]} if family == "qwen2_5_vl" else {}
    assert n == (10 if family == "qwen2_5_vl" else 8)
    local = prepare_vision_inputs(model, "ring_attn", ids, step["target_ids"], 1, 2,
                                  pixel_values=pixels, **grid)
    assert not any(m.encoded for m in local["vision"].media)
    embeds, _ = vision_embeddings(model, local["local_input_ids"], local["vision"])
    embeds.sum().backward()
    tower = tower_parameters(model)
    assert tower and all(p.grad is not None and not p.grad.any() for p in tower)
    assert not any(p is model.get_input_embeddings().weight for p in tower)


def test_any_resolution_tiling_refused():
    """LLaVA-NeXT's tower needs image_sizes (tiles packed per image by the tower itself):
    refused up front, naming what to change."""
    from easy_context.integrations.vision import describe

    with pytest.raises(ValueError, match="needs image_sizes .*images of one fixed size"):
        describe(tiny_vlm("llava_next"))


def test_pixel_values_of_more_than_one_image_per_row_refused():
    """(B, N, C, H, W) pixel values (several images per row, Idefics-style) are refused: the
    images are cut one per row."""
    model = tiny_vlm("llava")
    step = make_step("llava")
    with pytest.raises(ValueError, match=r"one image \(or tile\) per row"):
        prepare_vision_inputs(model, "ring_attn", step["input_ids"], step["target_ids"], 0, 2,
                              pixel_values=step["pixel_values"][None])


def test_packed_conversations_number_their_positions_from_zero():
    """Without multimodal RoPE, each packed conversation's positions start at 0, as when it
    runs alone (a decoder with learned absolute positions needs it; RoPE would not tell)."""
    model = tiny_vlm("llava")
    step = make_step("llava")
    documents = torch.zeros_like(step["input_ids"])
    documents[:, 20:] = 1
    local = prepare_vision_inputs(model, "ring_attn", step["input_ids"], step["target_ids"],
                                  0, 1, pixel_values=step["pixel_values"],
                                  document_ids=documents)
    want = torch.cat([torch.arange(20), torch.arange(28)])[None]
    assert torch.equal(local["local_position_ids"], want)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_tower_call_per_rank_images_and_video_together(rank):
    """Each rank calls the tower once per step, its images and video frames together (the
    count every rank must share when the tower is sharded), and the embeddings are those of
    encoding each modality apart."""
    from easy_context.integrations import vision as V

    model = tiny_vlm("qwen2_5_vl")
    step = make_step("qwen2_5_vl", video=True)
    local = prepare_vision_inputs(
        model, "ring_attn", step["input_ids"], step["target_ids"], rank, 2,
        pixel_values=step["pixel_values"], image_grid_thw=step["image_grid_thw"],
        pixel_values_videos=step["pixel_values_videos"], video_grid_thw=step["video_grid_thw"])
    assert all(m.encoded for m in local["vision"].media) and len(local["vision"].media) == 2
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    embeds, _ = V.vision_embeddings(model, local["local_input_ids"], local["vision"])
    hook.remove()
    assert len(calls) == 1
    # each modality on its own (what get_video_features / get_image_features give)
    expected = model.get_input_embeddings()(local["local_input_ids"])
    for media in local["vision"].media:
        get = (model.get_image_features if media.modality == "image"
               else model.get_video_features)
        features = torch.cat(list(get(media.pixel_values, media.grid_thw).pooler_output))
        expected = expected.masked_scatter(media.token_mask.unsqueeze(-1), features[media.rows])
    torch.testing.assert_close(embeds, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "internvl", "qwen3_vl"])
def test_a_rank_without_images_runs_a_sharded_tower_on_a_dummy(family, monkeypatch):
    """With the tower sharded (FSDP2, ZeRO-3: vision.tower_sharded), a rank with nothing to
    encode still calls the tower once (on vision.dummy_image), the embeddings are the text's
    exactly and every tower parameter gets a zero gradient through that call."""
    from easy_context.integrations import vision as V

    monkeypatch.setattr(V, "tower_sharded", lambda model: True)
    model = tiny_vlm(family)
    step = make_step(family)
    ids = step["input_ids"].clone()
    ids[ids == 90] = 5  # no image token anywhere
    local = prepare_vision_inputs(model, "ring_attn", ids, step["target_ids"], 1, 2)
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower
    calls = []
    hook = tower.register_forward_hook(lambda *_: calls.append(1))
    embeds, extra = V.vision_embeddings(model, local["local_input_ids"], local["vision"])
    hook.remove()
    assert len(calls) == 1 and not extra
    assert torch.equal(embeds, model.get_input_embeddings()(local["local_input_ids"]))
    embeds.sum().backward()
    params = V.tower_parameters(model)
    used = [p for p in params if p.grad is not None]
    # every parameter the tower's forward uses (LLaVA's CLIP post_layernorm is not)
    assert len(used) >= len(params) - 2 and all(torch.isfinite(p.grad).all() and
                                                not p.grad.any() for p in used)
