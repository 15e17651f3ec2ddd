"""Packed documents: no token attends across a document boundary, on 2 and 4 ranks (fp32).

Tolerance: output and gradients within 1e-5 of float64 attention run on each document
separately (relative to the reference's max |value|).
"""

import pytest
import torch

import easy_context as ec
from easy_context.parallel.local import local_attention
from easy_context.attention.documents import document_ids_from_positions

from .attention_cases import check_documents

DOC_METHODS = sorted(name for name, m in ec.METHODS.items() if m.documents)
# (method, ring_degree) per world size: usp with every ring degree that splits the ranks
CASES = {world: [(m, None) for m in DOC_METHODS if m != "usp_attn"]
         + [("usp_attn", r) for r in ((1, 2) if world == 2 else (1, 2, 4))] for world in (2, 4)}


def _assert_small(reports, tol=1e-5):
    bad = [f"rank {r} {case} {name}: {err:.2e}" for r, rep in enumerate(reports)
           for case, errs in rep.items() for name, err in errs.items() if not err <= tol]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("method,ring_degree", CASES[2])
def test_documents_2_ranks(dist2, method, ring_degree):
    _assert_small(dist2.run(check_documents, method, ring_degree))


@pytest.mark.parametrize("method,ring_degree", CASES[4])
def test_documents_4_ranks(dist4, method, ring_degree):
    _assert_small(dist4.run(check_documents, method, ring_degree))


def test_document_ids_from_restarting_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 3, 7, 9, 12, 20, 21, 22]])
    assert document_ids_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]


def test_methods_without_document_support_say_so():
    unsupported = sorted(set(ec.METHODS) - set(DOC_METHODS))
    q = torch.randn(1, 8, 2, 16)
    for method in unsupported:
        with pytest.raises(ValueError, match="does not support packed documents"):
            ec.sequence_parallel_attention(q, q, q, method, document_ids=torch.zeros(1, 8, dtype=torch.long))


def test_single_process_documents_match_separate_runs():
    q, k, v = torch.randn(3, 1, 10, 2, 16).unbind(0)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2]])
    out = local_attention(q, k, v, causal=True, document_ids=doc)
    parts = [local_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True) for a, b in ((0, 4), (4, 6), (6, 10))]
    torch.testing.assert_close(out, torch.cat(parts, dim=1), rtol=1e-5, atol=1e-6)
