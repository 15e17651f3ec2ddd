"""Max-length mode (fused layers: tiled MLP and norms, head-chunked attention, own recompute,
final norm in the chunked loss) equals the plain model: fp32, loss within 1e-5 relative and
every parameter's gradient (summed over ranks) within 1e-5 of its max |grad|, on 1, 2 and 4
gloo ranks, for several families and every sequence-parallel method (measured ~1e-7)."""

import pytest

import torch
from torch import nn

from easy_context.memory.generic_layer import mlp_mismatch

from easy_context.memory.maxlen import decoder_layers, path_for

from .maxlen_cases import (DROP, check_against_plain, check_max_length, fused_layer_work,
                           generic_calls, max_length_error, max_length_step_error, paths_of,
                           tiled_backward_verdicts, tiled_layer_runs, tiny)

TOL = 1e-5
# (mlp_tile, heads_per_chunk, checkpointing, keep_every) on 8 query / 4 KV heads: tiles that do
# not divide the shard, chunks of one and two KV heads (2 and 4 query heads), each kind of
# keeping, the nested recompute; a chunk of one query head (half a KV head's, K/V recomputed
# for each half) and uneven chunks (6 + 2 query heads) where the method allows them.
ALL_KINDS = [(5, 2, "full", 1), (7, 4, "attention", 1), (3, 2, "offload", 1),
             (4, 2, "none", 1), (6, 4, "full", 2)]
SUB = [(5, 1, "full", 1), (4, 1, "attention", 1)]
UNEVEN = [(6, 6, "attention", 1)]
ONE = [(5, 2, "full", 1)]


def _assert(reports):
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}"
           for r, rep in enumerate(reports) for case, (le, ge) in rep.items()
           if not (le <= TOL and ge <= TOL)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_one_rank_families(dist1, family):
    _assert(dist1.run(check_max_length, family, "local",
                      ALL_KINDS + SUB + UNEVEN if family == "llama" else ONE + SUB[:1]))


@pytest.mark.parametrize("method,ring_degree", [
    ("zigzag_ring_attn", None), ("ring_attn", None), ("dist_flash_attn", None),
    ("ulysses_attn", None), ("usp_attn", 1), ("allgather_attn", None)])
def test_two_ranks_methods(dist2, method, ring_degree):
    cases = (ALL_KINDS + SUB + UNEVEN if method == "zigzag_ring_attn" else
             ALL_KINDS if method == "ulysses_attn" else
             ONE if method == "usp_attn" else ONE + SUB[:1])  # usp here: Ulysses over 2
    _assert(dist2.run(check_max_length, "llama", method, cases, ring_degree))


@pytest.mark.parametrize("family", ["mistral_sliding", "gpt_oss"])
def test_two_ranks_attention_variants(dist2, family):
    """Sliding windows (3 and 7 tokens) and GPT-OSS's sinks, through the head chunks: each
    chunk gets its query heads' sinks and their gradient back."""
    _assert(dist2.run(check_max_length, family, "zigzag_ring_attn", ONE + SUB[:1]))
    _assert(dist2.run(check_max_length, family, "ulysses_attn", [(4, 2, "attention", 1)]))


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_two_ranks_families(dist2, family):
    _assert(dist2.run(check_max_length, family, "zigzag_ring_attn", ONE))
    _assert(dist2.run(check_max_length, family, "ulysses_attn", [(4, 2, "attention", 1)]))


@pytest.mark.parametrize("method,ring_degree,chunk", [
    ("zigzag_ring_attn", None, 1), ("ulysses_attn", None, 4), ("usp_attn", 2, 2),
    ("allgather_attn", None, 2)])
def test_four_ranks(dist4, method, ring_degree, chunk):
    _assert(dist4.run(check_max_length, "llama", method, [(5, chunk, "full", 1),
                                                          (3, chunk, "offload", 2)], ring_degree))


