"""easy_context.generate after an image prompt against transformers' greedy generate.

The prompts are vlm_cases.py's steps (images of 4 and 6 tokens at 4, 10, 22, 33, 40), cut to
46 tokens: at 2 ranks the images at 10-16, 22-26 and 33-39 straddle the shard boundaries of
the contiguous (24) and zigzag (12, 24, 36) layouts. The reference is the tiny model's own
``generate(**inputs, do_sample=False)`` in this process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import easy_context as ec

from .vlm_cases import ANYRES_IMAGES, IMAGE, VIDEO, make_anyres_step, make_step, tiny_vlm

PROMPT = 46
NEW_TOKENS = 10
LOGITS_TOL = 1e-5


def image_prompt(family: str, batch: int = 1, video: bool = False) -> dict:
    """The processor-like inputs: input_ids (B, PROMPT), pixel values (and grids,
    mm_token_type_ids for Qwen). batch 2: row 0 cut to its first 20 tokens (its images at
    4 and 10) and left-padded, row 1 whole (the other three images). ``video`` (Qwen): the
    third item, across 24, is a video of two frames (vlm_cases.make_step). Any-resolution
    towers (LLaVA-NeXT, OneVision): vlm_cases.make_anyres_step's whole step, with its
    image_sizes (one row)."""
    if family in ANYRES_IMAGES:
        if batch != 1 or video:
            raise ValueError("any-resolution prompts here are one row of images")
        step = make_anyres_step(tiny_vlm(family), family)
        return {k: step[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    step = make_step(family, batch, video=video)
    ids = step["input_ids"][:, :PROMPT].clone()
    out = {k: step[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                "video_grid_thw", "second_per_grid_ts", "image_position_ids")
           if k in step}
    mask = torch.ones_like(ids)
    if batch == 2:
        short = 20
        ids[0] = torch.cat([torch.zeros(PROMPT - short, dtype=torch.long), ids[0, :short]])
        mask[0, :PROMPT - short] = 0
        out["attention_mask"] = mask
    out["input_ids"] = ids
    if "image_grid_thw" in step or family == "gemma4":
        out["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    if family == "gemma3":  # its processor's image marks
        out["token_type_ids"] = (ids == IMAGE).long()
    return out


def compare_image_prompt(family: str, methods: list[str], batch: int = 1,
                         ring_degree: int | None = None, video: bool = False) -> dict:
    """{method: (transformers' new tokens, generate's)} and {"<method> logits": (want, got)}:
    every step's logits within LOGITS_TOL (relative) of transformers'; plus "<method>
    straddles": how many images this rank encoded (a straddling one counts on each rank)."""
    base = tiny_vlm(family).eval()
    inputs = image_prompt(family, batch, video)
    out = copy.deepcopy(base).generate(
        **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want, want_logits = out.sequences, torch.stack(out.logits, dim=1).float()  # (B, T, V)
    length = inputs["input_ids"].size(1)
    report = {}
    for method in methods:
        model = copy.deepcopy(base)
        rd = ring_degree if method == "usp_attn" else None
        got = ec.generate(model, method=method, ring_degree=rd, max_new_tokens=NEW_TOKENS,
                          eos_token_id=[], pad_token_id=0, return_stats=True,
                          output_logits=True, **inputs)
        report[method] = (want[:, length:].tolist(), got.sequences[:, length:].tolist())
        logits = torch.stack(got.logits, dim=1)
        err = ((logits - want_logits).abs().max() / want_logits.abs().max()
               if logits.shape == want_logits.shape else None)
        report[f"{method} logits"] = (f"within {LOGITS_TOL}",
                                      f"within {LOGITS_TOL}" if err is not None
                                      and float(err) <= LOGITS_TOL else f"off by {err}")
    return report


def images_encoded(family: str, method: str) -> int:
    """How many images this rank encodes for image_prompt's prompt (the vision step alone)."""
    from easy_context.generation.vision_prompt import prepare_vision_prompt
    from easy_context.parallel import get_method

    model = tiny_vlm(family)
    ec.apply_sequence_parallel(model, method)
    inputs = image_prompt(family)
    ids = inputs["input_ids"]
    multiple = ec.required_multiple(method, dist.get_world_size())
    padded = -(-ids.size(1) // multiple) * multiple
    full = torch.zeros(1, padded, dtype=torch.long)
    full[:, :ids.size(1)] = ids
    valid = torch.arange(padded)[None] < ids.size(1)
    world = 1 if get_method(method).layout == "whole" else dist.get_world_size()
    rank = dist.get_rank() if world > 1 else 0
    media = {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw")}
    prompt = prepare_vision_prompt(model, method, full, valid, torch.tensor([ids.size(1)]),
                                   rank, world, None, media, torch.device("cpu"))
    return sum(len(m.encoded) for m in prompt.shard.media)


def refused(family: str, **extra) -> str:
    """What generate says for ``family`` with image_prompt's images (and ``extra``)."""
    model = tiny_vlm(family).eval()
    step_family = family if family.startswith("qwen") or family in ("gemma3", "gemma4") \
        else "llava"
    inputs = image_prompt(step_family)
    if extra.get("token_type_ids") == "shifted":  # marks one token off the images
        extra = {**extra, "token_type_ids": inputs["token_type_ids"].roll(1, dims=1)}
    inputs.update(extra)
    try:
        ec.generate(model, method="zigzag_ring_attn", max_new_tokens=2, **inputs)
    except ValueError as e:
        return f"ValueError: {e}"
    return "generated"


def different_images() -> str:
    """What generate says when rank 1 was given other pixel values than rank 0."""
    model = tiny_vlm("llava").eval()
    inputs = image_prompt("llava")
    inputs["pixel_values"] = inputs["pixel_values"] + dist.get_rank()
    try:
        ec.generate(model, method="zigzag_ring_attn", max_new_tokens=2, **inputs)
    except ValueError as e:
        return f"ValueError: {e}"
    return "generated"
