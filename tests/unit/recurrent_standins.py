"""CPU stand-ins with the signatures of the CUDA packages' recurrent kernels, to test our side
of each call contract. Each computes with transformers' torch path and refuses what the real
one does not take (checked against the packages' sources):

- flash-linear-attention's ``chunk_gated_delta_rule`` (fla/ops/gated_delta_rule/chunk.py: no
  chunk_size, no **kwargs, ``scale`` None = d_k^-0.5, (B, T, H, .) layout, state (N, H, K, V)
  float32 out, q/k/v of one dtype (bf16/fp16 there: it refuses float32, which these CPU
  tests use), beta (B, T, H), ``cu_seqlens`` only with batch 1) and ``chunk_kda``
  (fla/ops/kda/chunk.py: the same with g (B, T, H, K), **kwargs, state (N, H, K, V) unless
  ``state_v_first``);
- mamba-ssm's ``mamba_chunk_scan_combined`` (mamba_ssm/ops/triton/ssd_combined.py: state
  (B, H, P, N), returned in C's dtype unless ``state_dtype``; ``(out, final)`` with
  return_final_states, whose gradient the backward takes) and ``selective_scan_fn``
  (mamba_ssm/ops/selective_scan_interface.py: (B, D, L) layout, no initial state, the last
  state's gradient dropped);
- causal-conv1d's ``causal_conv1d_fn`` (causal_conv1d/causal_conv1d_interface.py: x (B, D, L),
  weight (D, W) with 2 <= W <= 4, activation None / "silu" / "swish"; ``seq_idx`` and
  ``initial_states`` only channel-last)."""

from __future__ import annotations

import torch

CALLS: list[str] = []


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, head_first=False):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    assert scale is None and cu_seqlens is None and not head_first
    assert q.dtype == k.dtype == v.dtype and beta.dim() == 3
    if initial_state is not None:  # fla keeps the state in float32, (N, H, K, V)
        assert initial_state.dtype == torch.float32
        assert initial_state.shape == (q.size(0), v.size(2), k.size(-1), v.size(-1))
    CALLS.append("fla")
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False,
                              state_dtype=None):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    assert z is None and seq_idx is None and cu_seqlens is None and not return_varlen_states
    if initial_states is not None:
        assert initial_states.shape == (x.size(0), x.size(2), x.size(3), B.size(-1))
    CALLS.append("mamba_ssm")
    out = mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, return_final_states=return_final_states)
    if not return_final_states:
        return out
    return out[0], out[1].to(state_dtype or C.dtype)  # the real one's final-state dtype


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, cu_seqlens=None):
    """mamba-ssm's (mamba_ssm/ops/selective_scan_interface.py): u, delta, z (B, D, L), A (D, N),
    B, C (B, N, L) or (B, G, N, L); ``(out, last_state (B, D, N))`` with return_last_state,
    whose gradient the real backward drops (detached here, as there)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    assert cu_seqlens is None
    assert u.dim() == 3 and delta.shape == u.shape and A.shape == (u.size(1), B.size(-2))
    assert B.shape == (u.size(0), A.size(1), u.size(2)) and C.shape == B.shape
    assert z is None or z.shape == u.shape
    CALLS.append("mamba_ssm selective_scan")
    out = mamba_selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                               delta_softplus=delta_softplus, return_last_state=return_last_state)
    return (out[0], out[1].detach()) if return_last_state else out


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, **kwargs):
    """fla's (fla/ops/kda/chunk.py): g (B, T, H, K) already the log decay (use_gate_in_kernel
    False), state (N, H, K, V)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    assert scale is None and cu_seqlens is None and cp_context is None
    assert not (use_gate_in_kernel or use_beta_sigmoid_in_kernel or state_v_first
                or return_intermediate_states)
    assert "chunk_size" not in kwargs  # transformers' wrapper passes fla no chunk_size
    assert q.dtype == k.dtype == v.dtype and g.shape == k.shape and beta.dim() == 3
    if initial_state is not None:
        assert initial_state.shape == (q.size(0), v.size(2), k.size(-1), v.size(-1))
    CALLS.append("fla kda")
    return chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    """causal-conv1d's: x (B, D, L), weight (D, W), bias (D,) of weight's dtype."""
    from transformers.models.jamba.modeling_jamba import causal_conv1d_fn as torch_conv

    assert activation in (None, "silu", "swish")
    assert x.dim() == 3 and weight.shape == (x.size(1), weight.size(-1))
    assert 2 <= weight.size(-1) <= 4, "causal_conv1d only supports width between 2 and 4"
    assert bias is None or (bias.shape == (x.size(1),) and bias.dtype == weight.dtype)
    assert x.stride(2) == 1 or x.stride(1) == 1
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    assert (seq_idx is None and initial_states is None) or channel_last
    assert seq_idx is None and initial_states is None and not return_final_states  # unused here
    CALLS.append("causal_conv1d")
    return torch_conv(x, weight, bias, activation=activation)
