"""Recurrent layers over sequence shards against one process on the whole sequence.

Each rank builds the same full inputs from one seed, runs transformers' torch kernel on the
whole sequence (on each document separately when packed: what a kernel given cu_seqlens
does), shards inputs with the layout code, runs the distributed version on its shard, and
compares its shard of the output and of every input's gradient (parameters: summed over the
ranks) with the reference's. Errors are max |x - ref| / max |ref|, NaN-safe.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context import layouts

QUIET = dict(category=UserWarning)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(x).all()):
        return float("nan")
    x, ref = x.detach(), ref.detach()
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def document_ids(batch: int, length: int) -> torch.Tensor:
    """Row 0: documents starting at 0, 1, 3, mid-sequence and 2 before the end (many cross
    shard boundaries); row 1: ids that return to earlier values (0, 1, 0, 2)."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for i, s in enumerate(sorted({1, 3, length // 2, length // 2 + 1, length - 2})):
        if 0 < s < length:
            ids[0, s:] = i + 1
    if batch > 1:
        q = max(1, length // 4)
        ids[1, q:2 * q], ids[1, 2 * q:3 * q], ids[1, 3 * q:] = 1, 0, 2
    return ids


def per_document(fn, tokens: dict, ids: torch.Tensor | None, cat_dim: int = 1):
    """fn(tokens) on each document (stretch of equal ids) of each row, concatenated."""
    if ids is None:
        return fn(tokens)
    rows = []
    for b in range(ids.size(0)):
        cuts = [0] + [i for i in range(1, ids.size(1)) if ids[b, i] != ids[b, i - 1]] + [ids.size(1)]
        parts = []
        for lo, hi in zip(cuts, cuts[1:]):
            sl = [slice(b, b + 1)] + [slice(None)] * (cat_dim - 1) + [slice(lo, hi)]
            parts.append(fn({k: t[tuple(sl)] for k, t in tokens.items()}))
        rows.append(torch.cat(parts, cat_dim))
    return torch.cat(rows, 0)


def _compare(layout, ring_degree, full: dict, params: dict, reference, distributed, seq_dim=1,
             documents=False, seed=0):
    """full: per-token inputs (B, L, ...) along seq_dim; params: replicated inputs.
    reference(tokens, params, ids) -> out on the whole sequence; distributed(tokens, params,
    ids) -> out on the shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, length = next(iter(full.values())).shape[:2] if seq_dim == 1 else \
        (next(iter(full.values())).shape[0], next(iter(full.values())).shape[seq_dim])
    ids = document_ids(batch, length) if documents else None
    gen = torch.Generator().manual_seed(seed + 1)
    ref_in = {k: t.clone().requires_grad_() for k, t in full.items()}
    ref_p = {k: t.clone().requires_grad_() for k, t in params.items()}
    ref_out = reference(ref_in, ref_p, ids)
    dout = torch.randn(ref_out.shape, generator=gen)
    ref_out.backward(dout)

    def shard(t, dim=seq_dim):
        return layouts.shard(t, layout, rank, world, dim=dim, ring_degree=ring_degree)

    sp_in = {k: shard(t).detach().clone().requires_grad_() for k, t in full.items()}
    sp_p = {k: t.clone().requires_grad_() for k, t in params.items()}
    out = distributed(sp_in, sp_p, None if ids is None else shard(ids, 1))
    out.backward(shard(dout))
    errs = {"out": _rel(out, shard(ref_out.detach()))}
    for k in full:
        errs[f"d{k}"] = _rel(sp_in[k].grad, shard(ref_in[k].grad))
    for k in params:
        grad = sp_p[k].grad.clone()
        dist.all_reduce(grad)
        errs[f"d{k}"] = _rel(grad, ref_p[k].grad)
    return errs


def check_delta_rule(layout: str, ring_degree: int | None, piece: int, chunk_size: int,
                     documents: bool, seed: int = 0, kda: bool = False) -> dict:
    """``kda``: Kimi Linear's KDA (a gate per key channel, g (B, L, H, d_k), one head count)
    through transformers' chunk_kimi_delta_attention."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as kernel

    from easy_context.recurrent.delta_rule import chunk_gated_delta_rule

    world = dist.get_world_size()
    length = layouts.required_multiple(layout, world, ring_degree) * piece
    b, hk, hv, dk, dv = 2, 2, 4, 8, 8  # grouped values: 2 value heads per key head
    if kda:
        kernel, hk = chunk_kimi_delta_attention, hv  # noqa: F811
    gen = torch.Generator().manual_seed(seed)
    full = {"q": torch.randn(b, length, hk, dk, generator=gen),
            "k": torch.randn(b, length, hk, dk, generator=gen),
            "v": torch.randn(b, length, hv, dv, generator=gen),
            "g": -torch.rand(b, length, hv, *([dk] if kda else []), generator=gen) * 0.5,
            "beta": torch.rand(b, length, hv, generator=gen)}
    opts = dict(chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)

    def one(t):
        return kernel(t["q"], t["k"], t["v"], t["g"], t["beta"], **opts)[0]

    def reference(t, p, ids):
        return per_document(one, t, ids)

    def distributed(t, p, ids):
        return chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **opts,
                                      kernel=kernel, layout=layout, ring_degree=ring_degree,
                                      document_ids=ids)[0]

    return _compare(layout, ring_degree, full, {}, reference, distributed, documents=documents,
                    seed=seed)


