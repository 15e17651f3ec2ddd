"""Mamba-2's selective scan (SSD) over sequence shards (Bamba, Granite 4 hybrids, Nemotron-H,
Falcon-H1, Zamba2, Mamba-2 itself).

Per head the state h is (P, N) (head dim x state size), as transformers stores it
(``mamba2_chunk_scan``: ``initial_states`` (B, H, P, N)), and a token does

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t

with dt after ``dt_bias``, softplus and the clamp: a scalar decay per head and token. A piece
maps h_in to ``h_in @ T + B`` with T = a I (N, N), a = exp(sum dt A) over the piece. One
kernel call from a zero state gives y0 and B; T and the rows' reads of h_in, ``h_in @
basis_t`` (basis_t = T_t C_t), are computed from dt, A and C (a scalar decay per head: no
identity block of N extra channels through the kernel, scan.py's trick, which costs N / P
times the layer's own scan). Keeping T as a matrix costs N^2 instead of 1 per head in the
exchange; the kernel's dt handling (bias, softplus, clamp) is repeated for the decays.

``kernel`` is any function with the signature of transformers' ``mamba2_chunk_scan`` (and
mamba-ssm's ``mamba_chunk_scan_combined``): ``kernel(x, dt, A, B, C, chunk_size, D=,
dt_bias=, initial_states=, dt_softplus=, dt_limit=, return_final_states=True) -> (y, final)``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from .scan import Recurrence, Tokens, scan

Tensor = torch.Tensor


def _call(kernel: Callable, options: dict, t: Tokens, x: Tensor, initial: Tensor | None):
    return kernel(x, t["dt"], options["A"], t["B"], t["C"], options["chunk_size"],
                  initial_states=initial, return_final_states=True,
                  **{k: v for k, v in options.items() if k not in ("A", "chunk_size")})


def _run(kernel: Callable, options: dict, t: Tokens) -> tuple[Tensor, Tensor]:
    out, final = _call(kernel, options, t, t["x"], None)
    return out, final.float()


def _steps(options: dict, dt: Tensor) -> Tensor:
    """(B, L, H) float32: the time steps the kernel uses (after dt_bias, softplus, the clamp)."""
    dt = dt.float()
    if options.get("dt_bias") is not None:
        dt = dt + options["dt_bias"].float()
    if options.get("dt_softplus"):
        dt = F.softplus(dt)
    low, high = options.get("dt_limit", (0.0, float("inf")))
    return dt.clamp(min=low, max=high)


def _extended(kernel: Callable, options: dict, t: Tokens):
    """(y0, basis, B, T): one kernel call from a zero state gives y0 and B; T and basis are
    what the kernel would give the N extra zero-input channels from an identity state (the
    scan.py trick), in closed form: the decay is a scalar per head, so T = exp(A cum_L) I
    and basis_t = exp(A cum_t) C_t, cum_t = dt_1 + ... + dt_t. (Run through the kernel, those
    channels cost N / P times the layer's own scan: 32x for P = 8, N = 256.)"""
    x = t["x"]  # (B, L, H, P)
    b, length, heads, _ = x.shape
    n = t["B"].size(-1)
    out, final = _call(kernel, options, t, x, None)
    cum = _steps(options, t["dt"]).cumsum(1)  # (B, L, H)
    A = options["A"].float()  # (H,)
    c = t["C"].float()  # (B, L, G, N): each group's C serves H / G heads
    c = c.repeat_interleave(heads // c.size(2), dim=2, output_size=heads)
    # (B, L, H, N), in the kernel's output dtype as its extended channels came (memory)
    basis = (torch.exp(A * cum)[..., None] * c).to(out.dtype)
    total = cum[:, -1] if length else cum.new_zeros(b, heads)
    eye = torch.eye(n, dtype=torch.float32, device=x.device)
    a = torch.exp(A * total)[..., None, None] * eye  # (B, H, N, N)
    # float32 maps whatever the kernel's state dtype (mamba-ssm returns C's: bf16 in training)
    return out, basis, final.float(), a


def _carry(a: Tensor, s: Tensor) -> Tensor:
    return s @ a  # (B, H, P, N) @ (B, H, N, N)


def _read(basis: Tensor, s: Tensor) -> Tensor:
    return torch.einsum("blhn,bhpn->blhp", basis.float(), s)


def mamba2_recurrence(kernel: Callable, **options) -> Recurrence:
    """Mamba-2's scan run by ``kernel`` with ``options`` (A, chunk_size, D, dt_bias,
    dt_softplus, dt_limit)."""
    return Recurrence("mamba2", partial(_run, kernel, options), partial(_extended, kernel, options),
                      _carry, _read)


def mamba2_chunk_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                      chunk_size: int, D: Tensor | None = None, dt_bias: Tensor | None = None,
                      initial_states: Tensor | None = None, dt_softplus: bool = False,
                      dt_limit: tuple[float, float] = (0.0, float("inf")),
                      return_final_states: bool = False, *, kernel: Callable, group=None,
                      layout: str = "contiguous", ring_degree: int | None = None,
                      document_ids: Tensor | None = None, **kwargs):
    """``kernel``'s Mamba-2 scan on this rank's shard, exact as on the whole sequence.

    hidden_states (B, S_local, H, P), dt (B, S_local, H), A (H,), B, C (B, S_local, G, N):
    this rank's shard cut with ``layout`` over ``group``; ``document_ids`` (B, S_local)
    restarts the state at every document start. Returns y (B, S_local, H, P), and the final
    state of the whole sequence too if ``return_final_states``."""
    if initial_states is not None:
        raise ValueError("the sequence-parallel Mamba-2 scan starts from a zero state "
                         "(training); pass initial_states=None")
    for key in ("seq_idx", "cu_seqlens", "z"):  # documents come as document_ids (pieces.py)
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"sequence-parallel recurrent layers take packed documents as "
                             f"document_ids (one id per token), not {key}")
    rec = mamba2_recurrence(kernel, A=A, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                            dt_softplus=dt_softplus, dt_limit=dt_limit, **kwargs)
    out, final = scan(rec, {"x": hidden_states, "dt": dt, "B": B, "C": C}, group, layout,
                      ring_degree, document_ids, return_final_states)
    return (out, final) if return_final_states else out
