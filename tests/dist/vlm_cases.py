"""Sequence-parallel training steps of tiny vision-language models against one process.

Each rank builds the same model and step (same seeds); the reference is the model's own
forward on the whole step (pixel values, grids) in this process; the sequence-parallel copy
sees this rank's shard, with the images whose tokens overlap it (integrations/vision.py).
Images sit across the shard boundaries of every layout at 2 and 4 ranks (48 tokens: the
boundaries fall at multiples of 6), so some image is encoded by two ranks.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

import easy_context as ec
from easy_context.integrations.vision import prepare_vision_inputs

LENGTH = 48
TEXT = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=512, attention_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4,
                   out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                   spatial_merge_size=2, in_channels=3)
IMAGE, VIDEO = 90, 91
SPECIAL = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=92,
               vision_end_token_id=93)
# where each image's placeholder tokens start: across 12 (2 ranks zigzag, 4 contiguous),
# 24 (every 2-rank layout) and 36, and across 6/18/30/42 (zigzag at 4 ranks)
STARTS = (4, 10, 22, 33, 40)
# Qwen grids (T, H, W) in patches; a 2x2 merge makes H*W/4 tokens: 4, 6, 4, 6, 4
GRIDS = ((1, 4, 4), (1, 4, 6), (1, 4, 4), (1, 6, 4), (1, 4, 4))

# any-resolution towers (4x4-pixel tiles): the grids an image may be tiled into
PINPOINTS = [[4, 8], [8, 4], [8, 8]]
ANYRES_LENGTH = 64
# (height, width) and where its tokens start, per image: each across a shard boundary of
# 2 and 4 ranks (16: zigzag at 2, contiguous at 4; 32; 48 and 56)
ANYRES_IMAGES = {"llava_next": (((4, 4), 12), ((3, 8), 26), ((8, 5), 44)),
                 "llava_onevision": (((4, 4), 12), ((3, 8), 28), ((8, 8), 44)),
                 "mistral3": (((12, 16), 12), ((8, 12), 29), ((16, 16), 44))}


def tiny_vlm(family: str, seed: int = 0, **text):
    """A tiny vision-language model (vision depth 1, hidden 32, 2x2 patches), fp32; ``text``:
    entries of TEXT (the decoder's config) to override."""
    import transformers as tf

    TEXT = {**globals()["TEXT"], **text}

    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config={**TEXT, "rope_parameters": MROPE},
            vision_config={**QWEN_VISION, "window_size": 4, "fullatt_block_indexes": [0]},
            **SPECIAL)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":
        config = tf.Qwen3VLConfig(
            text_config={**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}},
            vision_config={**QWEN_VISION, "deepstack_visual_indexes": [0],
                           "num_position_embeddings": 64},
            **SPECIAL)
        cls = tf.Qwen3VLForConditionalGeneration
    elif family == "llava":
        config = tf.LlavaConfig(
            text_config={**TEXT, "model_type": "llama"},
            vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=4, patch_size=2,
                               projection_dim=32),
            image_token_id=IMAGE, vision_feature_layer=-1,
            vision_feature_select_strategy="default")
        cls = tf.LlavaForConditionalGeneration
    elif family == "glm4v":  # Qwen2-VL-style grids and multimodal RoPE, partial rotary
        config = tf.Glm4vConfig(
            text_config={**TEXT, "head_dim": 16, "rope_parameters": {
                **MROPE, "partial_rotary_factor": 0.5}},
            vision_config={**QWEN_VISION, "image_size": 8}, **SPECIAL)
        cls = tf.Glm4vForConditionalGeneration
    elif family == "qwen3_5":  # gated DeltaNet and attention layers, multimodal RoPE
        config = tf.Qwen3_5Config(
            text_config={**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True},
                         "layer_types": ["linear_attention", "full_attention"],
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                         "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                         "linear_conv_kernel_dim": 4},
            vision_config={**QWEN_VISION, "num_position_embeddings": 64},
            **SPECIAL)
        cls = tf.Qwen3_5ForConditionalGeneration
    elif family == "internvl":  # 8x8 images, 2x2 patches, pixel shuffle 0.5: 4 tokens each
        config = tf.InternVLConfig(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=[8, 8], patch_size=[2, 2]),
            text_config={**TEXT, "model_type": "qwen2"}, image_token_id=IMAGE,
            downsample_ratio=0.5, vision_feature_layer=-1)
        cls = tf.InternVLForConditionalGeneration
    elif family == "paligemma":  # token_type_ids mark a bidirectional prefix: refused
        config = tf.PaliGemmaConfig(
            text_config={**TEXT, "model_type": "gemma"},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=4, patch_size=2),
            image_token_index=IMAGE, projection_dim=32)
        cls = tf.PaliGemmaForConditionalGeneration
    elif family == "llava_next":  # any-resolution tiles of 4x4 pixels (image_sizes), CLIP
        config = tf.LlavaNextConfig(
            text_config={**TEXT, "model_type": "llama"},
            vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=4, patch_size=2,
                               projection_dim=32),
            image_token_id=IMAGE, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1)
        cls = tf.LlavaNextForConditionalGeneration
    elif family == "llava_onevision":  # the same tiles, SigLIP, "full" features, downscaled
        config = tf.LlavaOnevisionConfig(  # past one tile's worth (anyres_max_1)
            text_config={**TEXT, "model_type": "qwen2"},
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=4, patch_size=2),
            image_token_id=IMAGE, video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS,
            vision_feature_layer=-1, vision_aspect_ratio="anyres_max_1")
        cls = tf.LlavaOnevisionForConditionalGeneration
    elif family == "mistral3":  # Pixtral: images of any size padded into one batch, cropped
        config = tf.Mistral3Config(
            text_config={**TEXT, "model_type": "mistral"},
            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=4, image_size=16,
                               patch_size=2, head_dim=8),
            image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1)
        cls = tf.Mistral3ForConditionalGeneration
    elif family == "gemma3":  # images bidirectional inside; a sliding window of 3 < an image
        config = tf.Gemma3Config(
            text_config={**TEXT, "final_logit_softcapping": None, "sliding_window": 3,
                         "layer_types": ["sliding_attention", "full_attention"]},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, image_size=28, patch_size=14),
            image_token_id=IMAGE, mm_tokens_per_image=4)
        cls = tf.Gemma3ForConditionalGeneration
    elif family == "gemma4":  # images bidirectional on its sliding layers only; per-layer inputs
        config = tf.Gemma4Config(
            text_config={**TEXT, "global_head_dim": 8, "hidden_size_per_layer_input": 8,
                         "vocab_size_per_layer_input": 97, "sliding_window": 3,
                         "final_logit_softcapping": None, "use_bidirectional_attention": "vision",
                         # the last layer reuses the K/V of the full one before it (as the
                         # small Gemma 4 models share their last layers' K/V)
                         "num_kv_shared_layers": 1,
                         # a full layer before the last (which Gemma 4 makes full): its
                         # images' rows reach the loss (the last layer's reach only images'
                         # targets, all ignored)
                         "num_hidden_layers": 3,
                         "layer_types": ["sliding_attention", "full_attention",
                                         "full_attention"]},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                               global_head_dim=8, patch_size=2, pooling_kernel_size=2),
            audio_config=None, image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=92)
        cls = tf.Gemma4ForConditionalGeneration
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():  # Gemma 3's projector starts at zero: no image would reach the
        for name, p in model.named_parameters():  # decoder, nor any gradient the tower
            if "multi_modal_projector" in name and not p.abs().max() > 0:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # Gemma 4's vision attention (q, k RMS-normed, scaling 1): in
        # fp32 its q/k projections' gradients are as far from float64 as the tolerance
        # (transformers' own forward on the whole step: 6e-6 and 1.1e-5 of their largest;
        # encoding images in other batches moves them as much, 6.6e-6). Norms of 0.5 flatten
        # that attention: those gradients drop under 1e-3 of the model's largest, the floor
        # grad_error measures such near-zero gradients against (there, 5e-6 from float64)
        for name, p in model.named_parameters():
            if "vision_tower" in name and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(0.5)
    with torch.no_grad():  # Qwen3.5's gated DeltaNet: mild decays, as hf_recurrent_cases.py
        for m in model.modules():  # says why (the default's A_log/dt_bias grads cancel to ~0)
            if isinstance(getattr(m, "A_log", None), torch.Tensor) and \
                    isinstance(getattr(m, "dt_bias", None), torch.Tensor):
                m.A_log.copy_(torch.linspace(-2, 0.5, m.A_log.numel()).view_as(m.A_log))
                m.dt_bias.zero_()
    return model


