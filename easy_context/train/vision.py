"""``easy-context train`` for vision-language models: each step through the library's vision
path (easy_context/integrations/vision.py), on data from ``prepare-data --processor``.

Every sequence-parallel rank of a group holds the whole step (token ids, the window's pixel
values and grids) and cuts its own share with ``prepare_vision_inputs``: its tokens, the
model's positions for them (multimodal RoPE from ``get_rope_index`` per packed
conversation), and the images whose placeholder tokens it holds, which it encodes itself. The
loss is ``causal_lm_loss(..., vision=)``: the same exact global token mean as for text.

What the engines need: FSDP2 shards the decoder's layers one by one and keeps the vision
tower in the root unit (the loss module), whose parameters every rank gathers for every
step, so a rank that holds no image token (and does not run the tower) takes part in the same
collectives as one that does; the tower's gradients, each rank's share (zeros where it
encoded nothing), are summed over the ranks like every other parameter's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..attention.documents import document_ids_from_positions, is_packed
from ..integrations.hf import CausalLMLoss, causal_lm_loss
from ..integrations.vision import VisionShard, is_vision_language, prepare_vision_inputs
from ..utils.decoder import decoder_of

def has_images(dataset) -> bool:
    """Whether a training dataset holds pixel values (``prepare-data --processor``)."""
    return "pixel_values" in dataset.column_names


def is_vision_config(model_config) -> bool:
    """Whether a model config is a vision-language model's (a vision tower beside the decoder)."""
    return getattr(model_config, "vision_config", None) is not None


def check_vision_run(config, images: bool, vision_model: bool) -> None:
    """Refuse, in one line, what the vision path of ``easy-context train`` does not take.
    ``images``: the dataset holds pixel values; ``vision_model``: the model has a tower."""
    if images and not vision_model:
        raise ValueError(f"--dataset {config.dataset} holds images (prepare-data --processor) "
                         f"and --model {config.model} has no vision tower; train a "
                         "vision-language model on it, or prepare text data")
    if not vision_model:
        return
    unsupported = [(flag, on) for flag, on in (
        ("--engine deepspeed", config.engine == "deepspeed"),
        ("--lora-rank", bool(config.lora_rank)),
        ("--auto-memory", config.auto_memory)) if on]
    if unsupported:
        raise ValueError(f"{unsupported[0][0]} does not take vision-language models in "
                         "`easy-context train` yet; use --engine fsdp without LoRA (or the "
                         "Trainer integration: docs/guides/vision-language.md)")


def window_images(rows: dict, count: int) -> dict[str, torch.Tensor]:
    """The pixel values and grids of ``count`` rows of a vision dataset, concatenated in row
    order (the order ``prepare_vision_inputs`` reads images in: row-major over (B, L))."""
    pixels, grids = [], []
    for i in range(count):
        shape = [int(n) for n in torch.as_tensor(rows["pixel_values_shape"][i]).tolist()]
        if not shape or shape[0] == 0:
            continue
        pixels.append(torch.as_tensor(rows["pixel_values"][i], dtype=torch.float32).view(shape))
        grid = torch.as_tensor(rows["image_grid_thw"][i], dtype=torch.long)
        if grid.numel():
            grids.append(grid.view(-1, 3))
    out = {}
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        if grids:
            out["image_grid_thw"] = torch.cat(grids)
    return out


def shard_vision_batch(model: nn.Module, batch: dict, method: str, rank: int, world: int,
                       ring_degree: int | None, device: torch.device) -> dict:
    """This rank's share of a step for ``engine.loss``: ids, positions, targets, documents
    and the vision shard, on ``device``."""
    positions = batch["position_ids"]
    documents = document_ids_from_positions(positions) if is_packed(positions) else None
    local = prepare_vision_inputs(
        model, method, batch["input_ids"], batch["target_ids"], rank, world,
        pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
        document_ids=documents, ring_degree=ring_degree)
    vision = VisionShard([dataclasses.replace(
        m, pixel_values=m.pixel_values.to(device),
        grid_thw=None if m.grid_thw is None else m.grid_thw.to(device),
        token_mask=m.token_mask.to(device), rows=m.rows.to(device))
        for m in local["vision"].media])
    out = {"input_ids": local["local_input_ids"].to(device),
           "position_ids": local["local_position_ids"].to(device),
           "target_ids": local["local_target_ids"].to(device), "vision": vision}
    if local["local_document_ids"] is not None:
        out["document_ids"] = local["local_document_ids"].to(device)
    return out


class VisionLMLoss(CausalLMLoss):
    """``CausalLMLoss`` that also takes a step's ``vision`` shard: the module the engine wraps
    as its root, so the vision tower's parameters are gathered with the root's."""

    def forward(self, input_ids, position_ids, target_ids, group=None, document_ids=None,
                num_items_in_batch=None, vision: VisionShard | None = None):
        return causal_lm_loss(self.model, input_ids, position_ids, target_ids, group=group,
                              document_ids=document_ids, num_items_in_batch=num_items_in_batch,
                              chunked=self.chunked, chunk_size=self.chunk_size, vision=vision)


def loss_module(model: nn.Module, chunked: bool | None) -> CausalLMLoss:
    """The loss module an engine wraps: one that takes images for a vision-language model."""
    return (VisionLMLoss if is_vision_language(model) else CausalLMLoss)(model, chunked=chunked)


def layers_to_shard(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The layers FSDP shards one by one: for a vision-language model only the decoder's (a
    tower block sharded alone would be gathered only by the ranks that run it, and a rank
    without image tokens does not), so the tower stays in the root unit."""
    if not is_vision_language(model):
        return layers
    inside = {id(m) for m in decoder_of(model).modules()}
    return [layer for layer in layers if id(layer) in inside]


__all__ = ["VisionLMLoss", "check_vision_run", "has_images",
           "is_vision_config", "layers_to_shard", "loss_module", "shard_vision_batch",
           "window_images"]
