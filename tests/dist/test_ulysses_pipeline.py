"""Ulysses in stages of heads (parallel/ulysses.py): exact for every stage count, and the
schedule really overlaps (stage c + 1's exchange is posted before stage c is attended, and
the gradients' transfers likewise in backward). Tolerances: those of test_attention_methods."""

import pytest
import torch
import torch.distributed as dist

from easy_context.parallel import ulysses

from .attention_cases import check_method
from .test_attention_methods import _assert_exact

# (batch, seq per 2N-chunk, q heads, kv heads, head dim): KV heads cut with the query heads
# (8/8, 12/4), replicated to one a rank (8/2 on 4 ranks, 8/1), batch 2 (receives unpacked)
CASES = [(shape, causal, dtype) for shape in [(1, 3, 8, 8, 16), (1, 3, 12, 4, 16),
                                               (2, 3, 8, 2, 16), (1, 3, 8, 1, 16)]
         for causal in (True, False) for dtype in (torch.float32, torch.bfloat16)]


def _with_stages(stages, method, ring_degree):
    saved, least = dict(ulysses.STAGES), ulysses.STAGE_MIN_BYTES
    ulysses.STAGES["cpu"], ulysses.STAGE_MIN_BYTES = stages, 1  # tiny tensors: stage them all
    try:
        return check_method(method, ring_degree, CASES)
    finally:
        ulysses.STAGES.update(saved)
        ulysses.STAGE_MIN_BYTES = least


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_exact_2_ranks(dist2, stages):
    _assert_exact(dist2.run(_with_stages, stages, "ulysses_attn", None))


@pytest.mark.parametrize("stages,method,ring_degree", [(2, "ulysses_attn", None),
                                                       (4, "ulysses_attn", None),
                                                       (2, "usp_attn", 2)])
def test_stages_exact_4_ranks(dist4, stages, method, ring_degree):
    _assert_exact(dist4.run(_with_stages, stages, method, ring_degree))


def test_stage_counts():
    # (local q heads, local KV heads, most) -> stages
    assert ulysses.pipeline_stages(4, 4, 2) == 2
    assert ulysses.pipeline_stages(4, 1, 4) == 4  # one KV head: every stage shares it
    assert ulysses.pipeline_stages(6, 3, 2) == 1  # 3 KV heads cannot be cut in 2
    assert ulysses.pipeline_stages(6, 3, 4) == 3
    assert ulysses.pipeline_stages(1, 1, 4) == 1
    assert ulysses.pipeline_stages(4, 2, 8) == 2


def _default_stages(shape, dtype):
    """The stages ulysses_apply picks by default for q of ``shape`` on this rank's CPU."""
    got = []
    q, k, v = (torch.zeros(shape, dtype=dtype) for _ in range(3))
    real = ulysses._Pipeline.__init__

    def record(self, group, world, reps, stages, splits):
        got.append(stages)
        real(self, group, world, reps, stages, splits)

    ulysses._Pipeline.__init__ = record
    try:
        ulysses.ulysses_apply(q, k, v, dist.group.WORLD, lambda qh, kh, vh, d, s: qh)
    finally:
        ulysses._Pipeline.__init__ = real
    return got[0]


def test_default_stages_follow_the_size(dist2):
    # 8 heads of 64 on 2 ranks, bf16: a rank's 4 heads of the whole sequence are 2 MiB at 4K
    # tokens (one stage), 4 MiB at 8K (two), 8 MiB at 16K (four: one KV head each)
    for length, stages in ((4096, 1), (8192, 2), (16384, 4), (65536, 4)):
        got = dist2.run(_default_stages, (1, length // 2, 8, 64), torch.bfloat16)
        assert got == [stages, stages], (length, got)


def _schedule(stages: int):
    """The order of posts, waits and attention calls of one forward + backward."""
    events = []
    real_start, real_wait = ulysses.Exchange.start, ulysses._Pending.wait

    def start(self):
        events.append("post")
        return real_start(self)

    def wait(self):
        events.append("wait")
        return real_wait(self)

    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            events.append("attend")
            return q * 1.0

        @staticmethod
        def backward(ctx, g):
            events.append("attend-back")
            return g, None, None

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 4, 8, requires_grad=True) for _ in range(3))
    ulysses.Exchange.start, ulysses._Pending.wait = start, wait
    try:
        out = ulysses.ulysses_apply(q, k, v, dist.group.WORLD,
                                    lambda qh, kh, vh, docs, sk: Inner.apply(qh, kh, vh),
                                    stages=stages)
        forward = events[:]
        events.clear()
        out.backward(torch.ones_like(out))
    finally:
        ulysses.Exchange.start, ulysses._Pending.wait = real_start, real_wait
    return forward, events[:], bool(torch.equal(q.grad, torch.ones_like(q)))


def _compress(events):
    return " ".join(events)


def test_exchange_overlaps_attention(dist2):
    forward, backward, grad_ok = dist2.run(_schedule, 2)[0]
    # forward: q, k, v of both stages posted, stage 0 waited, attended, its output posted
    # while stage 1 is waited and attended, then both outputs waited
    assert _compress(forward) == ("post post post post post post wait wait wait attend post "
                                  "wait wait wait attend post wait wait"), forward
    # backward: both stages' output gradients posted, the last stage's waited and attended
    # back, its q, k, v gradients posted before the first stage's output gradient is waited
    assert _compress(backward) == ("post post wait attend-back post post post wait "
                                   "attend-back post post post wait wait wait wait wait "
                                   "wait"), backward
    assert grad_ok  # the identity attention hands back the output's gradient exactly


def _under_anomaly_detection():
    # anomaly mode reads every gradient a node returns: no unfilled placeholder may pass
    with torch.autograd.detect_anomaly(check_nan=True):
        return check_method("ulysses_attn", None, [((1, 3, 8, 8, 16), True, torch.float32)])


def test_anomaly_mode(dist2):
    _assert_exact(dist2.run(_under_anomaly_detection))
