"""Vision-language steps with the vision tower sharded (FSDP2, DeepSpeed ZeRO-3) against one
process (test_vlm_sharded.py).

FSDP2 as accelerate's transformer_based_wrap applies it: fully_shard on every module whose
class is in the model's ``_no_split_modules`` (the vision blocks, the decoder layers) and on
the model; ZeRO-3 with every parameter partitioned (no persistence threshold). Both gather a
unit's parameters collectively when it runs and reduce-scatter its gradients after its
backward, so every rank must run the tower as often as the others: the step puts its two
images in the first shard(s) only (``ring_attn``'s contiguous shards), so the last rank (the
last two of four) holds no image token and runs the tower on a dummy image
(integrations/vision.py), and the ranks that hold images hold different numbers of them.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.integrations.loss_forward import LossSettings, install_loss_forward
from easy_context.integrations.vision import prepare_vision_inputs

from .vlm_cases import IMAGE, make_anyres_step, make_step, reference_loss, tiny_vlm

KEEP = 2  # images kept: tokens 4-7 and 10-15 (Qwen; LLaVA 4-7, 10-13), all before 24


def early_images_step(family: str) -> dict:
    """make_step's step with only its first KEEP images (the rest turned into text)."""
    step = make_step(family)
    ids = step["input_ids"]
    runs = (ids[0] == IMAGE).nonzero().flatten().tolist()
    gen = torch.Generator().manual_seed(7)
    if "image_grid_thw" in step:
        grid = step["image_grid_thw"][:KEEP]
        kept_tokens = int((grid.prod(-1) // 4).sum())
        step["pixel_values"] = step["pixel_values"][:int(grid.prod(-1).sum())]
        step["image_grid_thw"] = grid
    else:
        kept_tokens = 4 * KEEP
        step["pixel_values"] = step["pixel_values"][:KEEP]
    later = torch.tensor(runs[kept_tokens:], dtype=torch.long)
    ids[0, later] = torch.randint(3, 89, (later.numel(),), generator=gen)
    return step


def early_anyres_step(model, family: str) -> dict:
    """make_anyres_step's step with only its first image (its tokens from 12, all in
    ring_attn's first shard of two; the other images' tokens turned into text)."""
    from easy_context.integrations.vision import _sized_tokens

    step = make_anyres_step(model, family)
    ids = step["input_ids"]
    runs = (ids[0] == IMAGE).nonzero().flatten().tolist()
    kept = _sized_tokens(model, step["image_sizes"][:1])[0]
    gen = torch.Generator().manual_seed(7)
    later = torch.tensor(runs[kept:], dtype=torch.long)
    ids[0, later] = torch.randint(3, 89, (later.numel(),), generator=gen)
    step["pixel_values"] = step["pixel_values"][:1]
    step["image_sizes"] = step["image_sizes"][:1]
    return step


def _sharded_units(model) -> list:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _zero3(model):
    import deepspeed

    from easy_context.train.engines.deepspeed import _start_deepspeed_comm

    _start_deepspeed_comm()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": False}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # one ZeRO takes
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      dist_init_required=False)
    return engine


def sharded_vlm_step(family: str, engine: str, method: str = "ring_attn",
                     units: str = "blocks", video: bool = False) -> dict:
    """One step of ``family`` on ``engine`` ("fsdp2", "zero3"), the loss through the model's
    forward (install_loss_forward, as the Trainer runs it, so the root unit is gathered):
    {"loss": relative error, "grads": the worst relative gradient error (every parameter, the
    tower's included), "vision": |tower gradient| in the one process, "encoded": images this
    rank encodes, "sharded": tower parameters were sharded}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_vlm(family)  # units="tower": FSDP2 on the whole tower, one unit
    # video: make_step's images and a two-frame video, every rank holding some of both
    anyres = family in ("llava_next", "llava_onevision", "mistral3")  # image_sizes towers
    step = (early_anyres_step(base, family) if anyres else
            make_step(family, video=True) if video else early_images_step(family))
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, step)
    ref_loss.backward()
    ref_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for n, p in ref.named_parameters()}
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method)
    install_loss_forward(model, LossSettings(group=None, chunked=engine == "fsdp2"))
    local = prepare_vision_inputs(model, method, step["input_ids"], step["target_ids"], rank,
                                  world, pixel_values=step["pixel_values"],
                                  image_grid_thw=step.get("image_grid_thw"),
                                  pixel_values_videos=step.get("pixel_values_videos"),
                                  video_grid_thw=step.get("video_grid_thw"),
                                  second_per_grid_ts=step.get("second_per_grid_ts"),
                                  image_sizes=step.get("image_sizes"))
    inputs = dict(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"],
                  easy_context_targets=local["local_target_ids"],
                  easy_context_vision=local["vision"])
    names = [n for n, _ in model.named_parameters()]
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        if units == "tower":
            inner = model.model
            fully_shard(getattr(inner, "visual", None) or inner.vision_tower)
            for layer in inner.language_model.layers:
                fully_shard(layer)
        else:
            for unit in _sharded_units(model):
                fully_shard(unit)
        fully_shard(model)
        sharded = any(isinstance(p, DTensor) for n, p in model.named_parameters()
                      if "visual" in n or "vision_tower" in n)
        loss = model(**inputs).loss
        loss.backward()
        # FSDP2 averages gradients over the ranks; each rank's is its tokens' share
        # (None: a parameter the model never uses, e.g. CLIP's post_layernorm, on every rank)
        grads = {n: p.grad.full_tensor() * world if p.grad is not None
                 else torch.zeros(p.shape) for n, p in model.named_parameters()}
    else:
        from deepspeed.utils import safe_get_full_grad

        wrapped = _zero3(model)
        try:
            sharded = all(hasattr(p, "ds_id") for p in model.parameters())
            loss = wrapped(**inputs).loss
            wrapped.backward(loss)
            grads = {n: safe_get_full_grad(p) * world for n, p in model.named_parameters()}
        finally:
            wrapped.destroy()
    total = loss.detach().clone()
    floor = 1e-3 * torch.stack([g.abs().max() for g in ref_grads.values()]).max()
    worst = torch.zeros(())
    assert sorted(grads) == sorted(ref_grads) == sorted(names)
    for name, g_ref in ref_grads.items():
        scale = torch.maximum(g_ref.abs().max(), floor).clamp(min=1e-6)
        worst = torch.maximum(worst, (grads[name] - g_ref).abs().max() / scale)
    vision = sum(float(g.abs().sum()) for n, g in ref_grads.items()
                 if "visual" in n or "vision_tower" in n)
    return {"loss": abs(total.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grads": worst.item(), "vision": vision, "sharded": sharded,
            "encoded": sum(len(m.encoded) for m in local["vision"].media)}


def early_batch(family: str) -> dict:
    """early_images_step as a Trainer batch (one row, no padding, the collator's keys): at 2
    ranks of ring_attn the second rank's shard holds no image token."""
    step = early_images_step(family)
    ids = step["input_ids"]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "pixel_values": step["pixel_values"]}
    if "image_grid_thw" in step:
        batch["image_grid_thw"] = step["image_grid_thw"]
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
    return batch


def text_batch(family: str) -> dict:
    """A Trainer batch of text only (one row of 48 tokens; for Qwen a processor's
    mm_token_type_ids, all zero): what another data-parallel group may hold in the step."""
    ids = torch.randint(3, 89, (1, 48), generator=torch.Generator().manual_seed(11))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if family.startswith("qwen"):
        batch["mm_token_type_ids"] = torch.zeros_like(ids)
    return batch
