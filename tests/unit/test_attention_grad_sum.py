"""accumulate.GradSum: summing partial gradients in the output buffer, bitwise like float32."""

import pytest
import torch

from easy_context.parallel.accumulate import GradSum, max_cover, span


def _float32_sum(shape, parts, dtype):
    acc = torch.zeros(shape, dtype=torch.float32)
    for part, rows in parts:
        acc[:, rows] += part
    return acc.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_terms", [1, 2, 3, 4, 5])
def test_grad_sum_matches_float32_accumulator(dtype, n_terms):
    gen = torch.Generator().manual_seed(n_terms)
    length = 3000  # not a multiple of the chunk size
    full = torch.empty(2, length, 4, 8, dtype=dtype)
    dst = full[:, :, 1:2]  # a strided view, like one head group of a gradient
    row_sets = [slice(None), slice(0, 1500), slice(700, None), slice(None), slice(1500, 2999)]
    parts = []
    for rows in row_sets[:n_terms]:
        n = len(range(length)[rows])
        scale = 10.0 ** torch.randint(-3, 3, (1,), generator=gen).item()
        parts.append(((torch.randn(2, n, 1, 8, generator=gen) * scale).to(dtype), rows))
    terms = max_cover(span(rows, length) for _, rows in parts)
    acc = GradSum(dst, terms)
    for part, rows in parts:
        acc.add(part, rows)
    acc.finish()
    assert torch.equal(dst, _float32_sum(dst.shape, parts, dtype))


def test_max_cover():
    assert max_cover([]) == 0
    assert max_cover([(0, 4), (4, 8)]) == 1
    assert max_cover([(0, 4), (2, 8), (3, 5), (5, 5)]) == 3
    assert span(slice(None), 10) == (0, 10) and span(slice(5, None), 10) == (5, 10)
