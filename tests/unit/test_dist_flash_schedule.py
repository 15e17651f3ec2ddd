"""DistFlashAttn's schedule as a pure function: coverage, balance and traffic, no processes."""

from collections import Counter, defaultdict

import pytest

from easy_context.parallel.dist_flash import (ALL_ROWS, FIRST_HALF, SECOND_HALF,
                                              balanced_schedule)

WORLDS = range(1, 9)
ROW_FRACTION = {ALL_ROWS: 1.0, FIRST_HALF: 0.5, SECOND_HALF: 0.5}


def _work(task, causal):
    # A causal diagonal block is a triangle: half a block's work; half rows: half a block.
    triangle = 0.5 if causal and task.q_owner == task.kv_owner else 1.0
    return triangle * ROW_FRACTION[task.rows]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", WORLDS)
def test_every_needed_pair_exactly_once(n, causal):
    parts = defaultdict(list)
    for step in balanced_schedule(n, causal):
        for task in step:
            parts[(task.q_owner, task.kv_owner)].append(task.rows)
    needed = {(a, b) for a in range(n) for b in range(n) if a >= b or not causal}
    assert set(parts) == needed
    for pair, rows in parts.items():
        # one whole block, or its two halves once each
        assert sorted(rows) in ([ALL_ROWS], sorted([FIRST_HALF, SECOND_HALF])), (pair, rows)
        assert sum(ROW_FRACTION[r] for r in rows) == 1.0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", WORLDS)
def test_balanced_every_step(n, causal):
    steps = balanced_schedule(n, causal)
    assert len(steps) == (n // 2 + 1 if causal else n)
    totals = Counter()
    for i, step in enumerate(steps):
        per_rank = Counter()
        for task in step:
            assert 0 <= task.rank < n
            assert task.rank in (task.q_owner, task.kv_owner)  # a helper always owns one side
            assert (task.q_owner == task.kv_owner) == (i == 0)  # diagonals only at step 0
            per_rank[task.rank] += _work(task, causal)
        assert len(per_rank) == n, f"N={n} step {i}: idle ranks"
        assert len(set(per_rank.values())) == 1, f"N={n} step {i}: {dict(per_rank)}"
        totals.update(per_rank)
    assert max(totals.values()) / min(totals.values()) == 1.0
    # total work is the mask's area: N^2/2 blocks causal, N^2 without a mask
    assert sum(totals.values()) == (n * n / 2 if causal else n * n)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", WORLDS)
def test_traffic_goes_to_i_plus_t(n, causal):
    """At step t rank i receives inputs only from (i - t) mod N and sends only to (i + t) mod N,
    one task's worth each; results go back the other way."""
    for t, step in enumerate(balanced_schedule(n, causal)[1:], start=1):
        received = Counter()
        for task in step:
            for owner in {task.q_owner, task.kv_owner} - {task.rank}:
                assert owner == (task.rank - t) % n, (n, t, task)
                received[task.rank] += 1
        assert all(c == 1 for c in received.values()), (n, t, received)


def test_two_ranks_split_the_off_diagonal_block():
    assert balanced_schedule(2) == [
        [(0, 0, 0, ALL_ROWS), (1, 1, 1, ALL_ROWS)],
        [(1, 1, 0, FIRST_HALF), (0, 1, 0, SECOND_HALF)],
    ]


def test_rejects_empty_world():
    with pytest.raises(ValueError):
        balanced_schedule(0)
