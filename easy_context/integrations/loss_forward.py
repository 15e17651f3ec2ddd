"""The model's own forward computes the sequence-parallel loss, when asked to.

Why inside the forward: the engines a Trainer wraps the model in act around the forward of
the module they wrap. DDP prepares its gradient all-reduce there; FSDP2 gathers the root's
parameters (embeddings, final norm, the head) there; ZeRO-3 gathers whatever is registered
with the root. The chunked loss reads the head's weight directly, never calling the head,
so it must run within that forward, not after it. A call without ``easy_context_targets``
is the model's original forward, untouched (generation, plain evaluation, saving).

PEFT's wrappers call the base model's ``forward`` with the keyword arguments they were
given, so the same request reaches the base model through a ``PeftModel`` too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .hf import causal_lm_loss, output_head

Tensor = torch.Tensor
_ORIGINAL = "_easy_context_original_forward"


@dataclass
class LossSettings:
    """What the loss forward needs beyond the tensors of one call. ``stats`` is a side
    channel, not an argument: engines cast floating-point arguments (FSDP2's mixed
    precision), and a cast copy would take the additions."""

    group: object  # the sequence-parallel process group the loss is summed over
    chunked: bool
    chunk_size: int | None = None
    stats: Tensor | None = field(default=None, repr=False)


def install_loss_forward(model: nn.Module, settings: LossSettings) -> None:
    """Give ``model`` (a transformers causal LM, not a PEFT wrapper) a forward that, called
    with ``easy_context_targets`` (this rank's shifted targets), returns the exact
    sequence-parallel loss (``easy_context.integrations.hf.causal_lm_loss``) as ``.loss``, with
    ``easy_context_num_items`` as its denominator when given, and ``easy_context_vision`` (a
    VisionShard: this rank's images, integrations/vision.py) when the step has images.
    Installing again replaces the settings."""
    original = getattr(model, _ORIGINAL, None) or model.forward

    @functools.wraps(original)  # inspect.signature (the Trainer's column filter) sees the original
    def forward(*args, easy_context_targets: Tensor | None = None,
                easy_context_num_items: Tensor | None = None, easy_context_vision=None,
                **kwargs):
        if easy_context_targets is None:
            return original(*args, **kwargs)
        if args:
            raise TypeError("the sequence-parallel loss forward takes keyword arguments only")
        loss = causal_lm_loss(
            model, kwargs["input_ids"], kwargs["position_ids"], easy_context_targets,
            group=settings.group, document_ids=kwargs.get("document_ids"),
            num_items_in_batch=easy_context_num_items, chunked=settings.chunked,
            chunk_size=settings.chunk_size, token_stats=settings.stats,
            vision=easy_context_vision)
        return CausalLMOutputWithPast(loss=loss)

    setattr(model, _ORIGINAL, original)
    model.forward = forward
    model._easy_context_loss_settings = settings


def loss_settings(model: nn.Module) -> LossSettings | None:
    return getattr(model, "_easy_context_loss_settings", None)


def chunked_loss_possible(model: nn.Module) -> bool:
    """The head is a linear layer, so the loss can skip the full logits."""
    return output_head(model)[0] is not None