# Granite scales each residual branch (residual_multiplier), its softmax (attention_multiplier),
# embeddings and logits; SmolLM3 skips RoPE on some layers (no_rope_layers: layer 1 here).
# Both have Llama's children, so only their settings tell them apart.
GRANITE = dict(residual_multiplier=0.37, attention_multiplier=0.2, embedding_multiplier=3.0,
               logits_scaling=2.0)
SMOLLM3 = dict(no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("family,overrides", [("granite", GRANITE), ("smollm3", SMOLLM3)])
def test_layers_with_their_own_settings(dist1, dist2, family, overrides):
    _assert(dist1.run(check_max_length, family, "local", ONE + [(4, 2, "attention", 1)],
                      overrides=overrides))
    _assert(dist2.run(check_max_length, family, "zigzag_ring_attn", [(5, 2, "full", 1),
                                                                    (6, 4, "full", 2)],
                      overrides=overrides))


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_packed_documents(dist2, method):
    _assert(dist2.run(check_max_length, "llama", method, [(5, 2, "full", 1)], packed=True))


def test_unsupported_structures_are_refused(dist2):
    # the fused layer refuses OLMo-2's post-norm layers (the generic path runs them)
    olmo = dist2.run(max_length_error, "olmo2", "zigzag_ring_attn", 1, path="fused")[0]
    assert "pre-norm decoder layers" in olmo and "post_feedforward_layernorm" in olmo
    # the generic path refuses what it cannot redo exactly: dropout (the recompute would
    # draw again), an MoE's router logits for the auxiliary loss (tiles are separate calls)
    drop = dist2.run(max_length_error, "phi3", "zigzag_ring_attn", 1, pad_token_id=0,
                     resid_pdrop=0.1)[0]
    assert "dropout" in drop and "resid_attn_dropout" in drop
    aux = dist2.run(max_length_error, "qwen3_moe", "zigzag_ring_attn", 1, **QWEN3_MOE,
                    output_router_logits=True)[0]
    assert "output_router_logits" in aux
    # Ulysses cannot split a chunk of one query head over 2 ranks
    odd = dist2.run(max_length_error, "llama", "ulysses_attn", 1)[0]
    assert "head chunks of 1 query heads" in odd and "--head-chunk" in odd
    # 3 query heads would split the 2 that share a KV head
    assert "splits a group of 2 query heads" in dist2.run(max_length_error, "llama",
                                                          "zigzag_ring_attn", 3)[0]


# The generic path: the model's own layer forward (sandwich norms, soft-caps, multipliers,
# Phi-3's fused gate_up, MoE routers, LoRA adapters) with its MLP module in checkpointed
# sequence tiles and its attention function called a chunk of heads at a time. Tiles of 3-5
# tokens against shards of 12 and 24, one query head per chunk, offloaded inputs, the nested
# recompute (offloaded, and on the device handing its attention to the backward that
# follows), kept attention.
GENERIC = [(5, 1, "full", 1), (3, 2, "offload", 2), (4, 2, "attention", 1), (6, 2, "full", 2)]
GEMMA3_SOFTCAP = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
PHI3 = dict(pad_token_id=0)
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK_V3 = dict(head_dim=4, num_key_value_heads=8)  # with hf_cases' MLA widths


@pytest.mark.parametrize("family,overrides,path,lora", [
    ("gemma3_text", {}, "auto", False),  # sliding + global layers, sandwich norms
    ("gemma3_text", GEMMA3_SOFTCAP, "auto", False),
    ("phi3", PHI3, "auto", False),  # fused qkv and gate_up projections
    ("granite", GRANITE, "generic", False),  # multipliers (the fused path takes it too)
    ("qwen3_moe", QWEN3_MOE, "generic", False),  # router + experts, tiled
    ("olmo3", {}, "auto", False),  # post-norm, norms over all heads
    ("llama4_text", {}, "auto", False),  # MoE + dense layers, chunked attention, NoPE
    ("llama", {}, "auto", True),  # LoRA on every linear layer
    ("deepseek_v3", DEEPSEEK_V3, "auto", False),  # MLA (v head dim 6), grouped MoE routing
    ("nanochat", {}, "auto", False),  # its final norm also norms the embeddings
])
def test_generic_path(dist1, dist2, family, overrides, path, lora):
    if path == "auto":  # these take the generic path on their own
        assert set(dist1.run(paths_of, family, lora, **overrides)[0]) == {"generic"}
    _assert(dist1.run(check_max_length, family, "local", GENERIC, overrides=overrides,
                      path=path, lora=lora))
    _assert(dist2.run(check_max_length, family, "zigzag_ring_attn", GENERIC[:2],
                      overrides=overrides, path=path, lora=lora))


# Decoders that differ from Llama's outside their layers' attention and MLP: the final norm
# under another name (GPT-2's ln_f, Falcon's ln_f, Phi's final_layernorm), found and applied
# in the loss; layer lists under another name (GPT-2's and Falcon's ``h``); Falcon's layers
# return (hidden states, None); layers handed more than the hidden states: Gemma 4's
# per_layer_input (a tensor with grad: an input of the layer's recompute, its gradient flows
# back to the per-layer embeddings), Beam's attention_scaling. BERT-style decoders: layers in
# ``encoder.layer`` whose feed-forward is a method (feed_forward_chunk, tiled), no final norm
# (RoBERTa-PreLayerNorm's is ``LayerNorm``, folded), and a head with a transform (dense,
# activation, LayerNorm) before its projection, run in the loss's chunks.
GPT2 = dict(n_inner=112, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
FALCON = dict(head_dim=DROP, num_kv_heads=4, new_decoder_architecture=True, hidden_dropout=0.0,
              attention_dropout=0.0)
GEMMA4 = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, pad_token_id=0)
# Gemma 3n: four AltUp streams through every layer (predict, correct, per-layer inputs, LAuReL),
# combined after the last layer (unembedding projections, magnitudes, mean) before the final
# norm: that norm is not folded (the decoder applies it, the loss takes its output); a
# sparsified MLP (top-k of its activations per token) in layer 0
GEMMA3N = dict(GEMMA4, num_kv_shared_layers=0, laurel_rank=4, sliding_window=7,
               layer_types=["sliding_attention", "full_attention"],
               activation_sparsity_pattern=[0.95, 0.0])
BERT = dict(is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0)
# Feed-forwards inline in the layer's forward (fc1 -> activation -> fc2 on children, no MLP
# module): OPT's on hidden states flattened to (B * S, H), BioGPT's (an activation dropout,
# 0 here, between), Whisper's decoder (WhisperForCausalLM: its cross-attention idle)
OPT = dict(dropout=0.0, ffn_dim=112)
BIOGPT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, activation_dropout=0.0)
WHISPER = dict(dropout=0.0, d_model=64, decoder_layers=2, decoder_attention_heads=8,
               decoder_ffn_dim=112, encoder_layers=2, encoder_attention_heads=8,
               encoder_ffn_dim=112, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)


