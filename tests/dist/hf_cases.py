"""Sequence-parallel training steps of tiny Hugging Face models against one process.

Run on each rank: the same seed builds the same model and batch everywhere; the reference
is the plain model on the whole batch in this process (no collectives); the sequence-parallel
model sees this rank's shard. Loss values are compared directly; gradients after summing
them over ranks (each rank's gradient is its share of the global-mean loss).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec
from easy_context.integrations.hf import output_head

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=512, attention_dropout=0.0)
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
    "gemma": {},
    "olmo2": {},
}

# Families whose attention is more than causal softmax, each with its own attention as the
# reference ("eager": transformers' sdpa path has no soft-capping or sinks). Windows of no
# convenient size (3 and 7 against shards of 10 and zigzag chunks of 5), one past the
# sequence (64), chunks of 6, and multi-head latent attention (q/k head dim 12, v 6).
# Gemma's query scale (query_pre_attn_scalar 5) differs from 1/sqrt(head_dim 8), and the q/k
# projections start QK_INIT_SCALE x larger, so that soft-capping at 2.0 bites: a dropped scale
# or soft-cap fails these families (test_variant_scalars_matter keeps that true).
TWO_KINDS = ["sliding_attention", "full_attention"]
QK_INIT_SCALE = 8.0
VARIANT_FAMILIES = {
    "gemma2": dict(sliding_window=3, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   query_pre_attn_scalar=5, layer_types=TWO_KINDS),
    "gemma3_text": dict(sliding_window=7, query_pre_attn_scalar=5, layer_types=TWO_KINDS),
    "mistral_sliding": dict(sliding_window=7),
    "gpt_oss": dict(sliding_window=3, layer_types=TWO_KINDS, num_local_experts=4,
                    num_experts_per_tok=2),
    "cohere2": dict(sliding_window=64, layer_types=TWO_KINDS),
    "llama4_text": dict(attention_chunk_size=6, no_rope_layers=[1, 0],
                        layer_types=["chunked_attention", "full_attention"], num_local_experts=2,
                        intermediate_size_mlp=64, interleave_moe_layer_step=2,
                        attn_temperature_tuning=False),
    "deepseek_v3": dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                        v_head_dim=6, head_dim=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, first_k_dense_replace=1,
                        moe_intermediate_size=16, n_group=1, topk_group=1),
}


def tiny_model(family: str, seed: int = 0, **overrides):
    if family in VARIANT_FAMILIES:
        model_type = family.removesuffix("_sliding")
        config = AutoConfig.for_model(model_type, **{**COMMON, **VARIANT_FAMILIES[family],
                                                     **overrides})
        attn = "eager"
    else:
        config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
        attn = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()
    if family in VARIANT_FAMILIES:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(QK_INIT_SCALE)
    return model


def loss_paths(model) -> tuple[bool, ...]:
    """The chunked loss needs a linear head (soft-capped or scaled logits included)."""
    return (True, False) if output_head(model)[0] is not None else (False,)


def make_batch(length: int, vocab: int, seed: int = 1):
    """(2, length) ids and shifted targets with uneven ignored (-100) spans."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, length + 1), generator=gen)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    targets[0, : length // 2 + 1] = -100   # the first ranks hold few or no valid targets
    targets[1, -3:] = -100
    return inputs, torch.arange(length).expand(2, -1), targets


def reference_loss(model, inputs, positions, targets, document_ids=None):
    kw = {} if document_ids is None else {"document_ids": document_ids}
    logits = model(input_ids=inputs, position_ids=positions, **kw).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _grad_errors(sp_model, ref_model) -> float:
    """The largest relative gradient error, gradients summed over ranks; NaN when any
    gradient holds a NaN (torch.maximum keeps it, where Python's max would drop it)."""
    worst = torch.zeros(())
    for (name, p_sp), (_, p_ref) in zip(sp_model.named_parameters(), ref_model.named_parameters()):
        g = p_sp.grad.clone() if p_sp.grad is not None else torch.zeros_like(p_sp)
        if dist.is_initialized():
            dist.all_reduce(g)
        scale = p_ref.grad.abs().max().clamp(min=1e-6)
        worst = torch.maximum(worst, (g - p_ref.grad).abs().max() / scale)
    return worst.item()


