"""Activation checkpointing per decoder layer, three kinds.

- ``full``: keep only each layer's input; recompute the layer in backward.
- ``offload``: as full, and the kept inputs wait in CPU memory instead of device memory: at
  1M tokens they are L x S x hidden, which is most of what full keeps. They go out and come
  back on a side CUDA stream, the previous layer's prefetched while one runs backward, in
  exact-size pinned buffers (offload.HostCheckpoints).
- ``attention``: as full, but the recompute reuses each layer's attention output and lse
  (easy_context.attention.saving), so backward does not run attention, nor its
  communication, twice.

Hugging Face decoder layers are ``GradientCheckpointingLayer``s: each calls its
``_gradient_checkpointing_func`` when ``gradient_checkpointing`` is on, so one
``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before transformers 5.2x)
plus a per-layer function covers every family.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention.saving import saving_context
from .offload import HostCheckpoints

KINDS = ("none", "full", "offload", "attention")


def _offloaded_checkpoint(storage: HostCheckpoints, index: int, function, *args, **kwargs):
    # Reentrant checkpointing saves the layer inputs with save_for_backward (and nothing
    # else: it runs the layer without grad), which the storage's hooks intercept: the inputs
    # then live in host memory until the recompute.
    with storage.hooks(index):
        return checkpoint(function, *args, use_reentrant=True, **kwargs)


def apply_activation_checkpointing(model: nn.Module, kind: str) -> nn.Module:
    """Turn on ``kind`` checkpointing for every decoder layer of a transformers model."""
    if kind not in KINDS:
        raise ValueError(f"unknown activation checkpointing {kind!r}; choose one of {KINDS}")
    if kind == "none":
        return model
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if kind == "full":
        return model
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    storage = HostCheckpoints(len(layers)) if kind == "offload" else None
    for index, layer in enumerate(layers):
        if kind == "attention":
            layer._gradient_checkpointing_func = functools.partial(
                checkpoint, use_reentrant=False, context_fn=saving_context)
        else:
            layer._gradient_checkpointing_func = functools.partial(
                _offloaded_checkpoint, storage, index)
    model._ec_host_checkpoints = storage  # what holds the offloaded inputs (tests, benchmarks)
    return model
