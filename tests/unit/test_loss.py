"""Chunked linear + cross-entropy against F.cross_entropy on the full logits, one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from easy_context.memory import (
    chunked_cross_entropy,
    count_valid_targets,
    global_token_mean,
    logits_cross_entropy,
)

T, H, V = 50, 24, 70
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _data(dtype: torch.dtype, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    y[5:9] = -100
    y[20:36] = -100  # covers whole chunks of 8 and 16
    return h, w, b, y


def _grads(loss: torch.Tensor, *ts):
    ts = [t for t in ts if t is not None]
    return torch.autograd.grad(loss, ts)


def _reference(h, w, b, y, dtype=None):
    """Single-process mean from the full logits (in ``dtype`` if given)."""
    args = [t if t is None or dtype is None else t.to(dtype) for t in (h, w, b)]
    logits = F.linear(*args[:2], args[2])
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 13, 50, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_full_logits(dtype, chunk_size, bias):
    h, w, b, y = _data(dtype, bias)
    loss = chunked_cross_entropy(h, w, y, b, chunk_size=chunk_size)
    ref = _reference(h, w, b, y)
    assert loss.dtype == ref.dtype
    assert _rel(loss, ref) <= TOL[dtype]
    for got, want in zip(_grads(loss, h, w, b), _grads(ref, h, w, b)):
        assert _rel(got, want) <= TOL[dtype]


def test_batched_shape_and_logits_path():
    h, w, b, y = _data(torch.float64)
    hb, yb = h.view(2, T // 2, H), y.view(2, T // 2)
    ref = _reference(h, w, b, y)
    assert _rel(chunked_cross_entropy(hb, w, yb, b, chunk_size=7), ref) <= 1e-12
    assert _rel(logits_cross_entropy(F.linear(hb, w, b), yb), ref) <= 1e-12


def test_bf16_close_to_fp32():
    # bf16 matmuls (8-bit mantissa) on top of fp32 softmax: ~1e-2 on gradients is expected.
    h, w, b, y = _data(torch.bfloat16)
    loss = chunked_cross_entropy(h, w, y, b, chunk_size=16)
    ref = _reference(h, w, b, y, dtype=torch.float32)
    assert loss.dtype == torch.float32
    # Same bf16 logits as the model's lm_head, so the loss agrees with the logits path closely.
    assert _rel(loss, logits_cross_entropy(F.linear(h, w, b), y)) <= 1e-5
    assert _rel(loss, ref) <= 1e-2
    got = _grads(loss, h, w, b)
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, want in zip(got, _grads(ref, h, w, b)):
        assert _rel(g, want) <= 3e-2


def test_no_valid_target_is_zero_not_nan():
    h, w, b, _ = _data(torch.float32)
    y = torch.full((T,), -100)
    loss = chunked_cross_entropy(h, w, y, b, chunk_size=16)
    assert loss.item() == 0.0
    for g in _grads(loss, h, w, b):
        assert torch.all(g == 0)


def test_frozen_weight_and_counts():
    h, w, _, y = _data(torch.float32, bias=False)
    w = w.detach()
    loss = chunked_cross_entropy(h, w, y, chunk_size=16)
    (gh,) = _grads(loss, h)
    (gref,) = _grads(_reference(h, w, None, y), h)
    assert _rel(gh, gref) <= 1e-5
    assert count_valid_targets(y).item() == T - 20
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, y, chunk_size=0)


def test_num_items_in_batch_is_the_denominator():
    s = torch.tensor(12.0, requires_grad=True)
    loss = global_token_mean(s, 4, num_items_in_batch=10)
    assert loss.item() == pytest.approx(1.2)
    loss.backward()
    assert s.grad.item() == pytest.approx(0.1)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_allocates_tokens_by_vocab():
    t, v, chunk = 512, 1000, 32  # T*V = 512k elements; a chunk of logits is 32k
    g = torch.Generator().manual_seed(1)
    h = torch.randn(t, H, generator=g, requires_grad=True)
    w = torch.randn(v, H, generator=g, requires_grad=True)
    y = torch.randint(0, v, (t,), generator=g)
    with _LargestAllocation() as mode:
        chunked_cross_entropy(h, w, y, chunk_size=chunk).backward()
    assert mode.largest <= chunk * v
    # The detector does see a (T, V) tensor when one exists.
    with _LargestAllocation() as mode:
        logits_cross_entropy(h @ w.T, y).backward()
    assert mode.largest >= t * v


def _autocast_case(scale: float):
    """Logits of magnitude ~scale: bf16 rounds them by ~scale/256, which the lse inherits."""
    g = torch.Generator().manual_seed(0)
    t, h_dim, v = 256, 64, 1000
    h = torch.randn(t, h_dim, generator=g).requires_grad_()
    w = (scale * torch.randn(v, h_dim, generator=g) / h_dim**0.5).requires_grad_()
    y = torch.randint(0, v, (t,), generator=g)
    y[::7] = -100
    return h, w, y


def test_autocast_uses_one_precision_like_the_logits_path():
    """Under torch.autocast(bf16) the chunked loss computes its logits in bf16 in forward AND
    in backward, exactly as the lm_head + cross-entropy path does. Before: forward's lse came
    from bf16 logits and backward recomputed fp32 logits, and the gradient was 3x further from
    fp32 than the logits path's (12% vs 3.8% at logits ~16)."""
    h, w, y = _autocast_case(scale=16.0)
    ref = _reference(h, w, None, y)  # fp32 throughout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_cross_entropy(h, w, y, chunk_size=64)
        logits = logits_cross_entropy(F.linear(h, w), y)
    assert chunked.dtype == torch.float32
    assert _rel(chunked, logits) <= 1e-5
    got, via_logits, want = _grads(chunked, h, w), _grads(logits, h, w), _grads(ref, h, w)
    for g, l, r in zip(got, via_logits, want):
        assert g.dtype == torch.float32  # gradients in the parameters' dtype
        # the same bf16 computation, up to one bf16 rounding (2^-7): grad W sums its chunks in fp32
        assert _rel(g, l) <= 8e-3, _rel(g, l)
        # and no further from fp32 than the logits path (whose error is bf16's own, ~4%)
        assert _rel(g, r) <= 1.1 * _rel(l, r) + 1e-3, (_rel(g, r), _rel(l, r))


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of every matmul run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.dtypes.add(args[1].dtype if func.overloadpacket is torch.ops.aten.mm
                            else args[2].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast, dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_forward_and_backward_matmuls_share_a_dtype(autocast, dtype):
    h, w, y = _autocast_case(scale=1.0)
    b = torch.zeros(w.shape[0], requires_grad=True)
    with _MatmulDtypes() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = chunked_cross_entropy(h, w, y, b, chunk_size=64)
        # backward runs outside autocast, as in a training loop
        loss.backward()
    assert mode.dtypes == {dtype}
    assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32


def test_a_rounded_token_count_is_refused():
    """bf16 turns 100001 into 99840: a denominator cast by a mixed-precision wrapper must
    fail loudly rather than scale the loss and every gradient by 1.0016."""
    assert torch.tensor(100001.0).to(torch.bfloat16).item() == 99840.0
    s = torch.tensor(12.0, requires_grad=True)
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="rounds token counts"):
            global_token_mean(s, 4, num_items_in_batch=torch.tensor(100001.0).to(dtype))
    for exact in (100001, torch.tensor(100001), torch.tensor(100001.0, dtype=torch.float64)):
        assert global_token_mean(s, 4, num_items_in_batch=exact).item() == pytest.approx(
            12.0 / 100001, rel=1e-7)


