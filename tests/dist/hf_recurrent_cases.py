"""Hybrid models (recurrent and attention layers) sequence-parallel against one process: a
tiny Qwen3-Next (gated DeltaNet + attention) and the families of HYBRIDS (Qwen3.5, OLMo
hybrid, Kimi Linear, LFM2/LFM3, Granite 4, Bamba, Nemotron-H, Falcon-H1, Zamba2, Jamba), one
training step's loss and every parameter gradient (summed over ranks), packed documents too.
Run on each rank.

The reference runs in float64 (transformers' delta-rule kernel computes in float32 inside
whatever the dtype). The decays are set mild (A in [0.14, 1.6], dt_bias 0): with the default
init (A up to 16, dt_bias 1) the gradients of A_log and dt_bias are sums that cancel to ~1e-5
of the largest gradient, and any float32 run, one process included, is 3e-5 to 3e-4 (relative)
from float64 there (measured: one process 3.5e-5, ring 1.1e-4, zigzag 2.5e-4) while every
other gradient stays within 7e-7; with mild decays all are within ~5e-7.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from .hf_cases import COMMON, _grad_errors, make_batch, sharded_loss

QWEN3_NEXT = dict(layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4)


def tiny_qwen3_next(seed: int = 0):
    config = AutoConfig.for_model("qwen3_next", **{**COMMON, **QWEN3_NEXT})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():  # mild decays (module docstring)
        for m in model.modules():
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                m.A_log.copy_(torch.linspace(-2, 0.5, m.A_log.numel()))
                m.dt_bias.zero_()
    return model


def _loss64(model, inputs, targets, positions) -> torch.Tensor:
    """Sum of token losses and the count, in float64, no cache."""
    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum")


def check_qwen3_next(methods: list[str], piece: int = 2, chunked: bool = False) -> dict:
    """{method: (loss rel error, max grad rel error)}; zigzag pieces of ``piece`` tokens
    (2: shorter than the conv's halo of 3)."""
    return _every_method(tiny_qwen3_next(), methods, piece, chunked)


def _every_method(base, methods: list[str], piece: int, chunked: bool) -> dict:
    """{method: (loss rel error, max grad rel error)}: one step of ``base`` sharded by each
    method (pieces of ``piece`` tokens) against the same step in float64 in one process."""
    world = dist.get_world_size()
    inputs, positions, targets = make_batch(2 * world * piece, base.config.vocab_size)
    ref = copy.deepcopy(base).double()
    ref_loss = _loss64(ref, inputs, targets, positions) / (targets != -100).sum()
    ref_loss.backward()
    report = {}
    for method in methods:
        ring_degree = 2 if method == "usp_attn" else None
        model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree, chunked)
        report[method] = (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                          _grad_errors(model, ref))
    return report


def check_qwen3_next_documents(method: str, ring_degree: int | None = None):
    """Packed documents (position ids restarting; documents straddle the shards): equal to
    each document run alone from a zero state."""
    return check_hybrid_documents("qwen3_next", method, ring_degree)


def check_hybrid_documents(family: str, method: str, ring_degree: int | None = None):
    """check_qwen3_next_documents for any family of HYBRIDS (or "qwen3_next")."""
    world = dist.get_world_size()
    base = tiny_qwen3_next() if family == "qwen3_next" else tiny_hybrid(family)
    length = 2 * world * 5
    inputs, positions, targets, starts = _packed_batch(base, length,
                                                       [0, 3, length // 2 + 1, length - 5])
    ref = copy.deepcopy(base).double()
    ref_loss = _packed_reference(ref, inputs, positions, targets, starts)
    ref_loss.backward()
    model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree)
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), _grad_errors(model, ref)