@pytest.mark.parametrize("family,overrides,two_ranks", [
    ("gpt2", GPT2, True), ("falcon", FALCON, True), ("phi", PHI3, True), ("beam", {}, True),
    ("bert", BERT, True), ("roberta-prelayernorm", BERT, True),
    ("opt", OPT, True), ("biogpt", BIOGPT, True), ("whisper", WHISPER, True),
    # one rank only: at 2 ranks plain sequence parallelism is itself 2e-5 off this family's
    # one-process fp32 gradients (its fp32 rounding, amplified; max-length mode gives the
    # very same numbers as plain SP there)
    ("gemma4_text", GEMMA4, False), ("gemma3n_text", GEMMA3N, True)])
def test_other_decoders(dist1, dist2, family, overrides, two_ranks):
    runs, layers = dist1.run(tiled_layer_runs, family, **overrides)[0]
    assert runs == layers, f"{runs} of {layers} layers ran max-length mode's forward"
    _assert(dist1.run(check_max_length, family, "local", GENERIC[:3], overrides=overrides))
    if two_ranks:
        _assert(dist2.run(check_max_length, family, "zigzag_ring_attn", GENERIC[:2],
                          overrides=overrides))


# Qwen3-Next's attention layers: a gate from the input applied after attention
QWEN3_NEXT_ATTENTION = dict(layer_types=["full_attention", "full_attention"])


