"""Multi-head latent attention sends its latent under all-gather attention, exactly.

A tiny DeepSeek-V3 (query LoRA, MoE; at 2 ranks also with biases, interleaved RoPE and YaRN's
softmax scale) and DeepSeek-V2 (q_proj, its complex RoPE) trained with allgather_attn on 1, 2
and 4 gloo ranks: the loss within 1e-5 relative of one process (fp32,
eager attention), and every parameter's gradient (kv_b_proj, kv_a_layernorm and
kv_a_proj_with_mqa included), summed over ranks, within 1e-5 relative of its max |grad|.
The collectives of all-gather attention are counted: the latent path's only (nothing of the
expanded path), and as many bytes as the planner says; the other methods and max-length
mode's head chunks move the expanded K/V.
"""

import pytest

from .latent_cases import bytes_against_plan, check_hybrid_latent, check_mla, max_length_fallback

TOL = 1e-5


def _assert_exact(reports, latent: bool):
    for r in reports:
        assert r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["parts"], "the reference gives an MLA part no gradient"
        sent = r["sent"]
        if latent:
            assert sent["latent"][1] > 0 and sent["expanded"] == [0, 0], sent
        else:
            assert sent["latent"] == [0, 0], sent


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "deepseek_v3_yarn"])
def test_latent_exact_2_ranks(dist2, family):
    _assert_exact(dist2.run(check_mla, family), latent=True)


def test_latent_exact_packed_documents(dist2):
    _assert_exact(dist2.run(check_mla, "deepseek_v3", "allgather_attn", True), latent=True)


def test_latent_exact_with_lora(dist2):
    """LoRA adapters on kv_b_proj (and every other linear layer): the up-projection each rank
    runs on the gathered latent is the adapted one, and its adapters' gradients come back."""
    _assert_exact(dist2.run(check_mla, "deepseek_v3", "allgather_attn", False, True),
                  latent=True)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_latent_exact_4_ranks(dist4, family):
    _assert_exact(dist4.run(check_mla, family), latent=True)


def test_one_rank_sends_nothing(dist1):
    _assert_exact(dist1.run(check_mla, "deepseek_v3"), latent=False)


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_other_methods_move_expanded_kv(dist2, method):
    """Rings and Ulysses cannot take the up-projection's gradient back through a relayed or
    head-split latent (parallel/latent.py): they stay on the expanded K/V, exact."""
    _assert_exact(dist2.run(check_mla, "deepseek_v3", method), latent=False)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_are_the_planned_latent_bytes(dist2, dist4, world):
    """What a step's collectives send from each rank equals the planner's communication for
    all-gather attention on this MLA shape: the latent (r + rope values a token, gathered
    once, float32 gradient reduce-scattered), far less than the expanded K/V."""
    for r in (dist2 if world == 2 else dist4).run(bytes_against_plan):
        assert r["sent"]["expanded"] == [0, 0], r
        assert r["sent"]["latent"][0] == r["planned"], r
        assert r["planned"] < r["planned_expanded"] / 3, r


def test_max_length_head_chunks_take_the_expanded_path(dist2):
    """Max-length mode's head chunks hold a few heads' K/V at a time, which expanding the
    whole latent would not: the layer moves its expanded K/V there, exactly."""
    for r in dist2.run(max_length_fallback):
        for case, (loss_err, grad_err) in r["errors"].items():
            assert loss_err <= TOL and grad_err <= TOL, (case, loss_err, grad_err)
        assert r["sent"]["latent"] == [0, 0] and r["sent"]["expanded"][1] > 0, r["sent"]


def test_hybrid_mla_layers_send_their_latent(dist2):
    """Kimi Linear: MLA layers without RoPE between KDA layers, against float64 in one
    process (as tests/dist/test_hf_recurrent.py)."""
    for r in dist2.run(check_hybrid_latent):
        for method, (loss_err, grad_err) in r["errors"].items():
            assert loss_err <= TOL and grad_err <= TOL, (method, loss_err, grad_err)
        assert r["sent"]["latent"][1] > 0 and r["sent"]["expanded"] == [0, 0], r["sent"]
