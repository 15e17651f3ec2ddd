"""Sliding windows, chunked attention, soft-capping, sinks and MLA head dims in every method.

Run on each rank: the same seed builds the same whole-sequence q, k, v (v with its own head
dim), sinks and output gradient everywhere; the ground truth is float64 attention with the
mask written out, from scratch here (not the package's code); the method sees this rank's
shard in float32. Returned errors are relative to the ground truth's max |value|.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import easy_context as ec


def dense_attention(q, k, v, window=None, chunk=None, softcap=None, sinks=None, doc=None,
                    spans=()):
    """float64 causal attention of (B, S, H, D) q and (B, S, Hkv, D/Dv) k, v, mask written out;
    ``spans``: image spans (first, stop) of every row, whose tokens also see their later ones."""
    b, s, h, d = q.shape
    g = h // k.size(2)
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    x = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    keep = j <= i
    for first, stop in spans:  # a span's later keys: never out of a window (j > i)
        keep = keep | ((i >= first) & (i < stop) & (j >= first) & (j < stop))
    keep = keep.expand(b, 1, s, s)
    if window is not None:
        keep = keep & (i - j < window)
    if chunk is not None:
        keep = keep & (i // chunk == j // chunk)
    if doc is not None:
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    x = x.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        x = torch.cat([x, sinks.view(1, -1, 1, 1).expand(b, h, s, 1)], dim=-1)
    p = torch.softmax(x, dim=-1)
    p = p[..., :s] if sinks is not None else p
    return torch.einsum("bhqk,bkhd->bqhd", p.nan_to_num(0.0), v)


def cases(shard: int, length: int) -> list[dict]:
    """Windows below a shard, around it, past the sequence and of no convenient size; chunks;
    soft-capping; sinks; each with MLA-like head dims on some; documents on some."""
    return [
        dict(window=1), dict(window=3), dict(window=7, dv=6), dict(window=shard - 1),
        dict(window=shard + 3, sinks=True), dict(window=length + 5),
        dict(chunk=5), dict(chunk=shard + 1, dv=12),
        dict(softcap=2.0, window=5), dict(softcap=1.5, sinks=True, dv=6),
        dict(sinks=True), dict(window=4, docs=True, sinks=True), dict(chunk=7, docs=True),
        dict(window=shard), dict(window=shard // 2, batch=1), dict(window=2 * shard + 3, docs=True),
        dict(window=2 * shard + 1, batch=1),
        dict(window=shard + 1, batch=1, docs=True, dv=6),
    ]


def _rel(x, ref) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def check_variants(method: str, ring_degree: int | None = None, half: int = 6, seed: int = 0):
    """{case: {"out"|"dq"|"dk"|"dv"|"dsinks": error}} on this rank (sinks: summed over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    length = 2 * half * world
    shard_len = length // world
    report = {}
    for n, case in enumerate(cases(shard_len, length)):
        gen = torch.Generator().manual_seed(seed + n)
        b, hq, hkv, d = case.get("batch", 2), 4, 2, 8
        dv = case.get("dv", d)
        q, k = torch.randn(b, length, hq, d, generator=gen), torch.randn(b, length, hkv, d, generator=gen)
        v = torch.randn(b, length, hkv, dv, generator=gen)
        sinks = torch.randn(hq, generator=gen) if case.get("sinks") else None
        dout = torch.randn(b, length, hq, dv, generator=gen)
        doc = None
        if case.get("docs"):  # documents that straddle shards, one row differing
            doc = torch.zeros(b, length, dtype=torch.long)
            doc[:, length // 3:] = 1
            doc[0, length - 4:] = 2
        kw = dict(window=case.get("window"), chunk=case.get("chunk"), softcap=case.get("softcap"))
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = None if sinks is None else sinks.double().requires_grad_()
        ref = dense_attention(*ref_in, sinks=ref_sinks, doc=doc, **kw)
        ref.backward(dout.double())
        refs = {"out": ref.detach(), "dq": ref_in[0].grad, "dk": ref_in[1].grad, "dv": ref_in[2].grad}
        shard = lambda t: ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)
        sp_in = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
        sp_sinks = None if sinks is None else sinks.clone().requires_grad_()
        out = ec.sequence_parallel_attention(
            *sp_in, method=method, ring_degree=ring_degree,
            document_ids=None if doc is None else shard(doc),
            sliding_window=kw["window"], chunk_size=kw["chunk"], softcap=kw["softcap"],
            sinks=sp_sinks)
        out.backward(shard(dout))
        got = {"out": out.detach(), "dq": sp_in[0].grad, "dk": sp_in[1].grad, "dv": sp_in[2].grad}
        errors = {name: _rel(got[name], shard(refs[name])) for name in refs}
        if sinks is not None:
            dsinks = sp_sinks.grad.clone()
            if ec.get_method(method).layout != "whole":  # local: every rank holds it all
                dist.all_reduce(dsinks)  # each rank's rows' share
            errors["dsinks"] = _rel(dsinks, ref_sinks.grad)
        report[" ".join(f"{k}={v}" for k, v in case.items())] = errors
    return report


def sent_elements(method: str, window: int | None, half: int = 16, batch: int = 1,
                  ring_degree: int | None = None, spans: tuple = ()) -> dict:
    """Elements this rank hands to point-to-point sends (comm.Exchange.send) and sends in
    all-gather attention's collectives (its shard to N - 1 ranks; all of a reduce-scatter's
    input but its own part) in one forward and one backward of a layer with ``window``
    (None: global) and image ``spans`` (the same in every row), and whether it was exact
    (fp32, 1e-5 of the float64 reference's max)."""
    from easy_context.parallel import allgather, comm

    rank, world = dist.get_rank(), dist.get_world_size()
    length = 2 * half * world
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(batch, length, 2, 8, generator=gen) for _ in range(4))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*ref_in, window=window, spans=spans)
    ref.backward(dout.double())
    shard = lambda t: ec.shard_sequence(t, method, rank, world, ring_degree=ring_degree)
    sp_in = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    counts, original = [0], comm.Exchange.send

    def counting(self, tensor, to):
        counts[0] += tensor.numel()
        return original(self, tensor, to)

    gather, scatter = allgather.all_gather_into, allgather.reduce_scatter_into

    def gathering(out, inp, group=None):
        counts[0] += inp.numel() * (world - 1)
        return gather(out, inp, group=group)

    def scattering(out, inp, group=None):
        counts[0] += inp.numel() - out.numel()
        return scatter(out, inp, group=group)

    comm.Exchange.send = counting
    allgather.all_gather_into, allgather.reduce_scatter_into = gathering, scattering
    try:
        out = ec.sequence_parallel_attention(*sp_in, method=method, ring_degree=ring_degree,
                                             sliding_window=window,
                                             image_spans=(tuple(spans),) * batch if spans
                                             else None)
        forward, counts[0] = counts[0], 0
        out.backward(shard(dout))
        backward = counts[0]
    finally:
        comm.Exchange.send = original
        allgather.all_gather_into, allgather.reduce_scatter_into = gather, scatter
    errors = [_rel(out.detach(), shard(ref.detach()))] + [
        _rel(t.grad, shard(r.grad)) for t, r in zip(sp_in, ref_in)]
    return {"forward": forward, "backward": backward,
            "exact": all(e <= 1e-5 for e in errors)}


