"""Sequence-parallel training of Hugging Face model families equals one process (fp32).

For every family and method on 2 gloo ranks, and on 4 for Llama and the attention
variants (MLA, soft-capping, sinks, chunks): the loss (exact global token mean, with
uneven numbers of valid targets per rank) within 1e-5 relative of the single-process loss,
and every parameter's gradient, summed over ranks, within 1e-5 relative (to that parameter's
max |grad|) of the single-process gradient. Both the chunked loss and the logits path.
"""

import pytest

import easy_context as ec

from .hf_cases import (FAMILIES, VARIANT_FAMILIES, check_family, check_packed_documents,
                       tiny_model)

TOL = 1e-5
METHODS = sorted(ec.METHODS)


def _assert(reports):
    bad = [f"rank {r} {case}: loss {le:.1e}, grads {ge:.1e}"
           for r, rep in enumerate(reports) for case, (le, ge) in rep.items()
           if not (le <= TOL and ge <= TOL)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_2_ranks(dist2, family):
    _assert(dist2.run(check_family, family, METHODS))


def test_family_4_ranks(dist4):
    """Every method at 4 ranks on Llama (the rank count reaches the attention, not the
    family's other layers: Qwen3's q/k norms and the others, every method at 2 ranks above;
    the attention variants at 4 ranks below)."""
    _assert(dist4.run(check_family, "llama", METHODS, (True,)))


@pytest.mark.parametrize("family", sorted(VARIANT_FAMILIES))
def test_attention_variant_family_2_ranks(dist2, family):
    """Sliding windows, chunks, soft-capping, sinks, MLA: against the model's own attention."""
    _assert(dist2.run(check_family, family, METHODS))


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma2", "gpt_oss", "llama4_text"])
def test_attention_variant_family_4_ranks(dist4, family):
    """MLA, soft-capping, sinks and chunks at 4 ranks (the windows of the others: 2 ranks
    here, and every window size at 4 ranks in test_attention_variants.py)."""
    _assert(dist4.run(check_family, family, METHODS, (True,)))


DOC_CASES = [(2, m, None) for m in sorted(n for n, m in ec.METHODS.items() if m.documents)
             if m != "usp_attn"] + [(2, "usp_attn", 1), (4, "usp_attn", 2), (4, "ulysses_attn", None)]


@pytest.mark.parametrize("world,method,ring_degree", DOC_CASES)
def test_packed_documents_equal_separate_documents(dist2, dist4, world, method, ring_degree):
    pool = dist2 if world == 2 else dist4
    for rank, (loss_err, grad_err) in enumerate(pool.run(check_packed_documents, "llama", method,
                                                         ring_degree)):
        assert loss_err <= TOL and grad_err <= TOL, (rank, loss_err, grad_err)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_variant_scalars_matter(family):
    """The variant families' scalars differ from what a dropped one would give: Gemma's
    query scale (query_pre_attn_scalar**-0.5) is not 1/sqrt(head_dim), and soft-capping
    changes the logits at the (enlarged) initial q/k scale. Otherwise a method that dropped
    either would still pass test_attention_variant_family_2_ranks."""
    import torch

    model = tiny_model(family)
    config = model.config
    layers = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")]
    assert layers and all(abs(m.scaling - config.query_pre_attn_scalar ** -0.5) < 1e-12
                          for m in layers)
    assert abs(config.query_pre_attn_scalar ** -0.5 - config.head_dim ** -0.5) > 0.05
    ids = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))

    def logits(**change):
        m = tiny_model(family, **change)
        with torch.no_grad():
            return m(input_ids=ids).logits

    base = logits()
    for change in ({"query_pre_attn_scalar": config.head_dim},
                   *([{"attn_logit_softcapping": None}]
                     if getattr(config, "attn_logit_softcapping", None) else [])):
        diff = ((logits(**change) - base).abs().max() / base.abs().max()).item()
        assert diff > 1e-3, (change, diff)