def sharded_loss(base, method: str, inputs, positions, targets, ring_degree=None,
                 chunked: bool = True):
    """(a copy of ``base`` made sequence-parallel, its loss on this rank's shard, backward
    done). The document ids come from prepare_seq_parallel_inputs, as the README's example
    passes them: an unpacked batch's name one document per sequence, which must not switch
    document masking on in any method."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
    local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world, "cpu",
                                           ring_degree=ring_degree)
    loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                             local["local_target_ids"], chunked=chunked,
                             document_ids=local["local_document_ids"])
    loss.backward()
    return model, loss


def check_family(family: str, methods: list[str], chunked_options=(True, False)):
    """Returns {f"{method} chunked={c}": (loss rel error, max grad rel error)}."""
    world = dist.get_world_size()
    base = tiny_model(family)
    inputs, positions, targets = make_batch(2 * world * 5, base.config.vocab_size)
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    report = {}
    chunked_options = tuple(c for c in chunked_options if c in loss_paths(base)) or (False,)
    for method in methods:
        for chunked in chunked_options:
            ring_degree = 2 if method == "usp_attn" else None
            model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree,
                                       chunked)
            loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            report[f"{method} chunked={chunked}"] = (loss_err, _grad_errors(model, ref))
    return report


def check_packed_documents(family: str, method: str, ring_degree: int | None = None):
    """Packed sequences: the SP loss with document ids equals each document run alone."""
    world = dist.get_world_size()
    base = tiny_model(family)
    length = 2 * world * 5
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, base.config.vocab_size, (1, length + 1), generator=gen)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    starts = [0, 3, length // 2 + 1, length - 5]          # documents straddle the shards
    positions = torch.zeros(1, length, dtype=torch.long)
    for a, b in zip(starts, starts[1:] + [length]):
        positions[0, a:b] = torch.arange(b - a)
        targets[0, b - 1] = -100                           # no target across a boundary
    # reference: each document alone through the plain model; token-weighted mean
    ref = copy.deepcopy(base)
    total, count = 0.0, 0
    for a, b in zip(starts, starts[1:] + [length]):
        logits = ref(input_ids=inputs[:, a:b]).logits.float()
        total = total + F.cross_entropy(logits[0], targets[0, a:b], ignore_index=-100, reduction="sum")
        count += int((targets[0, a:b] != -100).sum())
    ref_loss = total / count
    ref_loss.backward()
    model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree)
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), _grad_errors(model, ref)


def nan_gradient_error(family: str = "llama") -> float:
    """_grad_errors when one gradient entry of the sequence-parallel model is NaN on rank 0
    (summed over ranks, the NaN reaches every rank): must not come back as a number <= TOL."""
    world = dist.get_world_size()
    base = tiny_model(family)
    inputs, positions, targets = make_batch(2 * world * 5, base.config.vocab_size)
    ref = copy.deepcopy(base)
    reference_loss(ref, inputs, positions, targets).backward()
    model, _ = sharded_loss(base, "zigzag_ring_attn", inputs, positions, targets)
    if dist.get_rank() == 0:
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    return _grad_errors(model, ref)


def refusal_at_two_ranks(model_type: str, fields: dict, method: str = "zigzag_ring_attn") -> str:
    """What apply_sequence_parallel says for a model built from ``fields`` alone (the config
    class's own defaults otherwise): 'ValueError: ...', another exception, or 'applied'."""
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    try:
        ec.apply_sequence_parallel(model, method)
    except Exception as e:  # noqa: BLE001  (the test tells a refusal from a raw error)
        return f"{type(e).__name__}: {e}"
    return "applied"