def test_generic_backward_in_tiles(dist1, dist2):
    """The generic path's backward runs in sequence tiles split at the attention call
    (memory/tiled_backward.py) where its check passes: a sandwich-norm layer (Gemma 3), a
    parallel attention + MLP block on one normed input (Falcon), a gate computed before
    attention and applied after it (Qwen3-Next), attention sinks (GPT-OSS: their gradient flows
    through pass 2's chunk calls), packed documents (the document ids cut with the tiles);
    exact at 1 and 2 ranks. A layer that mixes tokens outside its attention fails the check
    and keeps the whole backward, still exact."""
    cases = [(dist1, "local", "falcon", FALCON, "auto", False),
             (dist1, "local", "gpt_oss", {}, "generic", False),  # sinks: s_aux cut per chunk
             (dist1, "local", "qwen3_next", QWEN3_NEXT_ATTENTION, "generic", False),
             (dist2, "zigzag_ring_attn", "gemma3_text", {}, "auto", False),
             (dist2, "zigzag_ring_attn", "gemma3_text", {}, "auto", True)]
    for pool, method, family, overrides, path, packed in cases:
        runs = pool.run(tiled_backward_verdicts, family, method, GENERIC[:2], path,
                        packed=packed, **overrides)
        _assert([report for report, _ in runs])
        for _, verdicts in runs:
            assert verdicts and all(v is None for v in verdicts.values()), verdicts
    report, verdicts = dist1.run(tiled_backward_verdicts, "llama", "local", GENERIC[:3],
                                 "generic", mixing=True)[0]
    _assert([report])
    assert verdicts == {"LlamaDecoderLayer": "its output differs when split at the attention "
                                             "call"}, verdicts


# Gemma 4's small models share K/V between layers (num_kv_shared_layers): the last layer of
# each type before the shared ones stores its K/V in the shared_kv_states mapping the decoder
# hands every layer, and the shared layers (no k/v projections) attend to them. Max-length mode
# makes the stored K/V outputs of the producing layer's autograd function and inputs of the
# reading layers' (generic_layer.SharedStore), so their gradient, summed over the readers,
# reaches the producer's k/v projections through its recompute (without it: 0.93 off). Here
# layers 2 and 3 read layer 0's (sliding) and layer 1's (full) K/V; tiles of 3-6 tokens
# against shards of 12 and 24, every kind of keeping, the nested recompute.
GEMMA4_SHARED = dict(GEMMA4, num_hidden_layers=4, num_kv_shared_layers=2, layer_types=[
    "sliding_attention", "full_attention", "sliding_attention", "full_attention"])
# whole heads per attention call (8 of 8): against plain SP within TOL (measured <= 2e-7)
SHARED_WHOLE_HEADS = [(5, 8, "full", 1), (3, 8, "offload", 2), (4, 8, "attention", 1),
                      (6, 8, "full", 2), (4, 8, "none", 1)]
