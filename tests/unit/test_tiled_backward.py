"""Pieces of the generic layer's split at its attention call (easy_context/memory/
tiled_backward.py): q, k, v gathered tile by tile with the attention's calls re-bound to the
whole sequence's arguments; the forward in that split; pass 2 writing each head chunk's
gradients over that chunk's q, k, v."""

import functools

import pytest
import torch

from easy_context.attention.saving import run_saved
from easy_context.memory import tiled_backward as tb


def _causal_in_documents(q, k, v, documents):
    """q (B, H, S, D), k/v (B, H, S, D), documents (B, S) -> (B, S, H, D): causal attention
    within each document."""
    s = q.size(2)
    same = documents[:, :, None] == documents[:, None, :]
    allowed = same & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


class _Layer:
    """A layer as the generic path calls it: per-token projections, an attention call handed
    to tiled_backward.INTERCEPT when set (as generic_layer.chunked_attention does), a
    per-token tail; ``document_ids`` handed on to the attention call, as transformers hands
    its layers' keyword arguments on."""

    def __init__(self, hidden=6, heads=2, d=3):
        g = torch.Generator().manual_seed(0)
        self.heads, self.d = heads, d
        self.wq, self.wk, self.wv = (
            torch.randn(hidden, heads * d, generator=g, dtype=torch.float64) for _ in range(3))
        self.wo = torch.randn(heads * d, hidden, generator=g, dtype=torch.float64)

    def __call__(self, x, rows=None, length=None, document_ids=None):
        kwargs = {"document_ids": document_ids}
        if rows is not None:
            kwargs = tb.cut_rows(kwargs, rows, length)
        b, s, _ = x.shape
        q, k, v = ((x.tanh() @ w).view(b, s, self.heads, self.d).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))

        def call(q, k, v, **kw):
            return _causal_in_documents(q, k, v, kw["document_ids"]), None

        calls = [(slice(h, h + 1), slice(h, h + 1), functools.partial(call, **kwargs))
                 for h in range(self.heads)]
        intercept = tb.INTERCEPT.get()
        if intercept is not None:
            out = intercept(q, k, v, calls)
        else:
            out = torch.cat([run(q[:, qs], k[:, ks], v[:, ks])[0] for qs, ks, run in calls], 2)
        return x + out.reshape(b, s, -1) @ self.wo * 0.5


def test_split_forward_is_the_whole_forward_with_the_whole_documents():
    """Tiles of 3 against 10 tokens in 3 documents: the output is the whole forward's, so the
    attention got every token's q, k, v and the whole sequence's document ids, not the last
    tile's."""
    layer = _Layer()
    x = torch.randn(2, 10, 6, dtype=torch.float64)
    documents = torch.tensor([[0] * 4 + [1] * 3 + [2] * 3, [0] * 7 + [1] * 3])
    want = layer(x, document_ids=documents)

    def call(xs, rows, **override):
        return layer(xs, rows, 10, document_ids=documents)

    got = tb.split_forward(call, x, {}, 3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    q, k, v, calls = tb.gather(call, x, {}, 3)
    assert q.shape == (2, 2, 10, 3) and q.is_contiguous()
    assert all(run.keywords["document_ids"] is documents for _, _, run in calls)


def test_whole_calls_refuse_a_per_token_argument_they_cannot_rebuild():
    """A tensor of the tile's length that cut_rows did not cut (a tile's mask) has no whole
    version: Unfit, so the layer keeps the whole-sequence path; a 1-D tensor of that length
    (one value per head: sinks) is not per token and stays."""
    sinks, mask = torch.zeros(3), torch.zeros(1, 1, 3, 3)
    kept = tb._whole_calls([(slice(0, 1), slice(0, 1), functools.partial(max, s_aux=sinks))],
                           {}, 3, 12)
    assert kept[0][2].keywords["s_aux"] is sinks
    with pytest.raises(tb.Unfit, match="per-token argument"):
        tb._whole_calls([(slice(0, 1), slice(0, 1), functools.partial(max, mask))], {}, 3, 12)


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

    ptrs = [t.untyped_storage().data_ptr() for t in (q, k, v)]
    dq, dk, dv_, dparams = differentiate(q, k, v, douts, [])
    assert [t.untyped_storage().data_ptr() for t in (dq, dk, dv_)] == ptrs and dparams == []
    for got, w in zip((dq, dk, dv_), want):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
    assert all(o is None for o in douts)
