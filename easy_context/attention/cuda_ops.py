"""torch's CUDA attention ops behind the kernel contract (kernels.py).

Two aten ops return the log-sum-exp: the flash op (fp16/bf16, sm80+, head dim a multiple of
8 up to 256, native GQA) and the memory-efficient op (any float dtype, equal head counts).
What each assumes about its inputs, and what this module does about it (read from
aten/src/ATen/native/transformers/cuda/attention_backward.cu and mem_eff_attention/
kernel_backward.h; contract-tested on CPU with stand-in ops, tests/unit/test_kernels_cuda.py;
run for real by benchmarks/gpu_check.py):

- efficient backward reads ``out`` with its batch and head strides only: the row stride is
  taken to be H x D, so a head-group view of a wider output reads the wrong rows. We pass
  ``out`` contiguous. (dout it copies to contiguous itself.)
- efficient backward checks lse strides: head and batch strides multiples of 8 ("LSE is not
  correctly aligned"). Its forward hands back an lse padded to a multiple of 32 rows; we
  keep only the Sq real rows, and backward rebuilds the padded layout (zeros beyond Sq,
  which the kernel never reads) so any shard length works, not just multiples of 8.
- efficient kernels take q/k/v head strides and base pointers aligned to 16 bytes: we pass
  them contiguous (row and head-group views of bf16 tensors need not be), and repeat K/V
  for GQA (the efficient op wants equal head counts), summing dK/dV back over the groups.
- the flash op copies dout and out to contiguous itself; its lse must be (B, H, Sq)
  contiguous float32, which we pass.
- the cuDNN op (fp16/bf16; chosen on sm90+, where SDPA's own dispatcher puts it first, and
  only where torch's ``can_use_cudnn_attention`` accepts the call) takes GQA natively and
  returns its lse as (B, H, Sq, 1) float32; we hand back (B, H, Sq) and give its backward
  the same layout again. Measured on an H200 (torch 2.11, benchmarks/gpu_check.py): 547
  TFLOP/s causal forward + backward at 32K (32 heads on 8, D=128) against the flash op's
  326, its lse equal to the flash op's. We pass q/k/v/out/dout contiguous, as it was run
  there. Should a cuDNN call still raise, that (dtype, head dim, causal) goes to the flash op
  from then on, with one log line: both ops give the same lse, so a forward of one and a
  backward of the other agree.
- none gets a mask or a bias: documents never reach a kernel as a mask (documents.py).
Where no op fits (a head dim that is not a multiple of 8, float64), the reference kernel
runs instead: slower, never a crash.
"""

from __future__ import annotations

import functools
import logging

import torch

from .contract import Kernel, check_block, default_scale, finite_lse, grouped, heads_first
from .kernels import reference_backward, reference_forward

Tensor = torch.Tensor
log = logging.getLogger(__name__)
HALF = (torch.float16, torch.bfloat16)
LSE_PAD = 32  # the efficient forward pads lse rows to this multiple


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(t: Tensor) -> tuple[int, int]:
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def choose_path(q: Tensor, capability: tuple[int, int]) -> str:
    """"cudnn", "flash", "efficient" or "reference" for a block of ``q``'s dtype and head
    dim ("cudnn" only where torch's check accepts the call too: see _path)."""
    d = q.size(-1)
    if q.dtype in HALF and capability >= (9, 0) and d % 8 == 0 and d <= 256:
        return "cudnn"
    if q.dtype in HALF and capability >= (8, 0) and d % 8 == 0 and d <= 256:
        return "flash"
    # SDPA's own dispatcher asks the efficient kernel for head dims that are multiples of 8
    # (sdp_utils.cpp, check_head_dim_size_mem_efficient); we ask the same of every dtype.
    if q.dtype in HALF + (torch.float32,) and d % 8 == 0:
        return "efficient"
    return "reference"


def _repeat_kv(q: Tensor, t: Tensor) -> Tensor:
    _, g = grouped(q, t)
    return t if g == 1 else t.repeat_interleave(g, dim=2)


