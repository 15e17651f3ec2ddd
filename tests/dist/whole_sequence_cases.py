"""Rank functions: models whose transformers code derives something from the length of the
call (dynamic / LongRoPE scaling, Llama 4's attn_temperature_tuning), sequence-parallel
against the plain model on the whole sequence in this process (fp32)."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .hf_cases import (COMMON, VARIANT_FAMILIES, _grad_errors, make_batch, reference_loss,
                       sharded_loss)

TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# dynamic NTK past 24 positions; LongRoPE's long factors past 24 (Phi-3.5 / Phi-4 style)
DYNAMIC = dict(max_position_embeddings=24,
               rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
LONGROPE = dict(max_position_embeddings=96, original_max_position_embeddings=24,
                rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
    "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 9.0]})
# Llama 4 with its NoPE layer (layer 1) scaling queries by position, a small floor_scale so
# the scale changes every 3 tokens of a short sequence
LLAMA4_TUNED = dict(VARIANT_FAMILIES["llama4_text"], attn_temperature_tuning=True,
                    floor_scale=3, attn_scale=0.5)


def build(model_type: str, overrides: dict, attn: str = "sdpa", seed: int = 0):
    config = AutoConfig.for_model(model_type, **{**COMMON, **TOKENS, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def check_whole_sequence(model_type: str, overrides: dict, length: int, methods: list[str],
                         attn: str = "sdpa") -> dict:
    """{method: (loss rel error, worst grad error, whether the reference's RoPE frequencies
    left their original values)} for one training step of a ``length``-token batch."""
    base = build(model_type, overrides, attn)
    inputs, positions, targets = make_batch(length, base.config.vocab_size)
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    rotary = getattr(ref.model, "rotary_emb", None)
    rescaled = rotary is not None and hasattr(rotary, "original_inv_freq") and \
        not torch.equal(rotary.inv_freq, rotary.original_inv_freq)
    report = {}
    for method in methods:
        ring_degree = 2 if method == "usp_attn" else None
        model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree)
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        report[method] = (loss_err, _grad_errors(model, ref), rescaled)
    return report


def generate_tuned(methods: list[str], length: int) -> dict:
    """{method: (transformers' greedy tokens in one process, easy_context.generate's)} for
    one unpadded prompt of Llama 4 with attn_temperature_tuning (transformers counts the
    scale's positions from its cache: the same as the tokens' positions without padding)."""
    import easy_context as ec

    from .generate_cases import NEW_TOKENS, prompts, reference

    # weights large enough that the attention is far from uniform: scaled queries change
    # the tokens (with the default 0.02 they barely move the softmax)
    base = build("llama4_text", dict(LLAMA4_TUNED, initializer_range=0.3), "eager").eval()
    ids, mask = prompts(base.config.vocab_size, (length,))
    want = reference(copy.deepcopy(base), ids, mask)
    report = {}
    for method in methods:
        got = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                          max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0)
        report[method] = (want[:, length:].tolist(), got[:, length:].tolist())
    return report
