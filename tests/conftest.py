"""Shared fixtures. Distributed tests reuse one pool of gloo ranks per world size."""

import pytest

from easy_context.testing import DistPool

_POOLS: dict[int, DistPool] = {}


def _pool(world_size: int) -> DistPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size, threads_per_rank=1, timeout_s=180)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def dist1() -> DistPool:
    """One gloo rank in its own process (keeps the test process free of a process group)."""
    return _pool(1)


@pytest.fixture(scope="session")
def dist2() -> DistPool:
    """Two gloo ranks, started on first use and kept for the session."""
    return _pool(2)


@pytest.fixture(scope="session")
def dist4() -> DistPool:
    """Four gloo ranks, started on first use and kept for the session."""
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
