"""The decoder (the stack of layers under the LM head) of a transformers causal LM, and the
text part of its config."""

from __future__ import annotations

from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """``model.get_decoder()``, where that finds it; else the base model's ``model`` attribute.

    transformers' lookup returns the causal LM itself for some families (Llama 4's text model
    keeps its decoder in ``.model`` while its base-model prefix names another attribute), and
    calling that returns logits, not hidden states; ModernBERT's finds its output head)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is model and isinstance(getattr(model, "model", None), nn.Module):
        return model.model
    if decoder is not model and not hasattr(decoder, "config"):
        # ModernBERT's decoder LM names its output projection ``decoder`` (BERT's head
        # naming), and transformers' lookup finds that Linear: the base model is the stack.
        base = getattr(model, "base_model", model)
        if base is not model:
            return base
    return decoder


def text_config(config):
    """The text model's config: ``get_text_config()`` where the config has one (multimodal
    and nested configs), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
