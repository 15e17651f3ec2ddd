"""The test helper itself: results in rank order, and a failing rank's traceback."""

import pytest
import torch
import torch.distributed as dist

from easy_context.testing import DistError


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank1_fails():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits on a peer that never comes


def test_results_in_rank_order(dist2):
    assert dist2.run(_sum_of_ranks) == [(0, 1.0), (1, 1.0)]


def test_failing_rank_reports_traceback_and_pool_recovers(dist2):
    with pytest.raises(DistError, match="boom on rank one"):
        dist2.run(_rank1_fails, timeout_s=30)
    assert dist2.run(_sum_of_ranks) == [(0, 1.0), (1, 1.0)]
