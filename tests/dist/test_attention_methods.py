"""Exactness of every sequence-parallel method, forward and backward, on 2 and 4 gloo ranks.

Tolerances, relative to the reference's max |value| (float64, whole sequence):
- float32: output <= 1e-5 and gradients <= 2e-5 (measured: ~3e-7 for both).
- bfloat16: <= 2.5e-2, and no worse than 2x the error of single-process attention in bf16
  plus 4e-3 (partial results are merged in float32, so splitting must not add bf16 error).
"""

import pytest

from easy_context import METHODS

from .attention_cases import check_method

TOL_FP32 = {"out": 1e-5, "dq": 2e-5, "dk": 2e-5, "dv": 2e-5}
TOL_BF16 = 2.5e-2

RING_DEGREES = {2: [1, 2], 4: [2, 1, 4]}


def _assert_exact(reports):
    failures = []
    for rank, report in enumerate(reports):
        for case, errors in report.items():
            for name, (err, err_single) in errors.items():
                if "float32" in case:
                    ok = err <= TOL_FP32[name]
                else:
                    ok = err <= TOL_BF16 and err <= 2 * err_single + 4e-3
                if not ok:
                    failures.append(f"rank {rank} {case} {name}: error {err:.2e} (single process {err_single:.2e})")
    assert not failures, "\n".join(failures)


def _methods():
    return [m for m in sorted(METHODS) if m != "usp_attn"]


@pytest.mark.parametrize("method", _methods())
def test_method_exact_2_ranks(dist2, method):
    _assert_exact(dist2.run(check_method, method))


@pytest.mark.parametrize("method", _methods())
def test_method_exact_4_ranks(dist4, method):
    _assert_exact(dist4.run(check_method, method))


@pytest.mark.parametrize("world,ring_degree", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_usp_exact(dist2, dist4, world, ring_degree):
    pool = dist2 if world == 2 else dist4
    _assert_exact(pool.run(check_method, "usp_attn", ring_degree))