def check_mamba2(layout: str, ring_degree: int | None, piece: int, chunk_size: int,
                 documents: bool, seed: int = 0) -> dict:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan as kernel

    from easy_context.recurrent.mamba2 import mamba2_chunk_scan

    world = dist.get_world_size()
    length = layouts.required_multiple(layout, world, ring_degree) * piece
    b, h, p, g, n = 2, 4, 6, 2, 8
    gen = torch.Generator().manual_seed(seed)
    full = {"x": torch.randn(b, length, h, p, generator=gen),
            "dt": torch.randn(b, length, h, generator=gen),
            "B": torch.randn(b, length, g, n, generator=gen),
            "C": torch.randn(b, length, g, n, generator=gen)}
    params = {"A": -torch.rand(h, generator=gen) - 0.5, "D": torch.randn(h, generator=gen),
              "dt_bias": torch.randn(h, generator=gen)}
    opts = dict(dt_softplus=True, dt_limit=(0.0, 4.0))

    def reference(t, prm, ids):
        return per_document(lambda s: kernel(s["x"], s["dt"], prm["A"], s["B"], s["C"], chunk_size,
                                             D=prm["D"], dt_bias=prm["dt_bias"], **opts), t, ids)

    def distributed(t, prm, ids):
        return mamba2_chunk_scan(t["x"], t["dt"], prm["A"], t["B"], t["C"], chunk_size,
                                 D=prm["D"], dt_bias=prm["dt_bias"], **opts, kernel=kernel,
                                 layout=layout, ring_degree=ring_degree, document_ids=ids)

    return _compare(layout, ring_degree, full, params, reference, distributed,
                    documents=documents, seed=seed)


def check_conv(layout: str, ring_degree: int | None, piece: int, kernel_size: int,
               documents: bool, seed: int = 0, standin: bool = False) -> dict:
    """``standin``: the kernel is the stand-in with causal-conv1d's signature (documents take
    the torch path whatever the kernel)."""
    from easy_context.recurrent.conv import causal_conv1d
    from tests.unit.recurrent_standins import causal_conv1d_fn

    world = dist.get_world_size()
    length = layouts.required_multiple(layout, world, ring_degree) * piece
    b, c = 2, 6
    gen = torch.Generator().manual_seed(seed)
    full = {"x": torch.randn(b, c, length, generator=gen)}
    params = {"w": torch.randn(c, kernel_size, generator=gen), "bias": torch.randn(c, generator=gen)}

    def one(w, bias):
        return lambda s: F.silu(F.conv1d(s["x"], w.unsqueeze(1), bias, padding=kernel_size - 1,
                                         groups=c)[..., :s["x"].size(-1)])

    def reference(t, p, ids):
        return per_document(one(p["w"], p["bias"]), t, ids, cat_dim=2)

    def distributed(t, p, ids):
        return causal_conv1d(t["x"], p["w"], p["bias"], "silu", layout=layout,
                             ring_degree=ring_degree, document_ids=ids,
                             kernel=causal_conv1d_fn if standin else None)

    return _compare(layout, ring_degree, full, params, reference, distributed, seq_dim=2,
                    documents=documents, seed=seed)


def check_selective_scan(layout: str, ring_degree: int | None, piece: int, documents: bool,
                         seed: int = 0, standin: bool = False) -> dict:
    """Mamba-1 (Jamba): inputs channel-major, (B, D, L) and (B, N, L); ``standin``: through
    the stand-in with mamba-ssm's signature (its last state carries no gradient)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan as kernel

    from easy_context.recurrent.selective_scan import selective_scan

    if standin:
        from tests.unit.recurrent_standins import selective_scan_fn as kernel  # noqa: F811

    world = dist.get_world_size()
    length = layouts.required_multiple(layout, world, ring_degree) * piece
    b, d, n = 2, 6, 4
    gen = torch.Generator().manual_seed(seed)
    full = {"u": torch.randn(b, d, length, generator=gen),
            "delta": torch.randn(b, d, length, generator=gen),
            "B": torch.randn(b, n, length, generator=gen),
            "C": torch.randn(b, n, length, generator=gen),
            "z": torch.randn(b, d, length, generator=gen)}
    params = {"A": -torch.rand(d, n, generator=gen) - 0.2, "D": torch.randn(d, generator=gen),
              "delta_bias": torch.randn(d, generator=gen)}

    def reference(t, prm, ids):
        return per_document(lambda s: kernel(s["u"], s["delta"], prm["A"], s["B"], s["C"],
                                             D=prm["D"], z=s["z"], delta_bias=prm["delta_bias"],
                                             delta_softplus=True), t, ids, cat_dim=2)

    def distributed(t, prm, ids):
        return selective_scan(t["u"], t["delta"], prm["A"], t["B"], t["C"], D=prm["D"],
                              z=t["z"], delta_bias=prm["delta_bias"], delta_softplus=True,
                              kernel=kernel, layout=layout, ring_degree=ring_degree,
                              document_ids=ids)

    return _compare(layout, ring_degree, full, params, reference, distributed, seq_dim=2,
                    documents=documents, seed=seed)