@pytest.mark.parametrize("block", [2**18, 64, 7])
def test_token_stats_in_row_blocks_equal_whole_logits(monkeypatch, block):
    """lse_'s entropy and top-1 statistics, taken a block of rows at a time (one block when
    the chunk is small, several, and blocks of one row), against the whole (C, V) logits:
    entropy -sum p log p, argmax hits (ties go to the first maximum, as torch.argmax) and
    the valid count."""
    from easy_context.memory import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_STATS_BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(29, 11, generator=g, dtype=torch.float64) * 3
    logits[4, 2] = logits[4, 7] = logits[4].max() + 1  # a tie: the first maximum counts
    y = torch.randint(0, 11, (29,), generator=g)
    y[4] = 2
    valid = torch.rand(29, generator=g) > 0.3
    valid[4] = True
    stats = torch.zeros(3, dtype=torch.float64)
    lse = loss_mod.lse_(logits.clone(), y, valid, stats)
    p = torch.softmax(logits, dim=1)
    entropy = -(p * p.log()).sum(1)
    torch.testing.assert_close(lse, torch.logsumexp(logits, 1), rtol=1e-12, atol=0)
    torch.testing.assert_close(stats[0], (entropy * valid).sum(), rtol=1e-10, atol=0)
    assert stats[1] == ((logits.argmax(1) == y) & valid).sum()
    assert stats[2] == valid.sum()


# ----------------------------------------------------------- chunk sizes and head-gradient GEMMs
def test_default_chunk_rows_per_device():
    """A CPU keeps ~64 MiB of fp32 logits per chunk; a GPU takes 2,048 rows (compute-bound
    head GEMMs, 64 chunks per 128K tokens instead of ~1,000), at most 1 GiB of logits."""
    from easy_context.memory.loss import default_chunk_size

    assert default_chunk_size(128256) == default_chunk_size(128256, "cpu") == 130
    assert default_chunk_size(32000, torch.device("cpu")) == 524
    for device in ("gpu", "cuda", "cuda:1", torch.device("cuda", 0)):
        assert default_chunk_size(128256, device) == 2048
        assert default_chunk_size(32000, device) == 2048
        assert default_chunk_size(97, device) == 2048
    assert default_chunk_size(262144, "cuda") == 1024  # Gemma 3's vocabulary: the 1 GiB cap
    assert default_chunk_size(10**8, "cuda") == default_chunk_size(10**8) == 128


