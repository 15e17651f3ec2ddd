"""Rank functions for MLA layers that send their latent under all-gather attention.

Each rank builds the same tiny MLA model and batch (same seeds); the reference is the plain
model on the whole batch in this process (fp32, eager attention, no collectives). The
sequence-parallel copy sees this rank's shard. Besides the errors (as hf_cases), each case
counts what the collectives of all-gather attention sent from this rank: the latent path's
(parallel/latent.py) and the expanded path's (parallel/allgather.py).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import easy_context as ec
from easy_context.parallel import allgather, latent

from .hf_cases import _grad_errors, make_batch, reference_loss, sharded_loss, tiny_model

# The second family: DeepSeek-V2 with q_proj (no query LoRA), its own complex RoPE.
DEEPSEEK_V2 = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=6, head_dim=4, num_key_value_heads=4, n_routed_experts=4,
                   num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=16,
                   n_group=1, topk_group=1)
# DeepSeek-V3 with what its module adds around the latent: biases on kv_a_proj_with_mqa and
# q_a_proj, interleaved RoPE, YaRN (its mscale_all_dim changes the softmax scale)
DEEPSEEK_V3_YARN = dict(attention_bias=True, rope_interleave=True, rope_parameters=dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale_all_dim=1.0,
    mscale=1.0, rope_theta=10000.0))
MLA_PARTS = ("kv_b_proj", "kv_a_layernorm", "kv_a_proj_with_mqa")


def mla_model(family: str):
    if family == "deepseek_v2":
        from transformers import AutoConfig, AutoModelForCausalLM

        from .hf_cases import COMMON

        config = AutoConfig.for_model("deepseek_v2", **{**COMMON, **DEEPSEEK_V2})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    if family == "deepseek_v3_yarn":
        return tiny_model("deepseek_v3", **DEEPSEEK_V3_YARN)
    return tiny_model(family)


@contextlib.contextmanager
def counted_sends():
    """{"latent"|"expanded": [bytes this rank sent, calls]} over the block, from the
    collectives of latent.py and allgather.py: an all-gather sends its input to N - 1
    ranks, a reduce-scatter N - 1 of its N outputs' worth."""
    sent = {"latent": [0, 0], "expanded": [0, 0]}
    saved = []

    def wrap(module, name, key, nbytes):
        original = getattr(module, name)

        def counting(out, inp, group=None):
            world = dist.get_world_size(group)
            sent[key][0] += (world - 1) * nbytes(out, inp)
            sent[key][1] += 1
            return original(out, inp, group=group)

        saved.append((module, name, original))
        setattr(module, name, counting)

    for module, key in ((latent, "latent"), (allgather, "expanded")):
        wrap(module, "all_gather_into", key, lambda out, inp: inp.nbytes)
        wrap(module, "reduce_scatter_into", key, lambda out, inp: out.nbytes)
    try:
        yield sent
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _part_grads_present(ref) -> bool:
    """Whether the reference gives every MLA part a non-zero gradient (so comparing them
    means something)."""
    parts = [p for n, p in ref.named_parameters()
             if p.requires_grad and any(part in n for part in MLA_PARTS)]
    return bool(parts) and all(p.grad is not None and bool(p.grad.abs().max() > 0)
                               for p in parts)


def check_mla(family: str, method: str = "allgather_attn", packed: bool = False,
              lora: bool = False) -> dict:
    """{"loss": rel error, "grads": worst rel error (every trained parameter, summed over
    ranks), "parts": whether the trained MLA parts have gradients, "sent": counted_sends}.
    ``lora``: a LoRA adapter on every linear layer of the decoder layers (kv_b_proj's
    included), the base frozen."""
    from .maxlen_cases import grad_errors, with_lora

    rank, world = dist.get_rank(), dist.get_world_size()
    base = mla_model(family)
    if lora:
        base = with_lora(base)
    length = 2 * world * 5
    inputs, positions, targets = make_batch(length, base.config.vocab_size)
    ref = copy.deepcopy(base)
    if packed:  # two documents per row, straddling the shards
        cut = length // 2 + 3
        positions = positions.clone()
        positions[:, cut:] -= cut
        targets = targets.clone()
        targets[:, cut - 1] = -100
        total, count = 0.0, 0
        for row in range(inputs.size(0)):
            for a, b in ((0, cut), (cut, length)):
                logits = ref(input_ids=inputs[row:row + 1, a:b]).logits.float()
                total = total + F.cross_entropy(logits[0], targets[row, a:b],
                                                ignore_index=-100, reduction="sum")
                count += int((targets[row, a:b] != -100).sum())
        ref_loss = total / count
    else:
        ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    with counted_sends() as sent:
        model, loss = sharded_loss(base, method, inputs, positions, targets)
    return {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grads": grad_errors(model, ref, world) if lora else _grad_errors(model, ref),
            "parts": _part_grads_present(ref),
            "sent": sent, "rank": rank}


def bytes_against_plan(family: str = "deepseek_v3") -> dict:
    """What one training step sent from this rank (batch 1, fp32, no checkpointing) and what
    the planner says for the model's shape: layers x communication_per_layer."""
    from easy_context.plan import shape_from_config
    from easy_context.plan.estimate import communication_per_layer

    rank, world = dist.get_rank(), dist.get_world_size()
    base = mla_model(family)
    length = 2 * world * 5
    inputs, positions, targets = make_batch(length, base.config.vocab_size)
    inputs, positions, targets = inputs[:1], positions[:1], targets[:1]
    with counted_sends() as sent:
        sharded_loss(base, "allgather_attn", inputs, positions, targets)
    shape = shape_from_config(base.config, family, check=False)
    per_layer = communication_per_layer(shape, length // world, 4, "allgather_attn", world)
    expanded = shape.attention_layers * ec.METHODS["allgather_attn"].comm_bytes(
        shape.attention_dims(), length // world, 4, world, None)
    return {"sent": sent, "planned": shape.attention_layers * per_layer,
            "planned_expanded": expanded}


def max_length_fallback(family: str = "deepseek_v3") -> dict:
    """Max-length mode (generic path, head chunks of 2) on an MLA model under all-gather:
    {"errors": check_max_length's report, "sent": counted_sends}."""
    from .maxlen_cases import check_max_length

    overrides = dict(head_dim=4, num_key_value_heads=8)
    with counted_sends() as sent:
        report = check_max_length(family, "allgather_attn", [(5, 2, "full", 1)],
                                  overrides=overrides)
    return {"errors": report, "sent": sent}


def check_hybrid_latent(family: str = "kimi_linear") -> dict:
    """A hybrid whose attention layers are MLA without RoPE (Kimi Linear: its KDA layers
    routed to easy_context.recurrent) under allgather_attn, against float64 in one process:
    {"errors": {method: (loss, grads)}, "sent": counted_sends}."""
    from .hf_recurrent_cases import check_hybrid

    with counted_sends() as sent:
        errors = check_hybrid(family, ["allgather_attn"])
    return {"errors": errors, "sent": sent}