# chunks of 1 and 2 query heads (the shared K/V cut by heads)
SHARED_CHUNKS = [(5, 1, "full", 1), (3, 2, "offload", 2), (4, 2, "attention", 1)]
# This tiny Gemma 4 turns fp32 rounding in attention into ~1e-5 in its gradients: multiplying
# its q/k projections by (1 + 1e-7 noise) moves plain SP's own gradients 1.5e-4; eager against
# sdpa attention in one process, 1.4e-4. Head chunks round attention differently: max-length
# mode with chunks of 1-2 heads is 1.5e-5 (2 ranks) to 2.2e-5 (1 rank, 2 threads) off plain
# SP, as it is on this model without shared K/V (4e-5), and plain SP itself is 7e-6 to 1.1e-5
# off one process at 1 rank and 2.1e-4 at 2 ranks. Those comparisons are held to GEMMA4_TOL.
GEMMA4_TOL = 1e-4


def _tol(case: str) -> float:
    """TOL for whole heads per attention call, GEMMA4_TOL for head chunks (see above)."""
    return TOL if " chunk=8 " in f" {case} " else GEMMA4_TOL


def _assert_against_plain(reports, plain_tol: float | None = None):
    """Max-length mode against plain SP (each case within _tol); plain SP against one process
    within ``plain_tol`` where given."""
    bad = []
    for r, rep in enumerate(reports):
        le, ge = rep.pop("plain SP vs one process")
        if plain_tol is not None and not (le <= plain_tol and ge <= plain_tol):
            bad.append(f"rank {r} plain SP vs one process: loss {le:.1e}, grads {ge:.1e}")
        bad += [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}" for case, (le, ge) in rep.items()
                if not (le <= _tol(case) and ge <= _tol(case))]
    assert not bad, "\n".join(bad)


def test_layers_sharing_kv(dist1, dist2):
    """One rank against plain SP and one process; two ranks (a ring method) against plain SP:
    whole heads with tiles, offload and the nested recompute, and chunks of one head."""
    assert dist1.run(paths_of, "gemma4_text", **GEMMA4_SHARED)[0] == ["generic"] * 4
    runs, layers = dist1.run(tiled_layer_runs, "gemma4_text", **GEMMA4_SHARED)[0]
    assert runs == layers, f"{runs} of {layers} layers ran max-length mode's forward"
    cases = [(3, 8, "offload", 2), (5, 1, "full", 1)]
    _assert_against_plain(dist1.run(check_against_plain, "gemma4_text", "local", cases,
                                    overrides=GEMMA4_SHARED), plain_tol=GEMMA4_TOL)
    _assert_against_plain(dist2.run(check_against_plain, "gemma4_text", "zigzag_ring_attn", cases,
                                    overrides=GEMMA4_SHARED))
    reports = dist1.run(check_max_length, "gemma4_text", "local", cases, overrides=GEMMA4_SHARED)
    bad = [f"{case}: {le:.1e} {ge:.1e}" for rep in reports for case, (le, ge) in rep.items()
           if not (le <= GEMMA4_TOL and ge <= GEMMA4_TOL)]
    assert not bad, bad


@pytest.mark.parametrize("method", ["local", "zigzag_ring_attn", "ulysses_attn"])
def test_layers_sharing_kv_every_kind(dist1, dist2, method):
    """Every kind of keeping, whole heads and chunks of 1-2 heads, against plain SP; Ulysses
    (the shared K/V cut by heads over the ranks) included."""
    pool = dist1 if method == "local" else dist2
    cases = SHARED_WHOLE_HEADS + SHARED_CHUNKS
    if method == "ulysses_attn":
        cases = [(4, 8, "attention", 1), (3, 8, "offload", 2), (5, 4, "offload", 2),
                 (4, 2, "attention", 1)]
    _assert_against_plain(pool.run(check_against_plain, "gemma4_text", method, cases,
                                   overrides=GEMMA4_SHARED))


# Dory: its head scales each vocabulary entry's logit by a learned factor (DoryLMHead's
# logit_scale, drawn here: maxlen_cases._drawn_logit_scale), which the chunked loss folds into
# the projection; L2 norms between its input, recurrent and output sections (so a layer's
# input is not the previous layer's output), and its recurrent section run twice.
DORY = dict(n_input_layers=1, n_output_layers=1, pad_token_id=0)  # no recurrent layer
DORY_LOOPS = dict(DORY, num_hidden_layers=3)  # layer 1 recurrent: runs twice per forward


