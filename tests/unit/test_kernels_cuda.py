"""torch's CUDA attention ops behind the kernel contract, checked on the CPU.

The real ops cannot run here. Two things can: (1) the same calls on the ``meta`` device,
which checks our argument lists against the real op schemas and the shapes they return;
(2) stand-in ops (tests/unit/kernel_standins.py) that read their inputs the way the CUDA
kernels do and raise where they raise, computed by the reference kernel: our wrapper's
contiguity, lse padding and alignment, GQA handling and path choice are checked against
them. benchmarks/gpu_check.py runs the real ones on a GPU.
Tolerance: as the reference in the same dtype (fp32 5e-6, fp16 5e-3, bf16 3e-2 of max |ref|).
"""

import pytest
import torch

from easy_context.attention.cuda_ops import choose_path, cuda_backward, cuda_forward, make_cuda_kernel

from .kernel_standins import CALLS, TorchCudaOps
from .test_kernels import check_kernel, views

TOL = {torch.float32: 5e-6, torch.float16: 5e-3, torch.bfloat16: 3e-2}
AMPERE, TURING, HOPPER = (8, 0), (7, 5), (9, 0)
YES, NO = (lambda *a: True), (lambda *a: False)  # stand-ins for torch's cuDNN check


@pytest.mark.parametrize("dtype,capability,path", [
    (torch.bfloat16, AMPERE, "flash"), (torch.float16, AMPERE, "flash"),
    (torch.float32, AMPERE, "efficient"), (torch.float16, TURING, "efficient")])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_torch_cuda_ops_contract(dtype, capability, path, causal, d):
    kernel = make_cuda_kernel(TorchCudaOps, capability)
    CALLS.clear()
    errs = check_kernel(kernel, dtype, causal, d=d)
    assert CALLS == [f"{path}_fwd", f"{path}_bwd"]
    assert max(errs.values()) <= TOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_op_contract_on_hopper(dtype, causal, d):
    """sm90+: the cuDNN op where torch accepts the call (its lse (B, H, S, 1) in and out,
    dense lengths, native GQA), else the flash op."""
    CALLS.clear()
    errs = check_kernel(make_cuda_kernel(TorchCudaOps, HOPPER, cudnn_check=YES), dtype, causal, d=d)
    assert CALLS == ["cudnn_fwd", "cudnn_bwd"]
    assert max(errs.values()) <= TOL[dtype], errs
    CALLS.clear()
    check_kernel(make_cuda_kernel(TorchCudaOps, HOPPER, cudnn_check=NO), dtype, causal, d=d)
    assert CALLS == ["flash_fwd", "flash_bwd"]


def test_a_failing_cudnn_call_falls_back_to_flash_once_and_for_all(caplog):
    """A cuDNN call that raises sends that (dtype, head dim, causal) to the flash op, with one
    log line; the lse of either op serves the other's backward. Forced cuDNN raises."""
    from easy_context.attention import cuda_ops

    class Broken(TorchCudaOps):
        @staticmethod
        def _scaled_dot_product_cudnn_attention(*a, **k):
            CALLS.append("cudnn_fwd")
            raise RuntimeError("cuDNN Frontend error: no valid execution plans")

    cuda_ops._CUDNN_FAILED.clear()
    try:
        CALLS.clear()
        kernel = make_cuda_kernel(Broken, HOPPER, cudnn_check=YES)
        errs = check_kernel(kernel, torch.bfloat16, True, d=64)
        assert CALLS == ["cudnn_fwd", "flash_fwd", "flash_bwd"]
        assert max(errs.values()) <= TOL[torch.bfloat16]
        assert sum("cuDNN attention failed" in r.message for r in caplog.records) == 1
        CALLS.clear()
        check_kernel(kernel, torch.bfloat16, True, d=64)
        assert CALLS == ["flash_fwd", "flash_bwd"]
        # the other causal setting is still tried on cuDNN
        CALLS.clear()
        check_kernel(make_cuda_kernel(TorchCudaOps, HOPPER, cudnn_check=YES), torch.bfloat16,
                     False, d=64)
        assert CALLS == ["cudnn_fwd", "cudnn_bwd"]
        forced = make_cuda_kernel(Broken, HOPPER, path="cudnn", cudnn_check=YES)
        with pytest.raises(RuntimeError, match="no valid execution plans"):
            check_kernel(forced, torch.bfloat16, True, d=64)
    finally:
        cuda_ops._CUDNN_FAILED.clear()