def _packed_batch(base, length: int, starts: list[int], seed: int = 3):
    """(inputs, positions restarting at each of ``starts``, targets (-100 across a boundary),
    starts), one sequence of ``length`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, base.config.vocab_size, (1, length + 1), generator=gen)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    positions = torch.zeros(1, length, dtype=torch.long)
    for a, b in zip(starts, starts[1:] + [length]):
        positions[0, a:b] = torch.arange(b - a)
        targets[0, b - 1] = -100  # no target across a boundary
    return inputs, positions, targets, starts


def _packed_reference(ref, inputs, positions, targets, starts) -> torch.Tensor:
    """The mean token loss with each document run alone (float64, one process)."""
    length = inputs.size(1)
    total = sum(_loss64(ref, inputs[:, a:b], targets[:, a:b], positions[:, a:b])
                for a, b in zip(starts, starts[1:] + [length]))
    return total / (targets != -100).sum()


def check_documents_checkpointed(family: str, method: str) -> tuple[float, float]:
    """Two packed batches forward under activation checkpointing, then one backward of the
    sum: each layer's recompute must see its own batch's document ids (Jamba's decoder layer
    passes them to its Mamba layer only through the recording of hf_recurrent)."""
    import easy_context as ec
    from easy_context.memory.checkpointing import apply_activation_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_hybrid(family)
    length = 2 * world * 5
    batches = [_packed_batch(base, length, [0, 3, length // 2 + 1, length - 5]),
               _packed_batch(base, length, [0, 7, length - 3], seed=4)]
    ref = copy.deepcopy(base).double()
    ref_loss = sum(_packed_reference(ref, *b) for b in batches)
    ref_loss.backward()
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "full")
    ec.apply_sequence_parallel(model, method)
    losses = []
    for inputs, positions, targets, _ in batches:
        local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world,
                                               "cpu")
        losses.append(ec.causal_lm_loss(model, local["local_input_ids"],
                                        local["local_position_ids"], local["local_target_ids"],
                                        document_ids=local["local_document_ids"]))
    loss = sum(losses)
    loss.backward()
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), _grad_errors(model, ref)


def check_unrouted_is_refused() -> str:
    """A hybrid switched with attn_implementation alone (its recurrent layers not routed)."""
    world = dist.get_world_size()
    base = tiny_qwen3_next()
    base.set_attn_implementation("zigzag_ring_attn")
    inputs, positions, _ = make_batch(2 * world * 2, base.config.vocab_size)
    try:
        base(input_ids=inputs[:, :4], position_ids=positions[:, :4], use_cache=False)
    except ValueError as e:
        return str(e)
    return "ran"



GRANITE = dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8,
               mamba_expand=2, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
               mamba_chunk_size=8, num_local_experts=0, shared_intermediate_size=64)


def tiny_granite_hybrid(seed: int = 0):
    """Granite 4 hybrid: a Mamba-2 layer and an attention layer."""
    config = AutoConfig.for_model("granitemoehybrid", **{**COMMON, **GRANITE})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def check_granite_hybrid(methods: list[str], piece: int = 2) -> dict:
    """{method: (loss rel error, max grad rel error)} against float64 in one process."""
    base = tiny_granite_hybrid()
    base.train()  # the fused-kernel branch is taken in training only: it must decline
    return _every_method(base, methods, piece, False)


# More hybrid families: (model type, config overrides on COMMON). Each mixes a recurrent layer
# with an attention layer; MoE families with few experts.
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4)
HYBRIDS = {
    "qwen3_5": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], **DELTA)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(
        layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, **DELTA)),
    # separate q/k/v/a/b/g projections; beta in [0, 2] (linear_allow_neg_eigval)
    "olmo_hybrid": ("olmo_hybrid", dict(layer_types=["linear_attention", "full_attention"],
                                        pad_token_id=0, eos_token_id=1,
                                        linear_allow_neg_eigval=True, **DELTA)),
    # gated short convolutions, kernel 4 (a halo of 3 against pieces of 2), with biases
    "granite_hybrid": ("granitemoehybrid", GRANITE),
    # Mamba-2 (Granite's layer under other names); Nemotron-H's MLP and MoE blocks too
    "bamba": ("bamba", dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8,
                            mamba_expand=2, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                            mamba_chunk_size=8)),
    "falcon_h1": ("falcon_h1", dict(
        mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_ssm=64, mamba_d_conv=4, mamba_chunk_size=8, ssm_in_multiplier=0.7,
        ssm_out_multiplier=1.3, key_multiplier=0.9, embedding_multiplier=1.1,
        attention_in_multiplier=0.8, attention_out_multiplier=1.2, lm_head_multiplier=0.5)),
    # Zamba2: a shared attention block (on [hidden, embeddings], with per-layer adapters) feeding
    # the Mamba-2 of its "hybrid" layers
    "zamba2": ("zamba2", dict(
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_hidden_layers=4,
        head_dim=16, num_key_value_heads=4, n_mamba_heads=8, mamba_expand=2, mamba_d_state=8,
        mamba_ngroups=2,
        mamba_d_conv=4, chunk_size=8, use_mem_rope=True, use_shared_attention_adapter=True,
        adapter_rank=4)),
    "nemotron_h": ("nemotron_h", dict(
        layer_types=["linear_attention", "moe", "full_attention", "mlp"], num_hidden_layers=4,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16)),
    # Jamba: Mamba-1 (selective scan, a (d_inner, N) decay) on layer 0, attention and MoE on
    # layer 1; conv kernel 4 against pieces of 2
    "jamba": ("jamba", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                            num_experts_per_tok=2, mamba_d_state=4, mamba_d_conv=4,
                            mamba_expand=2, mamba_dt_rank=4)),
    # Kimi Linear: KDA (the gated delta rule with a per-channel gate) and MLA attention
    "kimi_linear": ("kimi_linear", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, kv_lora_rank=16,
        num_key_value_heads=4,  # MLA: a key and value per query head
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"], conv_L_cache=4,
                          conv_bias=True, block_auto_adjust_ff_dim=False)),
    "lfm2_moe": ("lfm2_moe", dict(layer_types=["conv", "full_attention"], conv_L_cache=4,
                                  num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16)),
    "lfm3": ("lfm3", dict(layer_types=["conv", "sliding_attention", "full_attention"],
                          num_hidden_layers=3, sliding_window=3, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)),
}
# Configs of these families with no attention layer: every token mixer is a routed recurrent
# layer (the families sweep's 2-layer tiny models are such), nothing else to shard.
HYBRIDS.update({
    "qwen3_next": ("qwen3_next", QWEN3_NEXT),
    "qwen3_next_no_attention": ("qwen3_next", dict(QWEN3_NEXT, layer_types=["linear_attention"] * 2)),
    "granite_no_attention": ("granitemoehybrid", dict(GRANITE, layer_types=["mamba"] * 2)),
    "lfm2_no_attention": ("lfm2", dict(HYBRIDS["lfm2"][1], layer_types=["conv"] * 2)),
})


def tiny_hybrid(family: str, seed: int = 0, **config):
    """A tiny model of ``HYBRIDS[family]`` (``config``: more overrides), mild decays (module
    docstring), in training mode (a layer's training-only branch, e.g. Mamba-2's fused kernel,
    is taken)."""
    model_type, overrides = HYBRIDS[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides, **config})
    torch.manual_seed(seed)
    # eager experts: the grouped-matmul path takes no float64 (the reference)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                             experts_implementation="eager").float()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "A_log", None), torch.Tensor) and \
                    isinstance(getattr(m, "dt_bias", None), torch.Tensor):
                m.A_log.copy_(torch.linspace(-2, 0.5, m.A_log.numel()).view_as(m.A_log))
                m.dt_bias.zero_()
    return model.train()


def check_hybrid(family: str, methods: list[str], piece: int = 2, chunked: bool = False) -> dict:
    """{method: (loss rel error, max grad rel error)} against float64 in one process
    (``chunked``: the chunked loss, which applies the head's logit scaling itself)."""
    return _every_method(tiny_hybrid(family), methods, piece, chunked)
