"""The process grid, built once as one DeviceMesh and passed down.

    grid = torch.arange(world).view(dp, ring, ulysses)        # sp = ring x ulysses

Ranks that differ only in their (ring, ulysses) coordinates share one sequence and split its
tokens (a sequence-parallel group: neighbouring ranks, on one node where its traffic is
heaviest); ranks that differ only in dp see different samples. Inside a sequence-parallel
group, Ulysses groups are runs of neighbours and ring groups stride over them, as USP wants
(easy_context.parallel.usp); every other method uses the whole group (ring = sp,
ulysses = 1).

Nothing here is global: :func:`build_mesh` returns a :class:`ParallelMesh` that callers pass
down (``mesh.sp`` to the attention, ``mesh.dp_group`` to the data loader, ``mesh.shard_mesh``
to FSDP). For a bare process group (the library's standalone API, e.g.
``sequence_parallel_attention(..., "usp_attn", group=pg, ring_degree=2)``),
:func:`usp_groups` derives the ring and Ulysses groups and keeps them only as long as the
process group they were made from lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class SPGroup:
    """The ranks that share one sequence, and their ring x Ulysses split."""

    group: ProcessGroup | None  # every rank of the sequence (None: the world)
    ring: ProcessGroup | None
    ulysses: ProcessGroup | None
    ring_degree: int
    size: int

    @property
    def ulysses_degree(self) -> int:
        return self.size // self.ring_degree


def process_group(group) -> ProcessGroup | None:
    """The plain process group behind ``group`` (an SPGroup, a ProcessGroup or None)."""
    return group.group if isinstance(group, SPGroup) else group


def group_size(group) -> int:
    if isinstance(group, SPGroup):
        return group.size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def check_mesh(world: int, sp: int, ring_degree: int | None = None) -> int:
    """Return dp, or raise a ValueError that says what to change."""
    if sp < 1:
        raise ValueError(f"--sp-size must be >= 1, got {sp}")
    if world % sp:
        raise ValueError(f"world size {world} is not divisible by --sp-size {sp}; "
                         f"choose --sp-size among {_divisors(world)}")
    if ring_degree is not None and (ring_degree < 1 or sp % ring_degree):
        raise ValueError(f"--ring-degree {ring_degree} does not divide the sequence-parallel "
                         f"size {sp}; choose one of {_divisors(sp)}")
    return world // sp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelMesh:
    world: int
    rank: int
    dp: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    sp: SPGroup
    dp_group: ProcessGroup | None
    device_mesh: object | None  # torch DeviceMesh (dp, ring, ulysses); None in one process

    @property
    def shard_mesh(self):
        """The 1-D mesh over every rank, for parameter sharding (FSDP2)."""
        return None if self.device_mesh is None else self.device_mesh._flatten("dp_sp")

    def describe(self) -> str:
        return (f"world {self.world} = dp {self.dp} x sp {self.sp_size} (ring "
                f"{self.sp.ring_degree} x ulysses {self.sp.ulysses_degree}); rank {self.rank} "
                f"is dp rank {self.dp_rank}, sp rank {self.sp_rank}")


def build_mesh(sp: int, ring_degree: int | None = None, device_type: str = "cpu") -> ParallelMesh:
    """The dp x sp grid of the initialised world (every rank must call this, in the same
    order). ``ring_degree``: USP's ring ranks per sequence (default: sp, a pure ring)."""
    ring = ring_degree or sp
    if not dist.is_initialized():
        check_mesh(1, sp, ring_degree)
        return ParallelMesh(1, 0, 1, 1, 0, 0, SPGroup(None, None, None, 1, 1), None, None)
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_mesh(world, sp, ring_degree)
    mesh = init_device_mesh(device_type, (dp, ring, sp // ring),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    sp_group = SPGroup(mesh["ring", "ulysses"]._flatten("sp").get_group(),
                       mesh["ring"].get_group(), mesh["ulysses"].get_group(), ring, sp)
    return ParallelMesh(world, rank, dp, sp, rank // sp, rank % sp, sp_group,
                        mesh["dp"].get_group(), mesh)


# (parent's global ranks, ring_degree) -> (the default group it was made under, SPGroup)
_DERIVED: dict[tuple[tuple[int, ...], int], tuple[object, SPGroup]] = {}


def forget_groups() -> None:
    """Drop the remembered derived groups (launch.teardown: once the world is destroyed they
    are dead, and holding them would keep their native threads alive until exit)."""
    _DERIVED.clear()


def usp_groups(group, ring_degree: int) -> SPGroup:
    """``group`` split into ring x Ulysses groups (an SPGroup with that ring degree is
    returned as it is). Collective over ``group``'s ranks the first time.

    Derived groups are remembered with the default process group they were created under:
    once that is destroyed (a launcher tears the world down between recipe stages) they are
    made anew, never reused from a dead world.
    """
    if isinstance(group, SPGroup):
        if group.ring_degree == ring_degree:
            return group
        group = group.group
    world_pg = dist.group.WORLD
    parent = tuple(dist.get_process_group_ranks(group or world_pg))
    key = (parent, ring_degree)
    cached = _DERIVED.get(key)
    if cached is not None and cached[0] is world_pg:
        return cached[1]
    uly = len(parent) // ring_degree
    uly_sets = [parent[i * uly:(i + 1) * uly] for i in range(ring_degree)]
    ring_sets = [parent[u::uly] for u in range(uly)]
    me = dist.get_rank()
    # When the parent is the whole world every rank runs this, so every rank creates every
    # group in the same order (what plain new_group requires). A smaller parent (one SP group
    # of a DP x SP grid) runs only on its members: each creates just its own two groups,
    # synchronizing with their members only.
    local = len(parent) != dist.get_world_size()
    mine = {}
    for kind, sets in (("ulysses", uly_sets), ("ring", ring_sets)):
        for ranks in sets:
            if not local or me in ranks:
                pg = dist.new_group(list(ranks), use_local_synchronization=local)
                if me in ranks:
                    mine[kind] = pg
    derived = SPGroup(group, mine["ring"], mine["ulysses"], ring_degree, len(parent))
    _DERIVED[key] = (world_pg, derived)
    return derived