def make_step(family: str, batch: int = 1, seed: int = 1, video: bool = False) -> dict:
    """A whole step: ids (B, LENGTH) with images at STARTS (row-major over the batch: the
    batch's rows share them out), targets with -100 on the images and a few others, pixel
    values for every image. ``video`` (Qwen): the third item (across 24) is a video of two
    frames of 2x4 patches (4 tokens) instead of an image."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 89, (batch, LENGTH), generator=gen)
    targets = torch.randint(3, 89, (batch, LENGTH), generator=gen)
    targets[:, :3] = -100
    step: dict = {}
    kinds = [IMAGE] * len(STARTS)
    if family.startswith(("qwen", "glm")):
        grids = [torch.tensor(g) for g in GRIDS]
        tokens = [int(g.prod()) // 4 for g in grids]
        if video:
            kinds[2] = VIDEO
            step["video_grid_thw"] = torch.tensor([[2, 2, 4]])
            step["pixel_values_videos"] = torch.randn(16, 3 * 2 * 2, generator=gen)
            if family == "qwen2_5_vl":
                step["second_per_grid_ts"] = torch.tensor([0.5])
            grids = grids[:2] + grids[3:]
        step["image_grid_thw"] = torch.stack(grids)
        step["pixel_values"] = torch.randn(int(step["image_grid_thw"].prod(-1).sum()), 3 * 2 * 2,
                                           generator=gen)
    elif family == "gemma4":  # padded rows of 16 patches of 2x2 pixels, with (x, y) positions
        # 4x4 patches pool (2x2) to 4 tokens; the fourth image is 2x4 patches: 2 tokens
        sizes = [(4, 4), (4, 4), (4, 4), (2, 4), (4, 4)]
        tokens = [h * w // 4 for h, w in sizes]
        step["pixel_values"] = torch.zeros(len(sizes), 16, 3 * 2 * 2)
        step["image_position_ids"] = torch.full((len(sizes), 16, 2), -1)
        for i, (h, w) in enumerate(sizes):
            xy = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), -1)
            step["image_position_ids"][i, :h * w] = xy.reshape(-1, 2)
            step["pixel_values"][i, :h * w] = torch.randn(h * w, 12, generator=gen)
    else:  # fixed-size images of 2x2 patches: 4 tokens each
        tokens = [4] * len(STARTS)
        side = {"internvl": 8, "gemma3": 28}.get(family, 4)
        step["pixel_values"] = torch.randn(len(STARTS), 3, side, side, generator=gen)
    rows = [b for b in range(batch) for _ in range(len(STARTS) // batch)]
    rows += [batch - 1] * (len(STARTS) - len(rows))
    for b, start, n, kind in zip(rows, STARTS, tokens, kinds):
        ids[b, start:start + n] = kind
        targets[b, start - 1:start + n] = -100
        if kind == VIDEO and family == "qwen3_vl":
            # Qwen3-VL's frames are separate runs, between timestamp text: 22-23 | 24 | 25-26
            ids[b, start + 2] = 7
            ids[b, start + 3:start + 5] = VIDEO
            targets[b, start + 4] = -100
    step["input_ids"], step["target_ids"] = ids, targets
    return step


def _mm_kwargs(model, step: dict) -> dict:
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "second_per_grid_ts", "image_position_ids", "image_sizes")
    kw = {k: step[k] for k in keys if k in step}
    if "image_grid_thw" in step or "image_position_ids" in step:
        ids = step["input_ids"]
        kw["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    if "token_type_ids" in inspect.signature(model.forward).parameters:  # Gemma 3
        kw["token_type_ids"] = (step["input_ids"] == IMAGE).long()
    return kw


def reference_loss(model, step: dict, document_ids=None):
    """The model's own forward: on the whole step, or per packed conversation (each alone,
    with its own images), token-weighted."""
    ids, targets = step["input_ids"], step["target_ids"]
    if document_ids is None:
        logits = model(input_ids=ids, **_mm_kwargs(model, step)).logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    total, count, image = 0.0, 0, 0
    docs = document_ids[0]
    for d in docs.unique().tolist():
        where = torch.nonzero(docs == d).flatten()
        a, b = int(where[0]), int(where[-1]) + 1
        part = {"input_ids": ids[:, a:b], "target_ids": targets[:, a:b]}
        n = int(((part["input_ids"][0] == IMAGE).int().diff(prepend=torch.zeros(1, dtype=torch.int))
                 == 1).sum())
        if "image_grid_thw" in step:
            grid = step["image_grid_thw"]
            rows = grid.prod(-1).cumsum(0).tolist()
            first = [0] + rows
            part["image_grid_thw"] = grid[image:image + n]
            part["pixel_values"] = step["pixel_values"][first[image]:first[image + n]]
        else:
            part["pixel_values"] = step["pixel_values"][image:image + n]
            if "image_position_ids" in step:
                part["image_position_ids"] = step["image_position_ids"][image:image + n]
        image += n
        kw = _mm_kwargs(model, part) if n else {}
        logits = model(input_ids=part["input_ids"], **kw).logits.float()
        total = total + F.cross_entropy(logits[0], part["target_ids"][0], ignore_index=-100,
                                        reduction="sum")
        count += int((part["target_ids"] != -100).sum())
    return total / count


def grad_error(sp_model, ref_model) -> float:
    """The largest relative gradient error over every parameter (vision tower included),
    gradients summed over ranks, relative to the parameter's max |grad|; NaN-safe
    (torch.maximum). A gradient that is zero in exact arithmetic (the vision keys' bias:
    softmax ignores a shift shared by all keys; here ~5e-11 of rounding) is measured against
    1e-3 of the model's largest gradient instead of its own rounding noise."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p)
             for p in ref_model.parameters()]
    floor = 1e-3 * torch.stack([g.abs().max() for g in grads]).max()
    worst = torch.zeros(())
    for p_sp, ref in zip(sp_model.parameters(), grads):
        g = p_sp.grad.clone() if p_sp.grad is not None else torch.zeros_like(p_sp)
        if dist.is_initialized():
            dist.all_reduce(g)
        scale = torch.maximum(ref.abs().max(), floor).clamp(min=1e-6)
        worst = torch.maximum(worst, (g - ref).abs().max() / scale)
    return worst.item()