def test_efficient_backward_reads_out_rows_as_contiguous():
    """The bug the wrapper avoids: handing the efficient backward a head-group view of out."""
    q, k, v, dout = views(dtype=torch.float32)
    out, lse = cuda_forward(q, k, v, True, 0.1, ops=TorchCudaOps, capability=AMPERE)
    wide = torch.zeros(out.size(0), out.size(1), 8, out.size(3))
    wide[:, :, 2:4] = out
    good = cuda_backward(dout, q, k, v, wide[:, :, 2:4], lse, True, 0.1, ops=TorchCudaOps,
                         capability=AMPERE)
    ref = cuda_backward(dout, q, k, v, out.contiguous(), lse, True, 0.1, ops=TorchCudaOps,
                        capability=AMPERE)
    for g, r in zip(good, ref):
        torch.testing.assert_close(g, r)
    # what the stand-in computes when given the view as it is (the old behaviour): wrong
    bad = TorchCudaOps._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.contiguous().transpose(1, 2),
        k.repeat_interleave(2, 2).contiguous().transpose(1, 2),
        v.repeat_interleave(2, 2).contiguous().transpose(1, 2), None,
        wide[:, :, 2:4].transpose(1, 2), torch.zeros(2, 2, 32).index_copy_(2, torch.arange(13), lse),
        None, None, 0.0, [True] * 3 + [False], True, scale=0.1)
    assert not torch.allclose(bad[0].transpose(1, 2), ref[0], atol=1e-3)


def test_efficient_backward_refuses_unaligned_lse():
    q = torch.randn(2, 4, 13, 8)
    with pytest.raises(RuntimeError, match="LSE is not correctly aligned"):
        TorchCudaOps._scaled_dot_product_efficient_attention_backward(
            q, q, q, q, None, q, torch.zeros(2, 4, 13), None, None, 0.0, [True] * 4, False,
            scale=0.1)


@pytest.mark.parametrize("d,dtype,capability,path", [
    (64, torch.bfloat16, AMPERE, "flash"), (256, torch.bfloat16, AMPERE, "flash"),
    (264, torch.bfloat16, AMPERE, "efficient"), (60, torch.bfloat16, AMPERE, "reference"),
    (60, torch.float32, AMPERE, "reference"), (64, torch.float64, AMPERE, "reference"),
    (64, torch.bfloat16, TURING, "efficient"), (64, torch.float32, (9, 0), "efficient"),
    (128, torch.bfloat16, HOPPER, "cudnn"), (256, torch.float16, HOPPER, "cudnn"),
    (264, torch.bfloat16, HOPPER, "efficient"), (60, torch.bfloat16, HOPPER, "reference")])
def test_path_choice(d, dtype, capability, path):
    assert choose_path(torch.empty(1, 4, 2, d, dtype=dtype), capability) == path


def test_reference_fallback_never_crashes():
    kernel = make_cuda_kernel(TorchCudaOps, AMPERE)
    CALLS.clear()
    errs = check_kernel(kernel, torch.float32, True, d=62)
    assert CALLS == [] and max(errs.values()) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype,capability", [(torch.bfloat16, AMPERE), (torch.float32, AMPERE),
                                              (torch.float16, TURING)])
def test_real_op_schemas_on_meta(dtype, capability):
    """Our calls against the real aten schemas (meta kernels): argument order and types,
    and the shapes we hand back, for GQA views of a shard 13 rows long."""
    b, s, d = 2, 13, 64
    q = torch.empty(b, s, 8, d, device="meta", dtype=dtype)[:, :, 2:4]
    k = torch.empty(b, s, 4, d, device="meta", dtype=dtype)[:, :, 1:2]
    out, lse = cuda_forward(q, k, k, True, 0.1, capability=capability)
    assert out.shape == q.shape and tuple(lse.shape) == (b, 2, s) and lse.dtype == torch.float32
    dq, dk, dv = cuda_backward(q, q, k, k, out, lse, True, 0.1, capability=capability)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_real_cudnn_op_schemas_on_meta():
    """The cuDNN calls against the real aten schemas: GQA views, 13 rows, the lse reshaped."""
    b, s, d = 2, 13, 64
    q = torch.empty(b, s, 8, d, device="meta", dtype=torch.bfloat16)[:, :, 2:6]
    k = torch.empty(b, s, 4, d, device="meta", dtype=torch.bfloat16)[:, :, 1:3]
    kw = dict(capability=HOPPER, path="cudnn")
    out, lse = cuda_forward(q, k, k, True, 0.1, **kw)
    assert out.shape == q.shape and tuple(lse.shape) == (b, 4, s) and lse.dtype == torch.float32
    dq, dk, dv = cuda_backward(q, q, k, k, out, lse, True, 0.1, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
