"""USP (Fang & Zhao 2024): Ulysses inside groups of neighbours, zigzag ring attention across.

The N ranks form a ``ring_degree x ulysses_degree`` grid, ``ulysses_degree = N // ring_degree``:
global rank r is ring rank ``r // ulysses_degree`` and Ulysses rank ``r % ulysses_degree``.
A Ulysses group is a run of neighbouring ranks (one node, where all-to-all is cheap); a ring
group is the ranks with the same Ulysses rank (one per node, talking point to point).

The "usp" layout (easy_context.layouts) cuts the sequence zigzag over the ring ranks, then
contiguously over the Ulysses ranks of each ring rank. So the Ulysses all-to-all inside a
group hands every member its ring rank's *whole* zigzag shard for H/U heads, and zigzag ring
attention over the ring group, on those heads, finishes the job; the reverse all-to-all
returns each rank its own tokens. Ulysses limits the heads (H % U == 0), the ring does not,
so the ring degree lets Ulysses-style speed reach world sizes beyond the head count.

ring_degree = 1 is pure Ulysses and ring_degree = N pure zigzag ring attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ring import check_qkv
from .ulysses import kv_replication, ulysses_apply, ulysses_attn
from .zigzag import zigzag_ring_attn

Tensor = torch.Tensor

# Sub-groups by their global ranks: a process creates each rank set once (creating a group
# is a collective, and gloo connections are not free).
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
# (parent's global ranks, ring_degree) -> (this rank's Ulysses group, this rank's ring group)
_GRIDS: dict[tuple[tuple[int, ...], int], tuple] = {}


def _new_group(ranks: tuple[int, ...], local: bool):
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=local)
    return _GROUPS[ranks]


def usp_groups(group: dist.ProcessGroup | None, ring_degree: int):
    """This rank's (Ulysses group, ring group) for ``group`` split with ``ring_degree``."""
    parent = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (parent, ring_degree)
    if key not in _GRIDS:
        uly = len(parent) // ring_degree
        uly_sets = [parent[i * uly:(i + 1) * uly] for i in range(ring_degree)]
        ring_sets = [parent[u::uly] for u in range(uly)]
        me = dist.get_rank()
        # When the parent is the whole world every rank runs this, so every rank creates every
        # group in the same order (what plain new_group requires). A smaller parent (say one
        # SP group of a DP x SP grid) runs only on its members: then each rank creates just
        # its own two groups, synchronizing with their members only.
        local = len(parent) != dist.get_world_size()
        mine = {}
        for kind, sets in (("uly", uly_sets), ("ring", ring_sets)):
            for ranks in sets:
                if not local or me in ranks:
                    pg = _new_group(ranks, local)
                    if me in ranks:
                        mine[kind] = pg
        _GRIDS[key] = (mine["uly"], mine["ring"])
    return _GRIDS[key]


def check_ring_degree(ring_degree: int | None, world: int) -> int:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if ring_degree is None:
        raise ValueError(f"usp_attn needs ring_degree (the number of ring ranks); with "
                         f"{world} ranks pick one of {divisors} (1: pure Ulysses, {world}: "
                         "pure zigzag ring)")
    if not isinstance(ring_degree, int) or ring_degree < 1 or world % ring_degree:
        raise ValueError(f"usp_attn: ring_degree={ring_degree!r} does not divide the "
                         f"{world} ranks; pick one of {divisors}")
    return ring_degree


def usp_attn(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
             causal: bool = True, softmax_scale: float | None = None,
             ring_degree: int | None = None) -> Tensor:
    """USP over usp-layout shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D)."""
    world = dist.get_world_size(group)
    ring_degree = check_ring_degree(ring_degree, world)
    check_qkv(q, k, v)
    if ring_degree == 1:  # the usp layout is then the contiguous one
        return ulysses_attn(q, k, v, group, causal, softmax_scale)
    if ring_degree == world:  # ... and here the zigzag one
        return zigzag_ring_attn(q, k, v, group, causal, softmax_scale)
    # Fail on the heads before creating groups: every rank sees the same shapes, so every
    # rank raises and none is left waiting in a collective.
    uly = world // ring_degree
    try:
        kv_replication(q.size(2), k.size(2), uly, "usp_attn")
    except ValueError as e:
        raise ValueError(f"{e} (here ulysses_degree = {world} // ring_degree {ring_degree} "
                         f"= {uly}; a larger ring_degree lowers it)") from None
    uly_group, ring_group = usp_groups(group, ring_degree)
    return ulysses_apply(
        q, k, v, uly_group,
        lambda qh, kh, vh: zigzag_ring_attn(qh, kh, vh, ring_group, causal, softmax_scale),
        method="usp_attn")