def _old_chunked_backward(h, w, y, chunk):
    """The head gradient as it was summed before add_matmul_: one (V, H) product per chunk,
    then added to the fp32 accumulator."""
    lse = torch.logsumexp(h @ w.T, 1)
    grad_w = torch.zeros_like(w)
    for s in range(0, h.shape[0], chunk):
        p = (h[s:s + chunk] @ w.T).sub_(lse[s:s + chunk, None]).exp_()
        p[torch.arange(p.shape[0]), y[s:s + chunk]] -= 1.0
        grad_w += p.T @ h[s:s + chunk]
    return grad_w


def test_head_gradient_accumulated_in_the_gemm_equals_the_summed_products():
    """fp32: the chunks add into the head gradient inside addmm_ (beta = 1), no product tensor;
    the gradient equals the per-chunk products summed as before within 1e-6."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(300, 24, generator=g)
    w = torch.randn(50, 24, generator=g)
    y = torch.randint(0, 50, (300,), generator=g)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_cross_entropy(hr, wr, y, chunk_size=64)
    with _HeadProducts(w.shape) as mode:
        loss.backward()
    old = _old_chunked_backward(h, w, y, 64) / 300
    assert _rel(wr.grad, old) <= 1e-6
    assert mode.products == 0 and mode.accumulations == 5  # ceil(300 / 64) chunks


class _HeadProducts(TorchDispatchMode):
    """Counts (V, H) matmul results formed apart (mm) and in-place accumulations (addmm_)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.products, self.accumulations = tuple(shape), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and tuple(out.shape) == self.shape:
            self.products += 1
        if func is torch.ops.aten.addmm_.default and tuple(out.shape) == self.shape:
            self.accumulations += 1
        return out


def test_add_matmul_falls_back_where_the_gemm_cannot_write_float32(monkeypatch):
    """On this CPU, torch.addmm has no out_dtype kernel: the probe says so once and bf16
    products are formed and added; float32 inputs go through addmm_."""
    from easy_context.memory import loss as L

    monkeypatch.setattr(L, "_OUT_DTYPE_ADDMM", {})
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 8, generator=g), torch.randn(8, 12, generator=g)
    acc = torch.randn(16, 12, generator=g)
    want = acc + a.bfloat16().float() @ b.bfloat16().float()
    got = L.add_matmul_(acc.clone(), a.bfloat16(), b.bfloat16())
    assert not L._out_dtype_addmm_works(acc, a.bfloat16())
    assert L._OUT_DTYPE_ADDMM == {("cpu", torch.bfloat16, torch.float32): False}
    assert (got - want).abs().max() <= 0.05  # the bf16 product's rounding
    acc32 = acc.clone()
    assert L.add_matmul_(acc32, a, b) is acc32
    torch.testing.assert_close(acc32, acc + a @ b, rtol=1e-6, atol=1e-6)


class _CudaAddmmStandIn:
    """torch.addmm as CUDA builds of torch >= 2.8 run it with ``out_dtype``: bf16/fp16 inputs,
    a float32 result computed in float32 (here via float64), written to ``out``; ``strict``:
    the releases whose check asks ``self`` to have the inputs' dtype."""

    def __init__(self, strict: bool):
        self.real, self.strict, self.calls = torch.addmm, strict, []

    def __call__(self, acc, a, b, *, out_dtype=None, out=None, **kw):
        if out_dtype is None:
            return self.real(acc, a, b, out=out, **kw) if out is not None else self.real(acc, a, b, **kw)
        self.calls.append((acc.dtype, a.dtype, b.dtype, out_dtype, out is acc))
        if self.strict and acc.dtype != a.dtype:
            raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")
        assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
        assert out_dtype == torch.float32 and out is not None and out.dtype == out_dtype
        out.copy_((acc.double() + a.double() @ b.double()).float())
        return out


@pytest.mark.parametrize("strict", [False, True])
def test_add_matmul_uses_the_float32_gemm_where_the_probe_finds_it(monkeypatch, strict):
    """The CUDA branch's contract, with a stand-in for torch.addmm's out_dtype kernel: the probe
    calls it as add_matmul_ will (fp32 accumulator as ``self`` and ``out``, bf16 inputs,
    ``out_dtype=float32``) and checks the numbers; when it works the accumulation happens in
    the GEMM (no bf16 product: the sum keeps float32 precision), when the release refuses a
    float32 ``self`` the fallback runs."""
    from easy_context.memory import loss as L

    standin = _CudaAddmmStandIn(strict)
    monkeypatch.setattr(torch, "addmm", standin)
    monkeypatch.setattr(L, "_OUT_DTYPE_ADDMM", {})
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 8, generator=g).bfloat16(), torch.randn(8, 12, generator=g).bfloat16()
    acc = torch.randn(16, 12, generator=g)
    exact = (acc.double() + a.double() @ b.double()).float()
    got = L.add_matmul_(acc.clone(), a, b)
    assert standin.calls[0] == (torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, True)
    if strict:
        assert len(standin.calls) == 1  # the probe only; the product is formed in bf16
        assert (got - exact).abs().max() > 1e-4
    else:
        assert len(standin.calls) == 2  # the probe, then the accumulation
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
