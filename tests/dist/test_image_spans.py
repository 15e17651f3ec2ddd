"""Every method computes Gemma 3's image spans exactly (bidirectional inside each image,
causal elsewhere, windows and documents on top), forward and backward, on 2 and 4 gloo
ranks (fp32): 1e-5 relative to the float64 ground truth's max |value|, spans straddling
shard boundaries (image_span_cases.py)."""

import pytest

from easy_context import METHODS

from .image_span_cases import check_spans

TOL = 1e-5
SETUPS = ([(2, m, None) for m in sorted(METHODS) if m != "usp_attn"] + [(2, "usp_attn", 1)]
          + [(4, m, None) for m in sorted(METHODS) if m != "usp_attn"]
          + [(4, "usp_attn", 2)])


def _bad(reports) -> list[str]:
    return [f"rank {r} {case} {name}: {err:.1e}" for r, rep in enumerate(reports)
            for case, errors in rep.items() for name, err in errors.items()
            if not (err <= TOL)]


@pytest.mark.parametrize("world,method,ring_degree", SETUPS)
def test_image_spans_exact(dist2, dist4, world, method, ring_degree):
    pool = dist2 if world == 2 else dist4
    bad = _bad(pool.run(check_spans, method, ring_degree))
    assert not bad, "\n".join(bad)


def test_spans_change_the_result(dist2):
    """The cases are ones where the spans matter: without them every method is far off."""
    bad = _bad(dist2.run(check_spans, "zigzag_ring_attn", None, 6, True))
    assert len(bad) > 10, bad
