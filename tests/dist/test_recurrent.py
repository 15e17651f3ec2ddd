"""Recurrent layers (gated delta rule and KDA, Mamba-2 scan, Mamba-1 selective scan, causal conv)
over sequence shards at 1, 2 and 4 ranks: output and every input's gradient within 1e-5 (fp32,
relative to the reference's max) of transformers' torch kernel run in one process on the whole
sequence (on each document separately when packed), for the contiguous, zigzag and usp layouts,
with pieces shorter than the conv kernel and than a kernel chunk, and longer than a chunk.
"""

import pytest

from .recurrent_cases import check_conv, check_delta_rule, check_mamba2, check_selective_scan

TOL = 1e-5
LAYOUTS = {2: [("contiguous", None), ("zigzag", None), ("usp", 2)],
           4: [("contiguous", None), ("zigzag", None), ("usp", 2)]}


def _assert_small(reports, tol=TOL):
    bad = [f"rank {r} {name}: {err:.2e}" for r, rep in enumerate(reports)
           for name, err in rep.items() if not err <= tol]
    assert reports and all(reports), "no case ran"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("documents", [False, True])
def test_every_kind_1_rank(dist1, documents):
    for case, args in ((check_delta_rule, (5, 4)), (check_mamba2, (5, 4)), (check_conv, (2, 4)),
                       (check_selective_scan, (5,))):
        _assert_small(dist1.run(case, "contiguous", None, *args, documents))


# (piece length, kernel chunk): shorter than a chunk; longer than one (crosses chunk edges)
@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece,chunk", [(3, 64), (21, 16)])
@pytest.mark.parametrize("documents", [False, True])
def test_delta_rule_2_ranks(dist2, layout, ring_degree, piece, chunk, documents):
    _assert_small(dist2.run(check_delta_rule, layout, ring_degree, piece, chunk, documents))


@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[4])
@pytest.mark.parametrize("documents", [False, True])
def test_delta_rule_4_ranks(dist4, layout, ring_degree, documents):
    _assert_small(dist4.run(check_delta_rule, layout, ring_degree, 5, 4, documents))


@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece,chunk", [(3, 64), (21, 16)])
@pytest.mark.parametrize("documents", [False, True])
def test_mamba2_2_ranks(dist2, layout, ring_degree, piece, chunk, documents):
    _assert_small(dist2.run(check_mamba2, layout, ring_degree, piece, chunk, documents))


@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[4])
@pytest.mark.parametrize("documents", [False, True])
def test_mamba2_4_ranks(dist4, layout, ring_degree, documents):
    _assert_small(dist4.run(check_mamba2, layout, ring_degree, 5, 4, documents))


# pieces of 1 and 2 rows: the halo (kernel 4: 3 rows) spans several pieces and ranks
@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece", [1, 2, 7])
@pytest.mark.parametrize("documents", [False, True])
def test_conv_2_ranks(dist2, layout, ring_degree, piece, documents):
    _assert_small(dist2.run(check_conv, layout, ring_degree, piece, 4, documents))


# through the stand-in with causal-conv1d's signature: each piece's halo-extended input whole
@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece", [1, 2, 7])
def test_conv_causal_conv1d_signature_2_ranks(dist2, layout, ring_degree, piece):
    _assert_small(dist2.run(check_conv, layout, ring_degree, piece, 4, False, 0, True))


@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[4])
@pytest.mark.parametrize("piece", [1, 3])
@pytest.mark.parametrize("documents", [False, True])
def test_conv_4_ranks(dist4, layout, ring_degree, piece, documents):
    _assert_small(dist4.run(check_conv, layout, ring_degree, piece, 4, documents))


# Mamba-1's selective scan (Jamba): pieces of 1 row (a one-token piece's map) and of 5; through
# the stand-in with mamba-ssm's signature too, whose last state carries no gradient
@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece", [1, 5])
@pytest.mark.parametrize("documents", [False, True])
def test_selective_scan_2_ranks(dist2, layout, ring_degree, piece, documents):
    _assert_small(dist2.run(check_selective_scan, layout, ring_degree, piece, documents))


@pytest.mark.parametrize("documents", [False, True])
def test_selective_scan_mamba_ssm_signature_2_ranks(dist2, documents):
    _assert_small(dist2.run(check_selective_scan, "zigzag", None, 3, documents, 0, True))


@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[4])
@pytest.mark.parametrize("documents", [False, True])
def test_selective_scan_4_ranks(dist4, layout, ring_degree, documents):
    _assert_small(dist4.run(check_selective_scan, layout, ring_degree, 2, documents))


# KDA (Kimi Linear): the gated delta rule's scan with a gate per key channel; pieces shorter
# than a chunk (3 < 64) and crossing chunk edges (21 > 16)
@pytest.mark.parametrize("layout,ring_degree", LAYOUTS[2])
@pytest.mark.parametrize("piece,chunk", [(3, 64), (21, 16)])
@pytest.mark.parametrize("documents", [False, True])
def test_kda_2_ranks(dist2, layout, ring_degree, piece, chunk, documents):
    _assert_small(dist2.run(check_delta_rule, layout, ring_degree, piece, chunk, documents, 0,
                            True))


@pytest.mark.parametrize("documents", [False, True])
def test_kda_4_ranks(dist4, documents):
    _assert_small(dist4.run(check_delta_rule, "zigzag", None, 5, 4, documents, 0, True))
