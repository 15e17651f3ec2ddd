"""Mamba-1's selective scan (Jamba's Mamba layers) over sequence shards.

Per channel d (of D = d_inner) the state h is (N,), as transformers stores it
(``mamba_selective_scan``: ``ssm_state`` (B, D, N)), and a token does

    h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t,   y_t = (h_t . C_t + D x_t) silu(z_t)

with dt after ``delta_bias`` and softplus: a decay per channel *and* state entry (A is
(D, N)), elementwise. So a piece maps h_in to ``a * h_in + b`` with a = exp(A cum_L), cum_t
= dt_1 + ... + dt_t over the piece's rows: a (B, D, N), the size of the state.

Unlike the chunked kernels (delta_rule.py, mamba2.py), the selective-scan kernels take no
initial state (transformers' torch path and mamba-ssm's ``selective_scan_fn`` both start from
zeros), so the identity-block trick of scan.py is not available, and mamba-ssm's last state
carries no gradient ("the gradient of the last state is not considered in the backward
pass"), so the piece's offset b cannot come from the kernel either. One kernel call per
piece gives the outputs from a zero state; the rest is computed here from the tokens: b =
sum_t exp(A (dt_{t+1} + ... + dt_L)) dt_t x_t B_t, ``a``, and each row's read of an incoming
state,

    y_t += silu(z_t) sum_n exp(A_dn cum_td) h_in,dn C_tn,

so ``basis`` is [cum, C, silu(z)] per row, (B, L, D + N (+ D)): a zero row reads nothing
(a later document inside a piece, scan.piece_map). The read and b need exp(A x) per row,
channel and state entry: computed in blocks of ROWS rows, each recomputed in backward, so that
(ROWS, D, N) at a time is held, not the (L, D, N) transformers' torch path holds.

``kernel`` is any function with the signature of transformers' ``mamba_selective_scan`` (and
mamba-ssm's ``selective_scan_fn``): ``kernel(u, delta, A, B, C, D=, z=, delta_bias=,
delta_softplus=, return_last_state=False) -> out``, with u, delta, z (B, D, L)
and B, C (B, N, L), channel-major.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .scan import Recurrence, Tokens, scan

Tensor = torch.Tensor
ROWS = 256  # rows per block of the (rows, D, N) decays below (recomputed in backward)


def _by_rows(fn: Callable, length: int, rows: list[Tensor], *shared: Tensor) -> list[Tensor]:
    """fn(*row blocks of ``rows`` (dim 1), *shared) for blocks of ROWS rows, each recomputed in
    backward (checkpointed): the (rows, D, N) decays never outlive their block."""
    out = []
    for lo in range(0, length, ROWS):
        block = [r[:, lo:lo + ROWS] for r in rows]
        if torch.is_grad_enabled() and any(x.requires_grad for x in (*block, *shared)):
            out.append(checkpoint(fn, *block, *shared, use_reentrant=False))
        else:
            out.append(fn(*block, *shared))
    return out


def _channels_last(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.transpose(1, 2)


def _steps(options: dict, delta: Tensor) -> Tensor:
    """(B, L, D) the time steps the kernel uses: after delta_bias and softplus, float32."""
    dt = delta.float()
    if options["delta_bias"] is not None:
        dt = dt + options["delta_bias"].float()
    return F.softplus(dt) if options["delta_softplus"] else dt


def _final(options: dict, t: Tokens, dt: Tensor) -> Tensor:
    """(B, D, N) the state after the rows from a zero state: sum_t exp(A rest_t) dt_t u_t B_t,
    rest_t = dt_{t+1} + ... + dt_L summed from the end (no difference of large sums)."""
    rest = dt.flip(1).cumsum(1).flip(1)[:, 1:]  # (B, L-1, D)
    rest = torch.cat([rest, torch.zeros_like(dt[:, :1])], 1)
    parts = _by_rows(_final_rows, dt.size(1), [rest, dt * t["u"].float(), t["B"].float()],
                     options["A"])
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def _final_rows(rest: Tensor, dtu: Tensor, b: Tensor, A: Tensor) -> Tensor:
    decay = torch.exp(A.float() * rest[..., None])  # (B, rows, D, N)
    return torch.einsum("bldn,bld,bln->bdn", decay, dtu, b)


def _output(kernel: Callable, options: dict, t: Tokens) -> Tensor:
    # tokens are row-major (B, L, ...) for the scan; the kernel takes (B, D, L) / (B, N, L)
    out = kernel(t["u"].transpose(1, 2), t["delta"].transpose(1, 2), options["A"],
                 t["B"].transpose(1, 2), t["C"].transpose(1, 2), D=options["D"],
                 z=_channels_last(t.get("z")), delta_bias=options["delta_bias"],
                 delta_softplus=options["delta_softplus"], return_last_state=False,
                 **options["extra"])
    return out.transpose(1, 2)  # (B, L, D)


def _run(kernel: Callable, options: dict, t: Tokens) -> tuple[Tensor, Tensor]:
    return _output(kernel, options, t), _final(options, t, _steps(options, t["delta"]))


def _extended(kernel: Callable, options: dict, t: Tokens):
    dt = _steps(options, t["delta"])  # (B, L, D)
    cum = dt.cumsum(1)
    a = torch.exp(options["A"].float() * cum[:, -1, :, None])  # (B, D, N)
    parts = [cum, t["C"].float()]
    if t.get("z") is not None:
        parts.append(F.silu(t["z"].float()))
    return _output(kernel, options, t), torch.cat(parts, -1), _final(options, t, dt), a


def _carry(a: Tensor, s: Tensor) -> Tensor:
    return a * s  # (B, D, N), elementwise


def _read(A: Tensor, gated: bool, basis: Tensor, s: Tensor) -> Tensor:
    d, n = A.shape
    cum, c = basis[..., :d], basis[..., d:d + n]  # (B, L, D), (B, L, N)
    y = torch.cat(_by_rows(_read_rows, basis.size(1), [cum, c], s, A), 1)
    return y * basis[..., d + n:] if gated else y


def _read_rows(cum: Tensor, c: Tensor, s: Tensor, A: Tensor) -> Tensor:
    decay = torch.exp(A.float() * cum[..., None])  # (B, rows, D, N)
    return torch.einsum("bldn,bdn,bln->bld", decay, s, c)


def selective_scan_recurrence(kernel: Callable, A: Tensor, D: Tensor | None = None,
                              delta_bias: Tensor | None = None, delta_softplus: bool = False,
                              gated: bool = False, **extra) -> Recurrence:
    """Mamba-1's scan run by ``kernel``; ``gated``: the tokens carry z. ``extra`` reaches
    the kernel as it is (transformers' use_mambapy, ...)."""
    options = dict(A=A, D=D, delta_bias=delta_bias, delta_softplus=delta_softplus, extra=extra)
    return Recurrence("selective_scan", partial(_run, kernel, options),
                      partial(_extended, kernel, options), _carry, partial(_read, A, gated))


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None, z: Tensor | None = None,
                   delta_bias: Tensor | None = None, delta_softplus: bool = False,
                   return_last_state: bool = False, *, kernel: Callable, group=None,
                   layout: str = "contiguous", ring_degree: int | None = None,
                   document_ids: Tensor | None = None, **kwargs):
    """``kernel``'s selective scan on this rank's shard, exact as on the whole sequence.

    u, delta, z (B, D, S_local), A (D, N), B, C (B, N, S_local): this rank's shard cut with
    ``layout`` over ``group``; ``document_ids`` (B, S_local) restarts the state at every
    document start. Returns out (B, D, S_local), and the state after the whole sequence
    (B, D, N) too if ``return_last_state``."""
    if kwargs.pop("initial_state", None) is not None:
        raise ValueError("the sequence-parallel selective scan starts from a zero state "
                         "(training); pass no initial state")
    if B.dim() != 3 or C.dim() != 3:
        raise ValueError("the sequence-parallel selective scan takes B and C of shape "
                         "(batch, state, length); grouped (batch, groups, state, length) B and "
                         "C are not supported")
    for key in ("cu_seqlens", "seq_idx"):  # documents come as document_ids (pieces.py)
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"sequence-parallel recurrent layers take packed documents as "
                             f"document_ids (one id per token), not {key}")
    rec = selective_scan_recurrence(kernel, A, D, delta_bias, delta_softplus, z is not None,
                                    **kwargs)
    tokens = {"u": u.transpose(1, 2), "delta": delta.transpose(1, 2), "B": B.transpose(1, 2),
              "C": C.transpose(1, 2)}
    if z is not None:
        tokens["z"] = z.transpose(1, 2)
    out, last = scan(rec, tokens, group, layout, ring_degree, document_ids, return_last_state)
    out = out.transpose(1, 2)  # (B, D, S_local)
    return (out, last) if return_last_state else out
