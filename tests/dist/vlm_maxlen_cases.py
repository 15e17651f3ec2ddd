"""Rank functions for max-length mode with images: the tiled, head-chunked decoder of a tiny
vision-language model against the model's own forward on the whole step in one process.

The tower runs as without max-length mode (each rank encodes the images overlapping its
shard, vision.py); the decoder runs max-length mode on the embeddings with those features
scattered in, and the loss applies the final norm in chunks. Same model, step and reference
as vlm_cases.py (48 tokens, images across every shard boundary at 2 ranks).
"""

from __future__ import annotations

import copy

import torch.distributed as dist

import easy_context as ec
from easy_context.integrations.vision import prepare_vision_inputs
from easy_context.memory.maxlen import apply_max_length

from .vlm_cases import (_mm_kwargs, grad_error, make_step, reference_loss, tiny_vlm,
                        vision_grad_norm)


def max_length_vlm_error(family: str, method: str, keep_every: int, **text) -> str:
    """What a max-length step with images says (``keep_every``: the nested recompute;
    ``text``: decoder config entries of the tiny model)."""
    try:
        check_vlm_max_length(family, method, [(5, 2, "full", keep_every)], **text)
    except ValueError as e:
        return f"ValueError: {e}"
    return "ran"


def check_vlm_max_length(family: str, method: str, cases: list[tuple],
                         packed: bool = False, path: str = "auto",
                         drop_spans: bool = False, chunked: bool = True, **text) -> dict:
    """{case: (loss rel error, grad rel error, vision grad, images encoded here, paths)} for
    each (mlp_tile, heads_per_chunk, checkpointing, keep_every) in ``cases``. ``packed``: two
    conversations, the second starting inside the second image's run (as vlm_cases);
    ``drop_spans``: Gemma 3's image spans left out (what a test shows they change);
    ``chunked``: False for the whole-logits loss (the final norm then runs in the decoder);
    ``text``: decoder config entries of the tiny model (vlm_cases.tiny_vlm)."""
    import torch

    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_vlm(family, **text)
    step = make_step(family)
    documents = None
    if packed:
        documents = torch.zeros_like(step["input_ids"])
        documents[:, 20:] = 1
        step["target_ids"][:, 19] = -100
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, step, documents)
    ref_loss.backward()
    report = {}
    for tile, chunk, kind, keep_every in cases:
        model = copy.deepcopy(base)
        ec.apply_sequence_parallel(model, method)
        apply_max_length(model, tile, chunk, kind, keep_every=keep_every, path=path)
        paths = tuple(model._easy_context_max_length.paths)
        local = prepare_vision_inputs(
            model, method, step["input_ids"], step["target_ids"], rank, world,
            pixel_values=step["pixel_values"], image_grid_thw=step.get("image_grid_thw"),
            document_ids=documents, token_type_ids=_mm_kwargs(model, step).get("token_type_ids"))
        if drop_spans:
            local["vision"].image_spans = ()
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=chunked, chunk_size=5,
                                 document_ids=local["local_document_ids"],
                                 vision=local["vision"])
        loss.backward()
        encoded = sum(len(m.encoded) for m in local["vision"].media)
        report[f"{method} tile={tile} chunk={chunk} {kind} keep_every={keep_every} {path}"] = (
            abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            grad_error(model, ref), vision_grad_norm(model), encoded, paths)
    return report
