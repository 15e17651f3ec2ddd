"""Packed documents: no token attends across a document boundary, for every method, at 1, 2
and 4 ranks (fp32), with GQA, documents that straddle shard boundaries, different boundaries
per batch row, ids that return to earlier values, causal and not, one KV head per group and
all at once.

Tolerance: output and gradients within 1e-5 of float64 attention run on each document
separately, relative to the reference's max |value| (measured: ~3e-7).
"""

import pytest
import torch

import easy_context as ec
from easy_context.attention.documents import ShardDocuments, document_ids_from_positions
from easy_context.parallel.local import local_attention

from .attention_cases import check_documents, count_document_scans

TOL = 1e-5
METHODS = sorted(ec.METHODS)
# (method, ring_degree) per world size: usp with every ring degree that splits the ranks
CASES = {world: [(m, None) for m in METHODS if m != "usp_attn"]
         + [("usp_attn", r) for r in {1: (1,), 2: (1, 2), 4: (1, 2, 4)}[world]]
         for world in (1, 2, 4)}


def _assert_small(reports, tol=TOL):
    bad = [f"rank {r} {case} {name}: {err:.2e}" for r, rep in enumerate(reports)
           for case, errs in rep.items() for name, err in errs.items() if not err <= tol]
    assert reports and all(reports), "no case ran"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("method,ring_degree", CASES[1])
def test_documents_1_rank(dist1, method, ring_degree):
    _assert_small(dist1.run(check_documents, method, ring_degree))


@pytest.mark.parametrize("method,ring_degree", CASES[2])
def test_documents_2_ranks(dist2, method, ring_degree):
    _assert_small(dist2.run(check_documents, method, ring_degree))


@pytest.mark.parametrize("method,ring_degree", CASES[4])
def test_documents_4_ranks(dist4, method, ring_degree):
    _assert_small(dist4.run(check_documents, method, ring_degree))


def test_every_method_keeps_documents_apart():
    assert all(m.documents for m in ec.METHODS.values())


def test_document_ids_from_restarting_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 3, 7, 9, 12, 20, 21, 22]])
    assert document_ids_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]


def test_single_process_documents_match_separate_runs():
    q, k, v = torch.randn(3, 1, 10, 2, 16).unbind(0)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2]])
    out = local_attention(q, k, v, causal=True, document_ids=doc)
    parts = [local_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True) for a, b in ((0, 4), (4, 6), (6, 10))]
    torch.testing.assert_close(out, torch.cat(parts, dim=1), rtol=1e-5, atol=1e-6)


def _calls(docs, *args):
    return [(c.batch, c.q, c.kv, c.causal) for c in docs.calls(*args)]


def test_block_calls_cut_at_document_boundaries():
    # one shard, one row: documents [0, 3), [3, 7), [7, 10)
    docs = ShardDocuments.from_ids(torch.tensor([[[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]]))
    every = slice(None)
    # diagonal block: one causal square per document, nothing across them
    assert _calls(docs, 0, every, 0, every, True) == [
        (every, slice(0, 3), slice(0, 3), True), (every, slice(3, 7), slice(3, 7), True),
        (every, slice(7, 10), slice(7, 10), True)]
    # rows [4, 10) against keys [0, 5): document 1's rows see its keys 3, 4 (block-relative)
    assert _calls(docs, 0, slice(4, 10), 0, slice(0, 5), False) == [
        (every, slice(0, 3), slice(3, 5), False)]
    # no shared document: no call at all
    assert _calls(docs, 0, slice(7, 10), 0, slice(0, 3), False) == []
    # one document over the whole block: the block's own single call
    assert _calls(docs, 0, slice(3, 7), 0, slice(3, 7), True) == [(every, every, every, True)]
    assert not docs.repeated


def test_block_calls_per_row_when_rows_differ():
    docs = ShardDocuments.from_ids(torch.tensor([[[0, 0, 1, 1], [0, 0, 0, 0]]]))
    calls = _calls(docs, 0, slice(None), 0, slice(None), True)
    assert calls == [(slice(0, 1), slice(0, 2), slice(0, 2), True),
                     (slice(0, 1), slice(2, 4), slice(2, 4), True),
                     (slice(1, 2), slice(None), slice(None), True)]


def test_repeated_ids_pair_every_stretch():
    # id 5 in rows [0, 2) and [4, 6): on the diagonal the later stretch sees the earlier one
    docs = ShardDocuments.from_ids(torch.tensor([[[5, 5, 6, 6, 5, 5]]]))
    assert docs.repeated
    calls = _calls(docs, 0, slice(None), 0, slice(None), True)
    assert (slice(None), slice(4, 6), slice(0, 2), False) in calls
    assert (slice(None), slice(0, 2), slice(4, 6), False) not in calls
    assert len(calls) == 4  # three causal squares and the one full pair


def test_float_ids_are_refused():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="integers"):
        local_attention(q, q, q, document_ids=torch.zeros(1, 4))


@pytest.mark.parametrize("method,ring_degree", CASES[2])
def test_the_ids_are_scanned_once_per_micro_batch(dist2, method, ring_degree):
    """Every layer (and recompute) of a micro-batch gets the same ids tensor: one host scan
    (and all-gather) for all of them; new ids or an in-place change scan again."""
    for report in dist2.run(count_document_scans, method, ring_degree):
        assert report["per_batch"]["scans"] == 1, report
        assert report["total"]["scans"] == 4, report  # + one for the inference-mode ids
