"""The kernel contract (easy_context/attention/contract.py) on the CPU: every backend that runs
here against the float64 reference, on the views the methods hand it.

Tolerances, relative to max |reference|: fp32 5e-6 (measured ~3e-7 forward, ~1e-6
gradients); bf16 3e-2 (one bf16 rounding of out and gradients, ~8e-3 measured).
"""

import pytest
import torch

from easy_context.attention.kernels import CPU_FLASH, REFERENCE
from easy_context.attention.selection import available_kernels, select_kernel

TOL = {torch.float32: 5e-6, torch.bfloat16: 3e-2}


def _rel(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def views(b=2, sq=13, sk=13, hq_all=8, hkv_all=4, heads=(2, 4), kv=(1, 2), d=64,
          dtype=torch.float32, seed=0):
    """q, k, v, dout as the methods pass them: a head group of wider tensors, rows of a
    longer shard (neither contiguous), shard lengths not a multiple of 8, GQA 2:1."""
    g = torch.Generator().manual_seed(seed)
    qf = torch.randn(b, sq + 3, hq_all, d, generator=g).to(dtype)
    kf = torch.randn(b, sk + 5, hkv_all, d, generator=g).to(dtype)
    vf = torch.randn(b, sk + 5, hkv_all, d, generator=g).to(dtype)
    df = torch.randn(b, sq + 3, hq_all, d, generator=g).to(dtype)
    q, dout = qf[:, 3:, slice(*heads)], df[:, 3:, slice(*heads)]
    k, v = kf[:, 5:, slice(*kv)], vf[:, 5:, slice(*kv)]
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k, v, dout


def check_kernel(kernel, dtype, causal, sq=13, sk=13, d=64):
    q, k, v, dout = views(sq=sq, sk=sk, d=d, dtype=dtype)
    scale = 0.125
    ref_out, ref_lse = REFERENCE.forward(q.double(), k.double(), v.double(), causal, scale)
    ref_grads = REFERENCE.backward(dout.double(), q.double(), k.double(), v.double(), ref_out,
                                   ref_lse, causal, scale)
    out, lse = kernel.forward(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.size(0), q.size(2), q.size(1)) and lse.dtype == torch.float32
    # backward with the final out/lse as the methods give it: a view of wider tensors
    grads = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    errs = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        errs[name] = _rel(g, r)
    return errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_meets_the_contract(dtype, causal):
    errs = check_kernel(CPU_FLASH, dtype, causal)
    assert max(errs.values()) <= TOL[dtype], errs


@pytest.mark.parametrize("sk", [7, 21])
def test_full_blocks_of_other_lengths(sk):
    errs = check_kernel(CPU_FLASH, torch.float32, False, sq=13, sk=sk)
    assert max(errs.values()) <= TOL[torch.float32], errs


@pytest.mark.parametrize("kernel", [CPU_FLASH, REFERENCE])
def test_causal_blocks_must_be_square(kernel):
    q, k, v, _ = views(sq=8, sk=12)
    with pytest.raises(ValueError, match="causal block must be square"):
        kernel.forward(q, k, v, True, 0.1)


def test_selection_on_the_cpu():
    q = torch.randn(1, 4, 2, 8)
    assert select_kernel(q) is CPU_FLASH
    assert select_kernel(q.double()) is REFERENCE
    assert select_kernel(q, "reference") is REFERENCE
    assert {"cpu_flash", "reference", "cuda_torch"} <= set(available_kernels())
    with pytest.raises(ValueError, match="unknown or unavailable attention kernel 'nope'"):
        select_kernel(q, "nope")
