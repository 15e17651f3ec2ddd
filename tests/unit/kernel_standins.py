"""CPU stand-ins for the CUDA-only attention ops, to test our side of each call contract.

Each stand-in has the real op's name, argument list and return layout, reads its inputs the
way the real kernel does (where that differs from what a tensor's strides say, it reads the
same wrong way, so a test fails where the GPU would compute garbage), raises where the real
one raises, and computes with the reference kernel. Sources: torch's
aten/src/ATen/native/transformers/cuda/attention{,_backward}.cu and mem_eff_attention/
kernel_backward.h; flash-attn's flash_attn_interface.py of 2.6.3 / 2.7.x / 2.8.x and
flash_attn/cute/interface.py of flash-attn-4.
"""

from __future__ import annotations

import types
from typing import Optional, Tuple

import torch

from easy_context.attention.kernels import reference_backward, reference_forward

Tensor = torch.Tensor
CALLS: list[str] = []  # which stand-in ran, in order (tests check the path taken)
DETERMINISTIC: list[bool] = []  # the deterministic flag each flash-attn backward got


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(1, 2)


def _fa2_window(q, k, v, causal, left, right, softcap):
    """What flash-attn 2's C++ does with the window and softcap arguments (flash_api.cpp):
    a side >= seqlen_k is reset to -1 (unbounded), causal sets the right side to 0, softcap
    0.0 is off; and v must have q's head dim (CHECK_SHAPE(v, ..., head_size))."""
    assert v.size(-1) == q.size(-1), "v must have shape (batch, seqlen_k, num_heads_k, head_size)"
    sk = k.size(1)
    left = -1 if left >= sk else left
    right = -1 if right >= sk else right
    if causal:
        right = 0
    window = None if (left, right) == (-1, -1) else (left, right)
    if window == (-1, 0) and q.size(1) == sk:
        window, causal = None, True
    elif window is not None:
        causal = False
    return causal, window, (softcap if softcap > 0 else None)


def _as_kernel_reads_rows(t: Tensor) -> Tensor:
    """``t`` (B, S, H, D) as a kernel that assumes a row stride of H x D reads it."""
    b, s, h, d = t.shape
    return torch.as_strided(t, (b, s, h, d), (t.stride(0), h * d, t.stride(2), 1),
                            t.storage_offset())


def _aligned(t: Tensor, what: str) -> None:
    # cutlass kernels want 16-byte aligned head strides and base pointers
    align = 16 // t.element_size()
    if t.size(2) > 1 and t.stride(2) % align or t.storage_offset() % align:
        raise RuntimeError(f"cutlassF: no kernel found to launch! ({what} misaligned)")