def vision_grad_norm(model) -> float:
    """|grad| of the vision tower on this rank, summed over ranks: nonzero shows the tower's
    gradient was compared, not two zeros."""
    total = torch.zeros(())
    for name, p in model.named_parameters():
        if ("visual" in name or "vision_tower" in name) and p.grad is not None:
            total = total + p.grad.abs().sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.item()


def check_vlm(family: str, methods: list[str], batch: int = 1, packed: bool = False,
              chunked_options=(True, False), video: bool = False,
              packed_by_positions: bool = False, drop_spans: bool = False) -> dict:
    """{f"{method} chunked={c}": (loss rel error, grad rel error, vision grad, images encoded
    here)} for each method. ``drop_spans``: the image spans (Gemma 3) are left out of the
    step (what a test shows they change)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_vlm(family)
    step = make_step(family, batch, video=video)
    documents = None
    positions = None
    if packed:  # two conversations, the second starting inside the second image's run
        documents = torch.zeros_like(step["input_ids"])
        documents[:, 20:] = 1
        step["target_ids"][:, 19] = -100
        if packed_by_positions:  # said by restarting positions alone (padding-free collators)
            index = torch.arange(LENGTH).expand_as(documents)
            positions = torch.where(documents == 1, index - 20, index)
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, step, documents)
    ref_loss.backward()
    report = {}
    for method in methods:
        ring_degree = 2 if method == "usp_attn" and world == 4 else (1 if method == "usp_attn"
                                                                    else None)
        for chunked in chunked_options:
            model = copy.deepcopy(base)
            ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
            local = prepare_vision_inputs(
                model, method, step["input_ids"], step["target_ids"], rank, world,
                pixel_values=step["pixel_values"], image_grid_thw=step.get("image_grid_thw"),
                pixel_values_videos=step.get("pixel_values_videos"),
                video_grid_thw=step.get("video_grid_thw"),
                second_per_grid_ts=step.get("second_per_grid_ts"),
                document_ids=None if packed_by_positions else documents,
                position_ids=positions, ring_degree=ring_degree,
                token_type_ids=_mm_kwargs(model, step).get("token_type_ids"),
                mm_token_type_ids=_mm_kwargs(model, step).get("mm_token_type_ids"),
                image_position_ids=step.get("image_position_ids"))
            if drop_spans:
                local["vision"].image_spans = ()
            loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                     local["local_target_ids"], chunked=chunked,
                                     document_ids=local["local_document_ids"],
                                     vision=local["vision"])
            loss.backward()
            encoded = sum(len(m.encoded) for m in local["vision"].media)
            report[f"{method} chunked={chunked}"] = (
                abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                grad_error(model, ref), vision_grad_norm(model), encoded)
    return report


def refusal(family: str, method: str = "zigzag_ring_attn") -> str:
    """What preparing a step with images says for ``family`` (after apply_sequence_parallel)."""
    model = tiny_vlm(family)
    ec.apply_sequence_parallel(model, method)
    step = make_step("llava")
    try:
        prepare_vision_inputs(model, method, step["input_ids"], step["target_ids"],
                              dist.get_rank(), dist.get_world_size(),
                              pixel_values=step["pixel_values"])
    except ValueError as e:
        return f"ValueError: {e}"
    return "prepared"


def own_forward_with_images(family: str, method: str) -> str:
    """What the model's own forward says when handed this rank's shard and every image
    after apply_sequence_parallel."""
    model = tiny_vlm(family)
    ec.apply_sequence_parallel(model, method)
    step = make_step(family)
    local = ec.shard_sequence(step["input_ids"], method, dist.get_rank(), dist.get_world_size())
    try:
        model(input_ids=local, **_mm_kwargs(model, step))
    except Exception as e:  # noqa: BLE001  (the test tells a refusal from a raw error)
        return f"{type(e).__name__}: {e}"
    return "ran"


def make_anyres_step(model, family: str, tiles_concatenated: bool = False, seed: int = 1
                     ) -> dict:
    """An any-resolution step (ANYRES_LENGTH tokens, ANYRES_IMAGES): each image's token count
    is what the model's own get_image_features gives that image alone; pixel values (N,
    tiles, C, 4, 4) padded per image, or (``tiles_concatenated``) every image's tiles in one
    (tiles, C, 4, 4); Mistral 3: (N, C, 16, 16), each image padded to the largest."""
    from easy_context.integrations.vision import anyres_tiles

    gen = torch.Generator().manual_seed(seed)
    images = ANYRES_IMAGES[family]
    sizes = torch.tensor([size for size, _ in images])
    if family == "mistral3":  # one image per row, padded to the largest (16x16)
        pixels = torch.randn(len(images), 3, 16, 16, generator=gen)
    else:
        tiles = anyres_tiles(model, sizes)
        pixels = torch.randn(len(images), max(tiles), 3, 4, 4, generator=gen)
    ids = torch.randint(3, 89, (1, ANYRES_LENGTH), generator=gen)
    targets = torch.randint(3, 89, (1, ANYRES_LENGTH), generator=gen)
    targets[:, :3] = -100
    with torch.no_grad():
        for i, (_, start) in enumerate(images):
            n = len(model.get_image_features(pixel_values=pixels[i:i + 1],
                                             image_sizes=sizes[i:i + 1],
                                             return_dict=True).pooler_output[0])
            ids[0, start:start + n] = IMAGE
            targets[0, start - 1:start + n] = -100
    if tiles_concatenated:
        pixels = torch.cat([pixels[i, :n] for i, n in enumerate(tiles)])
    return {"input_ids": ids, "target_ids": targets, "pixel_values": pixels,
            "image_sizes": sizes}


def check_anyres(family: str, methods: list[str], tiles_concatenated: bool = False,
                 chunked_options=(True,)) -> dict:
    """As check_vlm, for an any-resolution tower (LLaVA-NeXT, OneVision): {case: (loss rel
    error, grad rel error, vision grad, images encoded here, |image_newline grad| (None
    without one: Mistral 3))}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_vlm(family)
    step = make_anyres_step(base, family, tiles_concatenated)
    ref = copy.deepcopy(base)
    logits = ref(input_ids=step["input_ids"], pixel_values=step["pixel_values"],
                 image_sizes=step["image_sizes"]).logits.float()
    ref_loss = F.cross_entropy(logits[0], step["target_ids"][0], ignore_index=-100)
    ref_loss.backward()
    report = {}
    for method in methods:
        ring_degree = 2 if method == "usp_attn" and world == 4 else (1 if method == "usp_attn"
                                                                    else None)
        for chunked in chunked_options:
            model = copy.deepcopy(base)
            ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
            local = prepare_vision_inputs(
                model, method, step["input_ids"], step["target_ids"], rank, world,
                pixel_values=step["pixel_values"], image_sizes=step["image_sizes"],
                ring_degree=ring_degree)
            loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                     local["local_target_ids"], chunked=chunked,
                                     vision=local["vision"])
            loss.backward()
            newline = getattr(model.model, "image_newline", None)  # None: Mistral 3's
            if newline is not None:
                newline = newline.grad.clone()
                dist.all_reduce(newline)
                newline = newline.abs().sum().item()
            encoded = sum(len(m.encoded) for m in local["vision"].media)
            report[f"{method} chunked={chunked}"] = (
                abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                grad_error(model, ref), vision_grad_norm(model), encoded,
                newline)
    return report