def _sum_groups(dt: Tensor, hkv: int) -> Tensor:
    b, s, hq, d = dt.shape
    return dt if hq == hkv else dt.reshape(b, s, hkv, hq // hkv, d).sum(3)


def _padded_lse(lse: Tensor) -> Tensor:
    """(B, H, Sq) -> (B, H, ceil(Sq / 32) * 32) float32: the layout the efficient forward
    produces, whose strides meet the backward's alignment checks for every Sq."""
    b, h, sq = lse.shape
    padded = lse.new_zeros(b, h, -(-sq // LSE_PAD) * LSE_PAD, dtype=torch.float32)
    padded[..., :sq] = finite_lse(lse)
    return padded


def _seeds(q: Tensor) -> tuple[Tensor, Tensor]:
    # Dropout is off: the ops read the philox seed/offset only when dropout_p > 0.
    z = torch.zeros((), dtype=torch.int64, device=q.device)
    return z, z


# (dtype, head dim, causal) where a cuDNN call raised: the flash op runs them instead
_CUDNN_FAILED: set[tuple] = set()


def torch_accepts_cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """What SDPA's dispatcher asks before it runs the cuDNN op (shapes, strides, dtype, head
    dims, cuDNN version, deterministic mode)."""
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    params = SDPAParams(heads_first(q), heads_first(k), heads_first(v), None, 0.0, causal,
                        q.size(2) != k.size(2))
    return bool(can_use_cudnn_attention(params, False))


def _cudnn_key(q: Tensor, causal: bool) -> tuple:
    return (q.dtype, q.size(-1), bool(causal))


def _path(q, k, v, causal, capability, path: str | None, cudnn_check) -> str:
    if path is not None:
        return path
    chosen = choose_path(q, device_capability(q) if capability is None else capability)
    if chosen == "cudnn" and (_cudnn_key(q, causal) in _CUDNN_FAILED
                              or not _accepted(q, k, v, causal, cudnn_check)):
        return "flash"
    return chosen


# torch's answer per call shape (it depends on shapes, dtype and the deterministic setting,
# not on values): asked once, on the contiguous layout the call passes
_ACCEPTED: dict[tuple, bool] = {}


def _accepted(q, k, v, causal, cudnn_check) -> bool:
    key = (cudnn_check, q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape),
           bool(causal), torch.are_deterministic_algorithms_enabled())
    if key not in _ACCEPTED:
        _ACCEPTED[key] = cudnn_check(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    return _ACCEPTED[key]


def _cudnn_failed(q: Tensor, causal: bool, error: Exception) -> None:
    _CUDNN_FAILED.add(_cudnn_key(q, causal))
    log.warning("torch's cuDNN attention failed for %s, head dim %d, causal=%s (%s); the "
                "flash op runs these blocks from now on", q.dtype, q.size(-1), causal,
                str(error).splitlines()[0][:200] if str(error) else type(error).__name__)


def cuda_forward(q, k, v, causal=False, scale=None, *, ops=None, capability=None, path=None,
                 cudnn_check=torch_accepts_cudnn):
    """``ops``: the aten namespace (stand-ins in tests); ``capability``: (major, minor);
    ``path``: force "cudnn", "flash" or "efficient" (default: choose_path);
    ``cudnn_check``: whether torch runs a call on cuDNN (a stand-in in tests)."""
    check_block(q, k, causal)
    ops = torch.ops.aten if ops is None else ops
    scale = default_scale(q.size(-1)) if scale is None else scale
    forced = path
    path = _path(q, k, v, causal, capability, path, cudnn_check)
    if path == "cudnn":
        try:
            res = ops._scaled_dot_product_cudnn_attention(
                heads_first(q.contiguous()), heads_first(k.contiguous()),
                heads_first(v.contiguous()), None, True, 0.0, causal, False, scale=scale)
            return res[0].transpose(1, 2), res[1].reshape(res[1].shape[:3])
        except (RuntimeError, NotImplementedError) as e:
            if forced or isinstance(e, torch.OutOfMemoryError):
                raise
            _cudnn_failed(q, causal, e)
            path = "flash"
    if path == "flash":
        res = ops._scaled_dot_product_flash_attention(
            heads_first(q), heads_first(k), heads_first(v), 0.0, causal, False, scale=scale)
        return res[0].transpose(1, 2), res[1]
    if path == "efficient":
        kr, vr = _repeat_kv(q, k), _repeat_kv(q, v)
        out, lse, _, _ = ops._scaled_dot_product_efficient_attention(
            heads_first(q.contiguous()), heads_first(kr.contiguous()),
            heads_first(vr.contiguous()), None, True, 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse[..., : q.size(1)]
    return reference_forward(q, k, v, causal, scale)


def cuda_backward(dout, q, k, v, out, lse, causal=False, scale=None, *, ops=None,
                  capability=None, path=None, cudnn_check=torch_accepts_cudnn):
    check_block(q, k, causal)
    ops = torch.ops.aten if ops is None else ops
    scale = default_scale(q.size(-1)) if scale is None else scale
    forced = path
    path = _path(q, k, v, causal, capability, path, cudnn_check)
    seed, offset = _seeds(q)
    if path == "cudnn":
        try:
            # dense inputs: no cumulative lengths (undefined tensors), s_q and s_kv the
            # blocks' own
            dq, dk, dv = ops._scaled_dot_product_cudnn_attention_backward(
                heads_first(dout.contiguous()), heads_first(q.contiguous()),
                heads_first(k.contiguous()), heads_first(v.contiguous()),
                heads_first(out.contiguous()), finite_lse(lse).contiguous().unsqueeze(-1),
                seed, offset, None, None, None, q.size(1), k.size(1), 0.0, causal, scale=scale)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        except (RuntimeError, NotImplementedError) as e:
            if forced or isinstance(e, torch.OutOfMemoryError):
                raise
            _cudnn_failed(q, causal, e)
            path = "flash"
    if path == "flash":
        dq, dk, dv = ops._scaled_dot_product_flash_attention_backward(
            heads_first(dout), heads_first(q), heads_first(k), heads_first(v), heads_first(out),
            finite_lse(lse).contiguous(), None, None, q.size(1), k.size(1), 0.0, causal,
            seed, offset, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if path == "efficient":
        kr, vr = _repeat_kv(q, k).contiguous(), _repeat_kv(q, v).contiguous()
        dq, dk, dv, _ = ops._scaled_dot_product_efficient_attention_backward(
            heads_first(dout), heads_first(q.contiguous()), heads_first(kr), heads_first(vr),
            None, heads_first(out.contiguous()), _padded_lse(lse), seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        hkv = k.size(2)
        return (dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), hkv),
                _sum_groups(dv.transpose(1, 2), hkv))
    return reference_backward(dout, q, k, v, out, lse, causal, scale)


def make_cuda_kernel(ops=None, capability: tuple[int, int] | None = None,
                     name: str = "cuda_torch", path: str | None = None,
                     cudnn_check=torch_accepts_cudnn) -> Kernel:
    """The kernel over ``ops`` (default torch.ops.aten) and a fixed capability (default:
    the tensor's device's), always on ``path`` when given."""
    kw = dict(ops=ops, capability=capability, path=path, cudnn_check=cudnn_check)
    return Kernel(name, functools.partial(cuda_forward, **kw),
                  functools.partial(cuda_backward, **kw))


CUDA_TORCH = make_cuda_kernel()
# One op each, whatever the inputs (for checks and comparisons; they fail where it cannot run).
CUDA_TORCH_CUDNN = make_cuda_kernel(name="cuda_torch_cudnn", path="cudnn")
CUDA_TORCH_FLASH = make_cuda_kernel(name="cuda_torch_flash", path="flash")
CUDA_TORCH_EFFICIENT = make_cuda_kernel(name="cuda_torch_efficient", path="efficient")