class TorchCudaOps:
    """aten's six SDPA ops that return the lse, as the CUDA build has them."""

    @staticmethod
    def _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
                                            dropout_p=0.0, is_causal=False,
                                            return_debug_mask=False, *, scale=None):
        CALLS.append("cudnn_fwd")
        assert query.dtype in (torch.float16, torch.bfloat16), "cudnn: fp16/bf16 only"
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
        for t in (query, key, value):
            assert t.stride(-1) == 1, "cudnn: the head dim must be contiguous"
        assert query.size(1) % key.size(1) == 0  # native GQA
        out, lse = reference_forward(_bshd(query), _bshd(key), _bshd(value), is_causal, scale)
        # its softmax statistics: (B, H, Sq, 1) float32
        return (_bshd(out.contiguous()), lse.float().unsqueeze(-1).contiguous(), None, None,
                query.size(2), key.size(2), torch.zeros(()), torch.zeros(()), None)

    @staticmethod
    def _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out,
                                                     logsumexp, philox_seed, philox_offset,
                                                     attn_bias, cum_seq_q, cum_seq_k, max_q,
                                                     max_k, dropout_p, is_causal, *, scale=None):
        CALLS.append("cudnn_bwd")
        # a defined cum_seq_q would send it down the nested (varlen) path
        assert cum_seq_q is None and cum_seq_k is None and attn_bias is None
        b, h, sq, _ = query.shape
        assert tuple(logsumexp.shape) == (b, h, sq, 1) and logsumexp.dtype == torch.float32
        assert logsumexp.is_contiguous()
        assert (max_q, max_k) == (query.size(2), key.size(2))  # its s_q and s_kv
        for t in (grad_out, query, key, value, out):
            assert t.stride(-1) == 1
        grads = reference_backward(_bshd(grad_out).contiguous(), _bshd(query), _bshd(key),
                                   _bshd(value), _bshd(out).contiguous(), logsumexp[..., 0],
                                   is_causal, scale)
        return tuple(_bshd(g) for g in grads)

    @staticmethod
    def _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False,
                                            return_debug_mask=False, *, scale=None):
        CALLS.append("flash_fwd")
        assert query.dtype in (torch.float16, torch.bfloat16), "flash: fp16/bf16 only"
        assert query.size(-1) % 8 == 0 and query.size(-1) <= 256
        assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
        assert query.size(1) % key.size(1) == 0  # native GQA
        out, lse = reference_forward(_bshd(query), _bshd(key), _bshd(value), is_causal, scale)
        return (_bshd(out.contiguous()), lse.contiguous(), None, None, query.size(2),
                key.size(2), torch.zeros(2, dtype=torch.int64), torch.zeros(()),
                torch.empty(0, dtype=query.dtype))

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out,
                                                     logsumexp, cum_seq_q, cum_seq_k, max_q,
                                                     max_k, dropout_p, is_causal, philox_seed,
                                                     philox_offset, *, scale=None):
        CALLS.append("flash_bwd")
        assert logsumexp.is_contiguous() and logsumexp.dtype == torch.float32
        assert tuple(logsumexp.shape) == (query.size(0), query.size(1), query.size(2))
        assert (max_q, max_k) == (query.size(2), key.size(2))
        grads = reference_backward(_bshd(grad_out).contiguous(), _bshd(query), _bshd(key),
                                   _bshd(value), _bshd(out).contiguous(), logsumexp,
                                   is_causal, scale)
        return tuple(_bshd(g) for g in grads)

    @staticmethod
    def _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp,
                                                dropout_p=0.0, is_causal=False, *, scale=None):
        CALLS.append("efficient_fwd")
        assert query.size(1) == key.size(1) == value.size(1), "efficient: equal head counts"
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            _aligned(_bshd(t), name)
        out, lse = reference_forward(_bshd(query), _bshd(key), _bshd(value), is_causal, scale)
        b, h, sq = lse.shape
        padded = torch.full((b, h, -(-sq // 32) * 32), float("nan"))  # padding is garbage
        padded[..., :sq] = lse
        return _bshd(out.contiguous()), padded, torch.zeros(()), torch.zeros(())

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value,
                                                         attn_bias, out, logsumexp,
                                                         philox_seed, philox_offset, dropout_p,
                                                         grad_input_mask, is_causal=False, *,
                                                         scale=None):
        CALLS.append("efficient_bwd")
        b, h, sq, _ = query.shape
        if h > 1 and logsumexp.stride(1) % 8 or b > 1 and logsumexp.stride(0) % 8:
            raise RuntimeError("LSE is not correctly aligned (strideH)")
        assert query.size(1) == key.size(1), "efficient: equal head counts"
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            _aligned(_bshd(t), name)
        lse = torch.as_strided(logsumexp, (b, h, sq), (logsumexp.stride(0), logsumexp.stride(1), 1),
                               logsumexp.storage_offset())
        grads = reference_backward(_bshd(grad_out_).contiguous(), _bshd(query), _bshd(key),
                                   _bshd(value), _as_kernel_reads_rows(_bshd(out)), lse,
                                   is_causal, scale)
        return (*(_bshd(g) for g in grads), None)


# --------------------------------------------------------------------------- flash-attn 2.6
def flash_attn_2_6() -> types.ModuleType:
    """flash_attn.flash_attn_interface of 2.6.x: plain functions, window_size a tuple, the
    forward's 8-tuple with q, k, v in items 1-3 and the lse in item 5."""
    mod = types.ModuleType("flash_attn.flash_attn_interface")

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, return_softmax):
        CALLS.append("fa26_fwd")
        assert alibi_slopes is None
        c, w, cap = _fa2_window(q, k, v, causal, *window_size, softcap)
        out, lse = reference_forward(q, k, v, c, softmax_scale, w, cap)
        return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic, rng_state=None):
        CALLS.append("fa26_bwd")
        DETERMINISTIC.append(deterministic)
        assert softmax_lse.is_contiguous()
        c, w, cap = _fa2_window(q, k, v, causal, *window_size, softcap)
        grads = reference_backward(dout, q, k, v, out, softmax_lse, c, softmax_scale, w, cap)
        for dst, g in zip((dq, dk, dv), grads):
            dst.copy_(g)
        return dq, dk, dv, torch.zeros(1)

    mod._flash_attn_forward = _flash_attn_forward
    mod._flash_attn_backward = _flash_attn_backward
    return mod