def check_latent(half: int = 6, seed: int = 0) -> dict:
    """{case: {"out"|"dq"|"dlatent"|"dW": error}} of latent_allgather_attn on this rank against
    the float64 reference that expands the whole sequence's latent itself (dW summed over
    ranks: each holds its share of the up-projection's gradient)."""
    from easy_context.parallel.latent import latent_allgather_attn

    rank, world = dist.get_rank(), dist.get_world_size()
    length = 2 * half * world
    b, h, r, rope, nope, dv = 2, 4, 6, 4, 8, 6
    report = {}
    for n, case in enumerate([{}, dict(window=3), dict(window=2 * half + 1, docs=True)]):
        gen = torch.Generator().manual_seed(seed + n)
        q = torch.randn(b, length, h, nope + rope, generator=gen)
        latent = torch.randn(b, length, r + rope, generator=gen)
        w = torch.randn(h * (nope + dv), r, generator=gen) / r ** 0.5
        dout = torch.randn(b, length, h, dv, generator=gen)
        doc = None
        if case.get("docs"):
            doc = torch.zeros(b, length, dtype=torch.long)
            doc[:, length // 3:] = 1

        def expand(lat, weight):
            kv = (lat[..., :r] @ weight.T).unflatten(-1, (h, nope + dv))
            k = torch.cat([kv[..., :nope], lat[..., None, r:].expand(*kv.shape[:3], rope)], -1)
            return k, kv[..., nope:]

        ref_in = [t.double().requires_grad_() for t in (q, latent, w)]
        ref = dense_attention(ref_in[0], *expand(ref_in[1], ref_in[2]),
                              window=case.get("window"), doc=doc)
        ref.backward(dout.double())
        shard = lambda t: ec.shard_sequence(t, "allgather_attn", rank, world)
        sq, sl = (shard(t).detach().clone().requires_grad_() for t in (q, latent))
        sw = w.clone().requires_grad_()
        out = latent_allgather_attn(sq, sl, lambda lat: expand(lat, sw),
                                    document_ids=None if doc is None else shard(doc),
                                    variant=ec.Variant(window=case.get("window")))
        out.backward(shard(dout))
        dw = sw.grad.clone()
        dist.all_reduce(dw)
        report[" ".join(f"{k}={v}" for k, v in case.items()) or "plain"] = {
            "out": _rel(out.detach(), shard(ref.detach())),
            "dq": _rel(sq.grad, shard(ref_in[0].grad)),
            "dlatent": _rel(sl.grad, shard(ref_in[1].grad)),
            "dW": _rel(dw, ref_in[2].grad)}
    return report