@pytest.mark.parametrize("overrides", [DORY, DORY_LOOPS], ids=["sections", "loops"])
def test_dory(dist1, dist2, overrides):
    cases = [(5, 1, "full", 1), (4, 2, "attention", 1)]
    _assert(dist1.run(check_max_length, "dory", "local", cases, overrides=overrides))
    _assert(dist2.run(check_max_length, "dory", "zigzag_ring_attn", cases[:1],
                      overrides=overrides))
    # the nested recompute would run layer 0 to regenerate layer 1's input (the decoder
    # norms it in between), and offload keeps one input per layer (layer 1 runs twice)
    nested = dist1.run(max_length_step_error, "dory", "local", (6, 2, "full", 2), **overrides)[0]
    assert "on another input than that layer's output" in nested and "--keep-every 1" in nested
    if overrides is DORY_LOOPS:
        twice = dist1.run(max_length_step_error, "dory", "local", (3, 2, "offload", 1),
                          **overrides)[0]
        assert "runs after layer 1" in twice and "more than once" in twice


# HRM: two stacks of 2 layers (L and H), run in turns: per H cycle 2 L cycles (the first
# without grad: its one-step gradient trick) and then the H stack, twice; each layer runs
# 6 times per forward, 4 of them with grad, each call's input kept.
HRM = dict(num_hidden_layers=12, num_layers_per_stack=2, H_cycles=2, L_cycles=2,
           L_bp_cycles=[1], pad_token_id=0)


def test_hrm_layers_run_several_times(dist1, dist2):
    assert dist1.run(paths_of, "hrm_text", **HRM)[0] == ["generic"] * 4
    cases = [(5, 1, "full", 1), (4, 2, "attention", 1)]
    _assert(dist1.run(check_max_length, "hrm_text", "local", cases, overrides=HRM))
    _assert(dist2.run(check_max_length, "hrm_text", "zigzag_ring_attn", cases[:1],
                      overrides=HRM))
    for case in [(3, 2, "offload", 1), (6, 2, "full", 2)]:  # one kept input per layer
        err = dist1.run(max_length_step_error, "hrm_text", "local", case, **HRM)[0]
        assert "layer 0 (HrmTextDecoderLayer) runs after layer 1" in err, err


def test_final_norm_folded_once(dist1):
    """A decoder that runs its layers again after normalising the last layer's output (Dory
    with its input and output sections both all of its layers) is refused: the fold would
    hand the un-normed states to the layers that follow."""
    err = dist1.run(max_length_step_error, "dory", "local", (5, 2, "full", 1),
                    n_input_layers=2, n_output_layers=2, pad_token_id=0)[0]
    assert "runs its last layer and its final norm more than once" in err


def test_generic_path_ulysses(dist2):
    _assert(dist2.run(check_max_length, "gemma3_text", "ulysses_attn", [(4, 2, "attention", 1),
                                                                       (5, 4, "offload", 2)]))


@pytest.mark.parametrize("family,overrides", [("phi3", PHI3), ("opt", OPT)])
def test_generic_path_tiles_and_chunks(dist1, family, overrides):
    """The model's modules really get tiles and head chunks: 24 tokens in tiles of 5, one
    query head of 8 per attention call (forward and the recompute in backward); OPT's inline
    fc1 gets (B, 5, H) tiles of its flattened (B * S, H) input."""
    seen = dist1.run(generic_calls, family, 5, 1, **overrides)[0]
    assert seen["heads"] and set(seen["heads"]) == {1}
    # 3: the tiled backward's check of the layer (memory/tiled_backward.py) on 8 tokens
    assert set(seen["tokens"]) == {5, 4, 3}, seen["tokens"]


