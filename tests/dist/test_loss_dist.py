"""The chunked loss on 2 and 4 gloo ranks equals the single-process loss and gradients.

Each rank holds a contiguous shard of the tokens; the shards hold very different numbers of
valid targets (the last rank none at all), which is exactly where a mean of per-rank means
goes wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context.memory import chunked_cross_entropy

T_PER_RANK, H, V = 24, 16, 40


def _batch(world: int, seed: int):
    """Full tokens (same on every rank) with valid targets skewed across the rank shards."""
    g = torch.Generator().manual_seed(seed)
    T = T_PER_RANK * world
    h = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1
    y = torch.randint(0, V, (T,), generator=g)
    for r in range(1, world):  # rank 0 all valid, then fewer and fewer, the last rank none
        keep = T_PER_RANK * (world - 1 - r) // (2 * world)
        y[r * T_PER_RANK + keep:(r + 1) * T_PER_RANK] = -100
    return h, w, b, y


def _reference(h, w, b, y):
    """Single-process mean and gradients, fp32 (the dtype under test)."""
    h, w, b = (t.float().requires_grad_() for t in (h, w, b))
    loss = F.cross_entropy(F.linear(h, w, b), y)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w, b)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # A shard with no valid target has an all-zero reference gradient: compare it absolutely.
    scale = b.double().abs().max().clamp(min=1e-30)
    return ((a.double() - b.double()).abs().max() / scale).item()


def _sp_step(seed: int) -> dict:
    """Every rank: its shard's chunked loss over the world group, vs the single process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, b, y = _batch(world, seed)
    ref_loss, ref_gh, ref_gw, ref_gb = _reference(h, w, b, y)
    sl = slice(rank * T_PER_RANK, (rank + 1) * T_PER_RANK)
    hl = h[sl].float().requires_grad_()
    wl, bl = w.float().requires_grad_(), b.float().requires_grad_()
    loss = chunked_cross_entropy(hl, wl, y[sl], bl, chunk_size=7)  # group=None: the world
    loss.backward()
    # What the data-parallel gradient reduction does to parameter gradients: a SUM.
    for g in (wl.grad, bl.grad):
        dist.all_reduce(g)
    # The original EasyContext: each rank's own mean, then averaged over ranks.
    local_mean = F.cross_entropy(F.linear(hl, wl, bl), y[sl]).detach()
    dist.all_reduce(local_mean)
    return {
        "loss": _rel(loss.detach(), ref_loss),
        "grad_h": _rel(hl.grad, ref_gh[sl]),
        "grad_w": _rel(wl.grad, ref_gw),
        "grad_b": _rel(bl.grad, ref_gb),
        "mean_of_means": (local_mean / world).item(),
        "exact": ref_loss.item(),
    }


def _dp_sp_accum_step(dp: int, micro_batches: int, seed: int) -> dict:
    """dp x sp ranks, several micro-batches per replica, denominator = num_items_in_batch.

    The global batch is dp * micro_batches sequences; sequence (replica, m) is sharded over
    that replica's SP group. Summing each replica's per-micro-batch losses, and then the
    replicas' totals, must give the single-process mean over the whole batch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = world // dp
    grid = torch.arange(world).view(dp, sp)
    groups = [dist.new_group(grid[d].tolist()) for d in range(dp)]
    replica, sp_rank = rank // sp, rank % sp
    seqs = [_batch(sp, seed + i) for i in range(dp * micro_batches)]
    h = torch.cat([s[0] for s in seqs])
    y = torch.cat([s[3] for s in seqs])
    w, b = seqs[0][1], seqs[0][2]
    ref_loss, ref_gh, ref_gw, _ = _reference(h, w, b, y)
    num_items = int((y != -100).sum())  # what transformers passes: the whole step's count
    wl, bl = w.float().requires_grad_(), b.float().requires_grad_()
    total, err_h = torch.zeros(()), 0.0
    T_seq = T_PER_RANK * sp
    for m in range(micro_batches):
        i = replica * micro_batches + m
        sl = slice(i * T_seq + sp_rank * T_PER_RANK, i * T_seq + (sp_rank + 1) * T_PER_RANK)
        hl = h[sl].float().requires_grad_()
        loss = chunked_cross_entropy(hl, wl, y[sl], bl, chunk_size=5, group=groups[replica],
                                     num_items_in_batch=num_items)
        loss.backward()
        total += loss.detach()
        err_h = max(err_h, _rel(hl.grad, ref_gh[sl]))
    # Replicas' totals add up (the SP ranks of one replica hold the same value already).
    dist.all_reduce(total)
    dist.all_reduce(wl.grad)
    for g in groups:
        dist.destroy_process_group(g)
    return {"loss": _rel(total / sp, ref_loss), "grad_h": err_h, "grad_w": _rel(wl.grad, ref_gw)}


@pytest.mark.parametrize("pool_name", ["dist2", "dist4"])
def test_sp_loss_is_the_exact_global_mean(pool_name, request):
    pool = request.getfixturevalue(pool_name)
    results = pool.run(_sp_step, 0)
    for r in results:
        assert r["loss"] <= 1e-6, r
        assert r["grad_h"] <= 1e-5, r
        assert r["grad_w"] <= 1e-5 and r["grad_b"] <= 1e-5, r
    # The fix matters: the original's mean of per-rank means is NaN here (the last rank has
    # no valid target), and off by a lot even without that rank.
    assert all(torch.isnan(torch.tensor(r["mean_of_means"])) for r in results)


def _sp_step_no_empty_rank(seed: int) -> dict:
    """Like _sp_step, with every rank holding at least one valid target."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, b, y = _batch(world, seed)
    # The last rank gets one valid target, a hard one: its mean differs from the others'.
    y[-1] = F.linear(h[-1], w, b).argmin()
    ref = F.cross_entropy(F.linear(h.float(), w.float(), b.float()), y)
    sl = slice(rank * T_PER_RANK, (rank + 1) * T_PER_RANK)
    loss = chunked_cross_entropy(h[sl].float(), w.float(), y[sl], b.float())
    local_mean = F.cross_entropy(F.linear(h[sl].float(), w.float(), b.float()), y[sl])
    dist.all_reduce(local_mean)
    return {"exact": _rel(loss, ref), "mean_of_means": _rel(local_mean / world, ref)}


@pytest.mark.parametrize("pool_name", ["dist2", "dist4"])
def test_mean_of_means_is_wrong_with_uneven_targets(pool_name, request):
    for r in request.getfixturevalue(pool_name).run(_sp_step_no_empty_rank, 1):
        assert r["exact"] <= 1e-6
        assert r["mean_of_means"] > 5e-2, r


@pytest.mark.parametrize("pool_name,dp,micro_batches", [("dist2", 1, 3), ("dist4", 2, 2)])
def test_num_items_in_batch_over_dp_and_accumulation(pool_name, dp, micro_batches, request):
    pool = request.getfixturevalue(pool_name)
    for r in pool.run(_dp_sp_accum_step, dp, micro_batches, 2):
        assert r["loss"] <= 1e-6, r
        assert r["grad_h"] <= 1e-5 and r["grad_w"] <= 1e-5, r
