"""Sequence-parallel training of Hugging Face model families equals one process (fp32).

For every family and method, on 2 and 4 gloo ranks: the loss (exact global token mean, with
uneven numbers of valid targets per rank) within 1e-5 relative of the single-process loss,
and every parameter's gradient, summed over ranks, within 1e-5 relative (to that parameter's
max |grad|) of the single-process gradient. Both the chunked loss and the logits path.
"""

import pytest

import easy_context as ec

from .hf_cases import FAMILIES, VARIANT_FAMILIES, check_family, check_packed_documents

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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_family_4_ranks(dist4, family):
    _assert(dist4.run(check_family, family, METHODS, (True,)))


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
