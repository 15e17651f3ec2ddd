"""Every method computes sliding windows, chunks, soft-capping, sinks and MLA head dims
exactly, forward and backward, on 2 and 4 gloo ranks (fp32).

Tolerance: 1e-5 relative to the float64 ground truth's max |value| for the output and every
gradient (dq, dk, dv, and the sinks' gradient summed over ranks); measured worst: see the
issue-24 note (about 1e-6: float32 rounding of the merged lse).
"""

import pytest

from easy_context import METHODS

from .variant_cases import check_variants

TOL = 1e-5
SETUPS = ([(2, m, None) for m in sorted(METHODS) if m != "usp_attn"] + [(2, "usp_attn", 1)]
          + [(4, m, None) for m in sorted(METHODS) if m != "usp_attn"]
          + [(4, "usp_attn", 2)])


@pytest.mark.parametrize("world,method,ring_degree", SETUPS)
def test_variants_exact(dist2, dist4, world, method, ring_degree):
    pool = dist2 if world == 2 else dist4
    bad = [f"rank {r} {case} {name}: {err:.1e}"
           for r, report in enumerate(pool.run(check_variants, method, ring_degree))
           for case, errors in report.items() for name, err in errors.items() if err > TOL]
    assert not bad, "\n".join(bad)
