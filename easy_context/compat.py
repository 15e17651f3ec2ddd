"""The original EasyContext API, with its names and meanings, on top of ours.

    prepare_seq_parallel_inputs(seq_algo, input_ids, position_ids, target_ids, rank,
                                world_size, device) -> {"local_input_ids", ...}
    apply_seq_parallel_monkey_patch(seq_algo, model_type_or_model)
    prepare_dataloader(seq_algo, dataloader, accelerator)

``seq_algo`` takes our method names and their aliases, the original's among them
("zigzag_ring_attn", "dist_flash", "ulysses_attn", and "data_parallel": no sequence split).
This module only translates: the work is done by the core API (easy_context.sequence_parallel,
easy_context.integrations.hf), which never imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from .attention.documents import document_ids_from_positions, is_packed
from .integrations.hf import apply_sequence_parallel
from .parallel import get_method
from .sequence_parallel import shard_batch


def resolve_seq_algo(seq_algo: str) -> str:
    """Our method name for ``seq_algo`` (the original's names are aliases: ``data_parallel``
    is the ``local`` method, ``dist_flash`` is ``dist_flash_attn``...)."""
    return get_method(seq_algo).name


def prepare_seq_parallel_inputs(seq_algo: str, input_ids: torch.Tensor,
                                position_ids: torch.Tensor | None, target_ids: torch.Tensor,
                                rank: int, world_size: int, device: torch.device | str,
                                ring_degree: int | None = None, **kw: Any) -> dict:
    """This rank's shard of a batch, in the layout ``seq_algo`` expects.

    Tensors are (batch, seq). ``position_ids=None`` means 0..seq-1. The length must divide
    (see ``easy_context.pad_for_sequence_parallel``). Extra keyword arguments are accepted for
    compatibility and ignored. Besides the original three keys, the result holds
    ``local_document_ids``: when position ids restart inside a sequence (packed documents),
    this rank's shard of the document ids, to pass to the model as ``document_ids=`` so that
    attention stays inside each document; None when every sequence is one document (then no
    masking is needed, in any method).
    """
    method = resolve_seq_algo(seq_algo)
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    if input_ids.shape != target_ids.shape or input_ids.shape[-1] != position_ids.shape[-1]:
        raise ValueError(f"input_ids {tuple(input_ids.shape)}, position_ids "
                         f"{tuple(position_ids.shape)} and target_ids {tuple(target_ids.shape)} "
                         "must have the same (batch, seq) shape")
    position_ids = position_ids.expand_as(input_ids)
    # Decided on the whole batch, which every rank holds, so all ranks agree.
    documents = document_ids_from_positions(position_ids) if is_packed(position_ids) else None
    local = shard_batch({"input_ids": input_ids, "position_ids": position_ids,
                         "target_ids": target_ids, "document_ids": documents},
                        method, rank, world_size, ring_degree=ring_degree)
    return {f"local_{name}": None if t is None else t.to(device) for name, t in local.items()}


def apply_seq_parallel_monkey_patch(seq_algo: str, model_type_or_model: str | nn.Module,
                                    group=None, ring_degree: int | None = None) -> None:
    """Make a model, or every model of a type built afterwards, use ``seq_algo`` attention.

    Given a model: switch it now. Given a model type ("llama", "mistral", ...): every model of
    that type initialised afterwards (``from_pretrained`` included, whatever
    ``attn_implementation`` it asks for) is switched at the end of its initialisation, as the
    original's class patch did.
    """
    method = resolve_seq_algo(seq_algo)
    if method == "local":  # the original's data_parallel kept the model's own attention
        return
    if isinstance(model_type_or_model, nn.Module):
        apply_sequence_parallel(model_type_or_model, method, group, ring_degree)
        return
    base = _pretrained_class(model_type_or_model)
    original = base.__dict__.get("_easy_context_original_post_init", base.post_init)

    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        apply_sequence_parallel(self, method, group, ring_degree)

    base._easy_context_original_post_init = original
    base.post_init = post_init


def _pretrained_class(model_type: str) -> type:
    """The ``<Type>PreTrainedModel`` base class of a transformers model type."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown transformers model type {model_type!r} (e.g. 'llama', "
                         "'mistral', 'qwen2'); or pass the model itself")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    bases = [obj for name, obj in vars(module).items()
             if name.endswith("PreTrainedModel") and isinstance(obj, type)
             and obj.__module__ == module.__name__]
    if len(bases) != 1:
        raise ValueError(f"cannot find the PreTrainedModel class of {model_type!r}; "
                         "pass the model itself instead")
    return bases[0]


def prepare_dataloader(seq_algo: str, dataloader, accelerator):
    """As the original: data_parallel shards batches across ranks (``accelerator.prepare``);
    the sequence-parallel methods give every rank the same batch (the loader is returned
    unchanged: build it with the same seed on every rank), and each rank then keeps its shard
    through :func:`prepare_seq_parallel_inputs`. For DP x SP, use ``easy-context train``.
    """
    if resolve_seq_algo(seq_algo) == "local":
        if accelerator is None:
            raise ValueError("data_parallel needs an accelerator (accelerate.Accelerator) to "
                             "shard the data loader across ranks")
        return accelerator.prepare(dataloader)
    return dataloader
