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


def test_tower_needing_more_than_image_sizes_refused():
    """A tower whose get_image_features needs more than image_sizes (a stand-in: Mistral 3's
    with another required argument) is refused up front, naming what to change.
    LLaVA-NeXT and OneVision (tiles packed by pack_image_features) and Mistral 3 (a padded
    batch its tower crops) are accepted."""
    from easy_context.integrations.vision import describe

    model = tiny_vlm("mistral3")
    model.get_image_features = lambda pixel_values, image_sizes, crop_boxes: None
    with pytest.raises(ValueError, match="needs image_sizes, crop_boxes .*images of one fixed"):
        describe(model)
    for family in ("llava_next", "llava_onevision", "mistral3"):
        assert describe(tiny_vlm(family)).image_sizes


def test_any_resolution_tokens_are_the_models():
    """anyres_tokens (the model's pack_image_features on stand-ins of width 1) gives each
    image as many tokens as the model's own get_image_features gives it, for sizes that
    unpad rows, columns, and (OneVision, anyres_max_1) downscale."""
    from easy_context.integrations.vision import anyres_tiles, anyres_tokens

    sizes = torch.tensor([[4, 4], [3, 8], [8, 5], [8, 8], [6, 3]])
    for family in ("llava_next", "llava_onevision"):
        model = tiny_vlm(family)
        tiles = anyres_tiles(model, sizes)
        pixels = torch.randn(len(sizes), max(tiles), 3, 4, 4)
        with torch.no_grad():
            own = [len(model.get_image_features(pixel_values=pixels[i:i + 1],
                                                image_sizes=sizes[i:i + 1],
                                                return_dict=True).pooler_output[0])
                   for i in range(len(sizes))]
        assert anyres_tokens(model, sizes) == own, family
        assert len(set(own)) > 2, own  # the sizes give different counts


def test_cropped_tokens_are_the_models():
    """cropped_tokens gives each image of a cropping tower (Mistral 3) as many tokens as the
    model's own get_image_features splits off for it."""
    from easy_context.integrations.vision import cropped_tokens

    model = tiny_vlm("mistral3")
    sizes = torch.tensor([[16, 16], [12, 16], [8, 12], [4, 4]])
    with torch.no_grad():
        own = model.get_image_features(pixel_values=torch.randn(4, 3, 16, 16),
                                       image_sizes=sizes, return_dict=True).pooler_output
    assert cropped_tokens(model, sizes) == [len(o) for o in own] == [16, 12, 6, 1]


def test_any_resolution_needs_matching_image_sizes():
    """An any-resolution tower's images without image_sizes, or with sizes whose tiles the
    pixel values do not hold, and image_sizes given to a fixed-size tower: refused."""
    model = tiny_vlm("llava_next")
    step = make_step("llava")
    ids, targets = step["input_ids"], step["target_ids"]
    with pytest.raises(ValueError, match="pass image_sizes"):
        prepare_vision_inputs(model, "ring_attn", ids, targets, 0, 2,
                              pixel_values=torch.randn(5, 3, 3, 4, 4))
    with pytest.raises(ValueError, match="do not hold the tiles"):
        prepare_vision_inputs(model, "ring_attn", ids, targets, 0, 2,
                              pixel_values=torch.randn(5, 2, 3, 4, 4),
                              image_sizes=torch.tensor([[8, 8]] * 5))
    with pytest.raises(ValueError, match="are not the tiles"):
        prepare_vision_inputs(model, "ring_attn", ids, targets, 0, 2,
                              pixel_values=step["pixel_values"],
                              image_sizes=torch.tensor([[4, 4]] * 5))
    with pytest.raises(ValueError, match="not one image per row, padded"):  # Mistral 3
        prepare_vision_inputs(tiny_vlm("mistral3"), "ring_attn", ids, targets, 0, 2,
                              pixel_values=torch.randn(5, 3, 8, 8),
                              image_sizes=torch.tensor([[16, 8]] * 5))
    with pytest.raises(ValueError, match="takes no image_sizes"):
        prepare_vision_inputs(tiny_vlm("llava"), "ring_attn", ids, targets, 0, 2,
                              pixel_values=step["pixel_values"],
                              image_sizes=torch.tensor([[4, 4]] * 5))


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


