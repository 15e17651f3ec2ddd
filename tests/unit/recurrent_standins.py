"""CPU stand-ins with the signatures of the CUDA packages' recurrent kernels, to test our side
of each call contract: flash-linear-attention's ``chunk_gated_delta_rule`` (fla/ops/
gated_delta_rule/chunk.py: no chunk_size, no **kwargs, ``scale`` None = d_k^-0.5, state
(B, H, K, V)) and mamba-ssm's ``mamba_chunk_scan_combined`` (mamba_ssm/ops/triton/
ssd_combined.py: state (B, H, P, N); ``(out, final)`` with return_final_states). Each computes
with transformers' torch path and refuses what the real one does not take."""

from __future__ import annotations

import torch

CALLS: list[str] = []


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, head_first=False):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    assert scale is None and cu_seqlens is None and not head_first
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
                              return_final_states=False, return_varlen_states=False):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    assert z is None and seq_idx is None and cu_seqlens is None and not return_varlen_states
    if initial_states is not None:
        assert initial_states.shape == (x.size(0), x.size(2), x.size(3), B.size(-1))
    CALLS.append("mamba_ssm")
    return mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                             initial_states=initial_states, dt_softplus=dt_softplus,
                             dt_limit=dt_limit, return_final_states=return_final_states)


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