class _Mixing(nn.Module):
    """An MLP that is not per token (a running sum along the sequence)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).cumsum(1)


def test_generic_path_refuses_mlp_across_tokens():
    layer = nn.Module()
    layer.mlp = _Mixing()
    assert "not per token" in mlp_mismatch(layer)
    layer.mlp.forward = lambda x: layer.mlp.proj(x)  # per token: accepted
    assert mlp_mismatch(layer) is None


class _Indexed(nn.Module):
    """An MLP that takes more than the hidden states (as Zamba2's shared MLP takes the
    layer's index) and fails without it."""

    def __init__(self, name: str):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.forward = {"layer_idx": self.by_layer_idx, "other": self.by_other,
                        "optional": self.optional}[name]

    def by_layer_idx(self, x, layer_idx=None):
        return self.proj(x) * {3: 2.0}[layer_idx]

    def by_other(self, x, other=None):
        return self.proj(x) * {3: 2.0}[other]

    def optional(self, x, layer_idx=None):  # Moshi's: a layer_idx its layer does not give
        if layer_idx is not None:
            raise TypeError("Linear.forward() takes 2 positional arguments but 3 were given")
        return self.proj(x)


def test_generic_path_probes_an_mlp_with_the_layer_index():
    # an MLP taking the layer's index (transformers' name, layer_idx) is probed with it ...
    layer = nn.Module()
    layer.mlp = _Indexed("layer_idx")
    assert mlp_mismatch(layer, index=3) is None
    # ... an argument the probe cannot give: refused (not run unverified)
    assert "could not check" in mlp_mismatch(layer)
    layer.mlp = _Indexed("other")
    assert "could not check" in mlp_mismatch(layer, index=3)
    # an MLP that takes layer_idx but runs on the hidden states alone is probed on those
    layer.mlp = _Indexed("optional")
    assert mlp_mismatch(layer, index=3) is None


class _InlineLayer(nn.Module):
    """A layer with an inline feed-forward (fc1, activation_fn, fc2 children); ``between``:
    what its forward does between the activation and fc2."""

    def __init__(self, between=lambda h: h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.activation_fn = nn.GELU()
        self.between = between

    def forward(self, x):
        return x + self.fc2(self.between(self.activation_fn(self.fc1(x))))


def test_generic_path_refuses_inexact_inline_feed_forward():
    # fc2(act(fc1(x))) with nothing between: the tiled swap is exact
    assert mlp_mismatch(_InlineLayer()) is None
    # something between the activation and fc2 (here a scaling) would be applied to the
    # layer's input instead once fc1 and the activation return theirs: refused
    reason = mlp_mismatch(_InlineLayer(lambda h: 2 * h))
    assert reason and "inline fc1 -> activation_fn -> fc2" in reason, reason
    # BioGPT's activation dropout (between the activation and fc2) is refused up front
    model = tiny("biogpt", **{**BIOGPT, "activation_dropout": 0.1})
    assert "activation_dropout" in path_for(decoder_layers(model)[0], model)


@pytest.mark.parametrize("chunk,groups", [(8, 1), (2, 4)])
def test_fused_layer_projects_no_more_than_exactness_needs(dist1, chunk, groups):
    """Llama, 24 tokens in 4 tiles of 6. q and v are projected (per group, tile by tile) in
    forward and in backward's recompute of the attention, and once more in backward for every
    group but the last (whose q, k, v the recompute hands on): not again to differentiate
    the projections, which are linear. The input norm runs with grad once per tile, on the
    gradient summed over the groups (it was once per group and tile)."""
    tiles = 4
    seen = dist1.run(fused_layer_work, "llama", 6, chunk)[0]
    passes = 2 * groups + (groups - 1)  # it was 4 * groups
    assert seen["q"] == seen["v"] == passes * tiles, seen
    assert seen["norm1 with grad"] == tiles, seen
