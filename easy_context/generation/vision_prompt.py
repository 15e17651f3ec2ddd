"""generate after an image prompt: the vision step of the prefill, and the decode positions.

The prompt's images go through the pieces training uses (integrations/vision.py): each rank
encodes only the images (and video frames) whose placeholder tokens overlap its shard of the
prompt and scatters their features into its own shard's embeddings; the positions are the
model's own ``get_rope_index`` on the whole prompt ((3, B, L) for multimodal RoPE), cut in the
method's layout. Bidirectional images (Gemma 3) keep their spans, computed on the whole
prompt, for the prefill's attention; the new tokens are text, causal. After the prompt every
new token is text: transformers numbers it
``rope_deltas`` past its index in the row (all three sections alike), where a row's delta is
its largest prompt position + 1 - its length; without multimodal RoPE the delta is 0.

The KV cache keeps each key's *index* in its row (0, 1, ...: what causality and padding are
masked by); only the rotary positions the decoder gets differ from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..integrations.vision import (LocalMedia, VisionFamily, VisionShard, describe,
                                   is_vision_language, prepare_vision_inputs, rope_positions)

Tensor = torch.Tensor

# generate's keyword arguments that carry a prompt's images, as the processors name them
MEDIA_KWARGS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                "second_per_grid_ts", "image_position_ids",
                "image_sizes")


@dataclass
class VisionPrompt:
    """This rank's share of an image prompt's prefill, and the rows' decode offsets."""

    shard: VisionShard   # the images this rank encodes and where their features go
    positions: Tensor    # (3, B, S_local) multimodal RoPE, else (B, S_local): rotary positions
    deltas: Tensor       # (B,) a new token's rotary position minus its index in the row


def check_vision_prompt(model: nn.Module, media: dict, mm_token_type_ids: Tensor | None,
                        input_ids: Tensor, attention_mask: Tensor | None, copies: int,
                        sharded: bool, token_type_ids: Tensor | None = None
                        ) -> VisionFamily | None:
    """None when no images came; else the model's VisionFamily, or a ValueError (before any
    collective) for what generate cannot do exactly with them."""
    if all(v is None for v in media.values()):
        return None
    name = type(model).__name__
    if not is_vision_language(model):
        raise ValueError(f"{name} has no vision tower (get_image_features): generate it "
                         "without pixel values")
    family = describe(model)  # bidirectional prefixes (PaliGemma): refused
    if family.image_sizes and media.get("pixel_values") is not None:
        from ..integrations.vision import _check_image_sizes

        _check_image_sizes(model, media["pixel_values"], media.get("image_sizes"))
    if copies > 1:
        raise ValueError("num_return_sequences > 1 with images is not supported by "
                         "easy_context.generate: repeat the prompt and its images in the batch")
    if sharded:
        # a rank whose shard holds no image runs no tower forward; with the tower's
        # parameters gathered per forward (FSDP2, ZeRO-3) the ranks would fall out of step
        raise ValueError("generate with images needs the vision tower's parameters whole on "
                         "every rank (not sharded by FSDP2 or ZeRO-3): generate on an unsharded "
                         "copy of the model")
    if mm_token_type_ids is not None:
        # recomputed here from the placeholder tokens; a different one would give other
        # positions in transformers than here
        expected = torch.zeros_like(input_ids)
        for code, modality in enumerate(("image", "video"), start=1):
            if modality in family.token_ids:
                expected[input_ids == family.token_ids[modality]] = code
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool())
        if mm_token_type_ids.shape != input_ids.shape or not torch.equal(
                mm_token_type_ids.to(expected)[real.to(expected.device)],
                expected[real.to(expected.device)]):
            raise ValueError("mm_token_type_ids does not mark exactly the image (1) and video "
                             "(2) placeholder tokens of input_ids: pass the processor's own, "
                             "or leave it out (generate derives it from the tokens)")
    if family.image_spans and family.spans_from == "mm_token_type_ids" and \
            mm_token_type_ids is None:
        # Gemma 4: transformers' forward without them attends causally over the images
        raise ValueError(f"{name}'s image tokens attend to each other both ways (on its "
                         "sliding layers) where mm_token_type_ids marks them (its processor "
                         "gives them): pass mm_token_type_ids to generate")
    if family.image_spans and family.spans_from == "token_type_ids" and token_type_ids is None:
        raise ValueError(f"{name}'s image tokens attend to each other both ways where "
                         "token_type_ids marks them (its processor gives them): pass "
                         "token_type_ids to generate")
    if token_type_ids is not None:
        # Gemma 3's image marks: the spans are derived from the image tokens here
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool()).to(input_ids.device)
        marks = input_ids == family.token_ids["image"]
        if token_type_ids.shape != input_ids.shape or not torch.equal(
                (token_type_ids.to(input_ids.device) == 1)[real], marks[real]):
            raise ValueError("token_type_ids does not mark exactly the image (1) tokens of "
                             "input_ids: pass the processor's own, or leave it out (generate "
                             "derives the images' spans from the tokens)")
    return family


def media_digest(media: dict) -> str:
    """A hash of the images (and grids), for the check that every rank got the same prompt."""
    h = hashlib.sha256()
    for key in MEDIA_KWARGS:
        value = media.get(key)
        if value is not None:
            t = value.detach().to("cpu").contiguous()
            h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def family_spans(model: nn.Module) -> bool:
    """Whether ``model``'s images attend both ways inside (Gemma 3; Gemma 4's sliding
    layers)."""
    return describe(model).image_spans


def _on(media: LocalMedia, device: torch.device) -> LocalMedia:
    return replace(media, pixel_values=media.pixel_values.to(device),
                   grid_thw=None if media.grid_thw is None else media.grid_thw.to(device),
                   token_mask=media.token_mask.to(device), rows=media.rows.to(device),
                   position_ids=None if media.position_ids is None else
                   media.position_ids.to(device))


def prepare_vision_prompt(model: nn.Module, method: str, ids: Tensor, valid: Tensor,
                          lengths: Tensor, rank: int, world: int, ring_degree: int | None,
                          media: dict, device: torch.device) -> VisionPrompt:
    """This rank's VisionPrompt for the (B, L) prompts ``ids``, each at the start of its row
    and padded at its end (``valid`` (B, L) marks the real tokens, ``lengths`` (B,) count
    them; the pads are text tokens after every real one: they move no real position)."""
    # the grids are integer bookkeeping next to the (host) token ids; the pixel values stay
    # where they came (only the encoded ones are sliced out, then moved to the model)
    given = {k: v if k.startswith("pixel_values") else v.cpu()
             for k, v in media.items() if v is not None}
    grids = {k: given[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
             if k in given}
    whole = rope_positions(model, ids, **grids)  # (3, B, L) or (B, L)
    top = whole if whole.dim() == 3 else whole.unsqueeze(0)
    top = top.masked_fill(~valid.unsqueeze(0), -1).amax(dim=(0, 2))  # (B,) largest real one
    if family_spans(model):  # checked equal to the image tokens (check_vision_prompt)
        family = describe(model)
        given[family.spans_from] = (ids == family.token_ids["image"]).long()
    local = prepare_vision_inputs(model, method, ids, ids, rank, world,
                                  ring_degree=ring_degree, **given)
    shard = VisionShard([_on(m, device) for m in local["vision"].media],
                        local["vision"].image_spans)
    return VisionPrompt(shard, local["local_position_ids"].to(device),
                        (top + 1 - lengths).to(device))