def test_image_sizes_features_checked_against_the_counts():
    """A tower that gives a rank's images another number of feature rows than counted for
    them (a stand-in: Mistral 3's get_image_features with one extra row) is refused when
    encoded, not scattered misaligned."""
    from easy_context.integrations.vision import vision_embeddings

    model = tiny_vlm("mistral3")
    sizes = torch.tensor([[8, 8], [8, 12]])           # 4 and 6 tokens
    ids = torch.randint(3, 89, (1, 16))
    ids[0, 2:6] = 90
    ids[0, 8:14] = 90
    local = prepare_vision_inputs(model, "ring_attn", ids, ids, 0, 1,
                                  pixel_values=torch.randn(2, 3, 16, 16), image_sizes=sizes)
    embeds, _ = vision_embeddings(model, local["local_input_ids"], local["vision"])
    assert embeds.shape == (1, 16, 32)
    own = model.get_image_features

    def one_more(**kw):
        out = own(**kw)
        out.pooler_output = tuple(out.pooler_output) + (out.pooler_output[0][:1],)
        return out

    model.get_image_features = one_more
    with pytest.raises(ValueError, match="gave 11 feature rows .* not the 10 tokens"):
        vision_embeddings(model, local["local_input_ids"], local["vision"])


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


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "mistral3"])
def test_a_sharded_any_resolution_tower_runs_on_a_dummy(family, monkeypatch):
    """An any-resolution tower (image_sizes) on a rank with nothing to encode, the tower
    sharded: one tower call on dummy_image with dummy_image_sizes (all the tiles of one tile's
    size; Mistral 3: 2 x 2 merged patches), the embeddings the text's exactly, zero gradients."""
    from easy_context.integrations import vision as V

    monkeypatch.setattr(V, "tower_sharded", lambda model: True)
    model = tiny_vlm(family)
    family_ = V.describe(model)
    assert family_.image_sizes
    pixels, _ = V.dummy_image(model, family_, "cpu")
    sizes = V.dummy_image_sizes(model, family_, "cpu")
    # what the model's own code takes for that image: its tiles, or the padded image
    assert pixels.size(0) == (V.anyres_tiles(model, sizes)[0] if family != "mistral3" else 1)
    ids = torch.randint(3, 89, (1, 16))
    local = prepare_vision_inputs(model, "ring_attn", ids, ids, 1, 2)
    calls = []
    hook = V._vision_tower(model).register_forward_hook(lambda *_: calls.append(1))
    embeds, _ = V.vision_embeddings(model, local["local_input_ids"], local["vision"])
    hook.remove()
    assert len(calls) == 1
    assert torch.equal(embeds, model.get_input_embeddings()(local["local_input_ids"]))
    embeds.sum().backward()
    used = [p for p in V.tower_parameters(model) if p.grad is not None]
    assert used and all(torch.isfinite(p.grad).all() and not p.grad.any() for p in used)


def test_a_logit_transform_is_refused_with_images(monkeypatch):
    """The vision loss applies no soft-cap or scale: a model whose head reports one (a
    vision-language model with a config of its own, not a composite one) is refused, not
    trained on untransformed logits."""
    import easy_context.integrations.hf as hf
    from easy_context.memory.loss import LogitTransform

    model = tiny_vlm("qwen2_5_vl")
    step = make_step("qwen2_5_vl")
    local = prepare_vision_inputs(model, "zigzag_ring_attn", step["input_ids"],
                                  step["target_ids"], 0, 1, pixel_values=step["pixel_values"],
                                  image_grid_thw=step["image_grid_thw"])
    head = model.get_output_embeddings()
    monkeypatch.setattr(hf, "output_head", lambda m: (head, LogitTransform(2.0, None)))
    with pytest.raises(ValueError, match="transforms its logits"):
        hf.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                          local["local_target_ids"], vision=local["vision"])
