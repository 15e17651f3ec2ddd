"""The decoder (the stack of layers under the LM head) of a transformers causal LM."""

from __future__ import annotations

from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """``model.get_decoder()``, where that finds it; else the base model's ``model`` attribute.

    transformers' lookup returns the causal LM itself for some families (Llama 4's text model
    keeps its decoder in ``.model`` while its base-model prefix names another attribute), and
    calling that returns logits, not hidden states."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is model and isinstance(getattr(model, "model", None), nn.Module):
        return model.model
    return decoder
