"""The gated delta rule (Qwen3-Next / Qwen3.5 gated DeltaNet) over sequence shards.

Per value head the state S is (d_k, d_v), as transformers stores it
(``torch_chunk_gated_delta_rule``: ``initial_state`` (B, H_v, d_k, d_v)), and a token does

    S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

so a piece maps S_in to ``A @ S_in + B`` with A (d_k, d_k): the transition applied to the
identity. One kernel call per piece gives (o0, basis, B, A): values extended by d_k zero
columns whose initial state is the identity (scan.py). The output correction is
``basis_t @ S_in`` (basis_t = q_t^T A_t, d_k per head).

``kernel`` is any function with the signature of transformers' ``torch_chunk_gated_delta_rule``
(and flash-linear-attention's ``chunk_gated_delta_rule``): ``kernel(q, k, v, g=, beta=,
initial_state=, output_final_state=, use_qk_l2norm_in_kernel=, **kwargs) -> (out, final)``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from .scan import Recurrence, Tokens, scan

Tensor = torch.Tensor


def _run(kernel: Callable, options: dict, t: Tokens) -> tuple[Tensor, Tensor]:
    out, final = kernel(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=None,
                        output_final_state=True, **options)
    return out, final.float()


def _extended(kernel: Callable, options: dict, t: Tokens):
    v = t["v"]  # (B, L, H_v, d_v)
    b, length, heads, dv = v.shape
    dk = t["k"].size(-1)
    v_ext = torch.cat([v, v.new_zeros(b, length, heads, dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(b, heads, dk, dk)
    init = torch.cat([eye.new_zeros(b, heads, dk, dv), eye], dim=-1)  # (B, H_v, d_k, d_v + d_k)
    out, final = kernel(t["q"], t["k"], v_ext, g=t["g"], beta=t["beta"], initial_state=init,
                        output_final_state=True, **options)
    final = final.float()  # float32 maps whatever the kernel's state dtype
    return out[..., :dv], out[..., dv:], final[..., :dv], final[..., dv:]


def _carry(a: Tensor, s: Tensor) -> Tensor:
    return a @ s  # (B, H, d_k, d_k) @ (B, H, d_k, d_v)


def _read(basis: Tensor, s: Tensor) -> Tensor:
    return torch.einsum("blhk,bhkv->blhv", basis.float(), s)


def delta_rule_recurrence(kernel: Callable, **options) -> Recurrence:
    """The gated delta rule run by ``kernel`` with ``options`` (chunk_size,
    use_qk_l2norm_in_kernel, ...)."""
    return Recurrence("gated_delta_rule", partial(_run, kernel, options),
                      partial(_extended, kernel, options), _carry, _read)


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                           chunk_size: int | None = None, initial_state: Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, *, kernel: Callable,
                           group=None, layout: str = "contiguous",
                           ring_degree: int | None = None,
                           document_ids: Tensor | None = None,
                           **kwargs) -> tuple[Tensor, Tensor | None]:
    """``kernel``'s gated delta rule on this rank's shard, exact as on the whole sequence.

    query, key (B, S_local, H_k, d_k), value (B, S_local, H_v, d_v), g, beta (B, S_local,
    H_v): this rank's shard cut with ``layout`` over ``group``; ``document_ids`` (B,
    S_local) restarts the state at every document start. Returns (out (B, S_local, H_v,
    d_v), the final state of the whole sequence if ``output_final_state``). ``chunk_size``
    and other keyword arguments reach the kernel only when given."""
    if initial_state is not None:
        raise ValueError("the sequence-parallel gated delta rule starts from a zero state "
                         "(training); pass initial_state=None")
    if kwargs.pop("cu_seqlens", None) is not None:
        raise ValueError("sequence-parallel recurrent layers take packed documents as "
                         "document_ids (one id per token), not cu_seqlens")
    if chunk_size is not None:  # the kernel's own default otherwise (fla takes none)
        kwargs["chunk_size"] = chunk_size
    rec = delta_rule_recurrence(kernel, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    tokens = {"q": query, "k": key, "v": value, "g": g, "beta": beta}
    return scan(rec, tokens, group, layout, ring_degree, document_ids, output_final_state)
