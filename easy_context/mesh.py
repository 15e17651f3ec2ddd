"""The data-parallel x sequence-parallel process grid, validated up front.

    grid = torch.arange(world).view(dp, sp)

Row i of the grid is one sequence-parallel group (sp neighbouring ranks, which share one
sample and split its tokens); column j is one data-parallel group (the ranks at the same
position of each sequence, which see different samples). Neighbouring ranks are on the same
node, where the sequence-parallel traffic is heaviest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelMesh:
    world: int
    rank: int
    dp: int
    sp: int
    dp_rank: int
    sp_rank: int
    sp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    def describe(self) -> str:
        return (f"world {self.world} = dp {self.dp} x sp {self.sp}; rank {self.rank} is "
                f"dp rank {self.dp_rank}, sp rank {self.sp_rank}")


def check_mesh(world: int, sp: int) -> int:
    """Return dp, or raise a ValueError that says what to change."""
    if sp < 1:
        raise ValueError(f"--sp-size must be >= 1, got {sp}")
    if world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"world size {world} is not divisible by --sp-size {sp}; "
                         f"choose --sp-size among {divisors}")
    return world // sp


def build_mesh(sp: int) -> ParallelMesh:
    """Create the sp and dp groups (every rank must call this, in the same order)."""
    if not dist.is_initialized():
        check_mesh(1, sp)
        return ParallelMesh(1, 0, 1, 1, 0, 0, None, None)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_mesh(world, sp)
    grid = torch.arange(world).view(dp, sp)
    sp_group = dp_group = None
    # new_group is collective: every rank creates every group, and keeps its own.
    for row in grid.tolist():
        g = dist.new_group(row)
        if rank in row:
            sp_group = g
    for col in grid.t().tolist():
        g = dist.new_group(col)
        if rank in col:
            dp_group = g
    dp_rank, sp_rank = divmod(rank, sp)
    return ParallelMesh(world, rank, dp, sp, dp_rank, sp_rank, sp_group, dp_group)
