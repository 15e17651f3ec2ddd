"""Activation checkpointing per decoder layer, three kinds.

- ``full``: keep only each layer's input; recompute the layer in backward.
- ``offload``: as full, and the kept inputs wait in CPU memory (pinned when they come from
  an accelerator) instead of device memory: at 1M tokens they are L x S x hidden, which is
  most of what full keeps.
- ``attention``: as full, but the recompute reuses each layer's attention output and lse
  (easy_context.attention.saving), so backward does not run attention, nor its
  communication, twice.

Hugging Face decoder layers are ``GradientCheckpointingLayer``s: each calls its
``_gradient_checkpointing_func`` when ``gradient_checkpointing`` is on, so one
``gradient_checkpointing_enable`` plus a per-layer function covers every family.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention.saving import saving_context

KINDS = ("none", "full", "offload", "attention")


def pin_offloaded(*args) -> bool:
    """Whether host copies of these activations should be pinned: when they live on an
    accelerator. A pageable copy is staged and synchronous; a pinned one is a direct DMA. On
    the CPU there is nothing to copy across (and pinning needs an accelerator)."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tensor is not None and tensor.device.type not in ("cpu", "meta")


def _offloaded_checkpoint(function, *args, **kwargs):
    # Reentrant checkpointing saves the layer inputs with save_for_backward, which
    # save_on_cpu intercepts: the inputs then live in host memory until the recompute.
    # Pinning is decided here, from the activations, at every call: when checkpointing is
    # applied the model may not have reached its GPU yet.
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_offloaded(*args)):
        return checkpoint(function, *args, use_reentrant=True, **kwargs)


def apply_activation_checkpointing(model: nn.Module, kind: str) -> nn.Module:
    """Turn on ``kind`` checkpointing for every decoder layer of a transformers model."""
    if kind not in KINDS:
        raise ValueError(f"unknown activation checkpointing {kind!r}; choose one of {KINDS}")
    if kind == "none":
        return model
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if kind == "full":
        return model
    if kind == "attention":
        func = functools.partial(checkpoint, use_reentrant=False, context_fn=saving_context)
    else:
        func = _offloaded_checkpoint
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for layer in layers:
        layer._gradient_checkpointing_func = func
    return model
