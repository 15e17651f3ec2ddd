"""The tiled backward's attention pass (easy_context/memory/tiled_backward.py) writes each head
chunk's gradients over that chunk's q, k, v, so backward never holds both: the tensors it
writes into are its own (``_owned``), and the gradients are those of one autograd pass."""

import torch

from easy_context.attention.saving import run_saved
from easy_context.memory import tiled_backward as tb


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_owned_copies_what_it_may_not_write_into():
    b, s, h, d = 1, 6, 4, 8
    x = torch.randn(b, s, h * d)
    alone = torch.randn(b, h, s, d)  # (B, H, S, D) contiguous, nothing else in its storage
    heads_last = torch.randn(b, s, h, d).transpose(1, 2)  # the layout transformers makes
    qkv = torch.randn(b, s, 3, h, d)  # one fused projection: three views of one buffer
    views = [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    of_x = x.view(b, s, h, d).transpose(1, 2)  # a view of the layer input
    part = torch.randn(b, s, h, 2 * d)[..., :d].transpose(1, 2)  # MLA's v: part of a buffer
    wide = torch.randn(b, 1, s, d).expand(b, h, s, d)  # one K/V head broadcast

    kept = tb._owned([alone, heads_last], [x])
    assert kept[0] is alone and kept[1] is heads_last
    for got, was in zip(tb._owned([*views, of_x, part, wide], [x]),
                        [*views, of_x, part, wide]):
        assert got is not was and torch.equal(got, was)
        assert _storage(got) not in {_storage(x), _storage(qkv)}
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


class _Eager(torch.autograd.Function):
    """Causal attention of one head chunk whose forward goes through attention.saving (as the
    methods' do), so that a replay hands back the recorded output."""

    @staticmethod
    def forward(ctx, q, k, v):  # (B, hc, S, D), (B, 1, S, D), (B, 1, S, Dv)
        ctx.save_for_backward(q, k, v)
        return run_saved(lambda: (_eager(q, k, v),))[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            return torch.autograd.grad(_eager(q, k, v), (q, k, v), dout)


def _eager(q, k, v):
    s = q.size(2)
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, S, hc, Dv)


def test_chunk_gradients_overwrite_q_k_v():
    """Chunks of one query head, three per KV head (a KV head's gradient is written after the
    last of its query heads): the gradients are those of one autograd pass over all heads,
    returned in q, k, v's own storage; each chunk's d(out) is let go once used."""
    torch.manual_seed(0)
    b, s, hkv, r, d, dv = 2, 7, 2, 3, 8, 4
    q = torch.randn(b, hkv * r, s, d, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, dtype=torch.float64)
    v = torch.randn(b, hkv, s, dv, dtype=torch.float64)
    calls = [(slice(i, i + 1), slice(i // r, i // r + 1), lambda *qkv: (_Eager.apply(*qkv), None))
             for i in range(hkv * r)]
    record: list = []
    attention, differentiate = tb.chunked(record, replay=False)
    outs = attention(q, k, v, calls)
    assert len(record) == len(calls)
    douts = [torch.randn_like(o) for o in outs]

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    whole = torch.cat([_Eager.apply(leaves[0][:, qs], leaves[1][:, ks], leaves[2][:, ks])
                       for qs, ks, _ in calls], dim=2)
    want = torch.autograd.grad(whole, leaves, torch.cat(douts, dim=2))

    ptrs = [_storage(t) for t in (q, k, v)]
    dq, dk, dv_, dparams = differentiate(q, k, v, douts, [])
    assert [_storage(t) for t in (dq, dk, dv_)] == ptrs and dparams == []
    for got, w in zip((dq, dk, dv_), want):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
    assert all(o is None for o in douts)