# --------------------------------------------------------------------------- flash-attn 2.7/2.8
@torch.library.custom_op("ec_standin_fa27::_flash_attn_forward", mutates_args=(),
                         device_types="cpu")
def _fa27_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float,
                  causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[Tensor], return_softmax: bool
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    CALLS.append("fa27_fwd")
    assert not return_softmax
    c, w, cap = _fa2_window(q, k, v, causal, window_size_left, window_size_right, softcap)
    out, lse = reference_forward(q, k, v, c, softmax_scale, w, cap)
    return out.contiguous(), lse.contiguous(), torch.empty(0), torch.zeros(2, dtype=torch.int64)


@_fa27_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, return_softmax):
    b, s, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32), q.new_empty(0),
            q.new_empty(2, dtype=torch.int64))


@torch.library.custom_op("ec_standin_fa27::_flash_attn_backward",
                         mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _fa27_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   softmax_lse: Tensor, dq: Optional[Tensor], dk: Optional[Tensor],
                   dv: Optional[Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                   window_size_left: int, window_size_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], deterministic: bool,
                   rng_state: Optional[Tensor] = None) -> Tensor:
    CALLS.append("fa27_bwd")
    DETERMINISTIC.append(deterministic)
    assert softmax_lse.is_contiguous()
    c, w, cap = _fa2_window(q, k, v, causal, window_size_left, window_size_right, softcap)
    grads = reference_backward(dout, q, k, v, out, softmax_lse, c, softmax_scale, w, cap)
    for dst, g in zip((dq, dk, dv), grads):
        dst.copy_(g)
    return torch.zeros(q.size(0), q.size(2), q.size(1))


def flash_attn_2_7() -> types.ModuleType:
    """flash_attn.flash_attn_interface of 2.7.x / 2.8.x: the module attributes are
    torch.library custom ops (registered here for the CPU)."""
    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = _fa27_forward
    mod._flash_attn_backward = _fa27_backward
    return mod


# --------------------------------------------------------------------------- flash-attn-4
def _fa4_window(causal, left, right, softcap):
    """flash_attn/cute/interface.py's _resolve_causal_local_window: None is unbounded, causal
    sets the right side to 0, left + right < 0 clears both (so a -1 for "unbounded" is wrong
    here: it reads as a real bound, or clears the window); softcap None or 0.0 is off."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        window = None
    else:
        big = 1 << 30
        window = (big if left is None else left, big if right is None else right)
        causal = False
    return causal, window, (softcap or None)


def flash_attn_4(four_tuple: bool = True) -> types.ModuleType:
    """flash_attn.cute.interface of flash-attn-4: keyword arguments, the forward returns
    (out, lse) in early betas and (out, lse, p, row_max) later."""
    mod = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                        page_table=None, softmax_scale=None, causal=False, softcap=None,
                        window_size_left=None, window_size_right=None, learnable_sink=None,
                        tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                        num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, out=None, lse=None, **kw):
        CALLS.append("fa4_fwd")
        c, w, cap = _fa4_window(causal, window_size_left, window_size_right, softcap)
        o, l = reference_forward(q, k, v, c, softmax_scale, w, cap)
        l = l if return_lse else None
        return (o, l, None, None) if four_tuple else (o, l)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64,
                        n_block_size=128, num_threads=256, pack_gqa=False, deterministic=False,
                        dq=None, dk=None, dv=None, **kw):
        CALLS.append("fa4_bwd")
        DETERMINISTIC.append(deterministic)
        assert lse.is_contiguous()
        c, w, cap = _fa4_window(causal, window_size_left, window_size_right, softcap)
        return reference_backward(dout, q, k, v, out, lse, c, softmax_scale, w, cap)

    mod._flash_attn_fwd = _flash_attn_fwd
    mod._flash_attn_bwd = _flash_attn_bwd
    return mod
