"""KV-head groups: every block method is exact whatever the group size (1, 2 or all 4 KV
heads per pass, set through the buffer budget), on 2 and 4 ranks, fp32 and bf16 (the
tolerances of test_attention_methods)."""

import pytest
import torch

from .attention_cases import check_method
from .test_attention_methods import _assert_exact

# 8 query heads on 4 KV heads; a shard length that is not a power of two
CASES = [((1, 5, 8, 4, 32), causal, dtype) for causal in (True, False)
         for dtype in (torch.float32, torch.bfloat16)]
METHODS = [("ring_attn", None), ("zigzag_ring_attn", None), ("dist_flash_attn", None),
           ("allgather_attn", None)]


@pytest.mark.parametrize("method,ring_degree", METHODS)
@pytest.mark.parametrize("per_group", [1, 2, 4])
def test_group_sizes_2_ranks(dist2, method, ring_degree, per_group):
    _assert_exact(dist2.run(check_method, method, ring_degree, CASES, 0, per_group))


@pytest.mark.parametrize("per_group", [1, 2])
def test_usp_ring_groups_4_ranks(dist4, per_group):
    # ring_degree 2: the ring runs on the 2 of 4 KV heads its Ulysses group holds
    _assert_exact(dist4.run(check_method, "usp_attn", 2, CASES, 0, per_group))
