"""The process grid: one DeviceMesh (dp, ring, ulysses), its groups, and derived USP groups
that never outlive the world they were made in."""

import datetime

import pytest
import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.mesh import usp_groups
from easy_context.testing import free_port

from .attention_cases import check_method


def mesh_ranks(sp: int, ring_degree: int | None):
    mesh = ec.build_mesh(sp, ring_degree)
    ranks = dist.get_process_group_ranks
    return {"sp": ranks(mesh.sp.group), "ring": ranks(mesh.sp.ring),
            "ulysses": ranks(mesh.sp.ulysses), "dp": ranks(mesh.dp_group),
            "coords": (mesh.dp_rank, mesh.sp_rank), "shard_mesh": mesh.shard_mesh.size()}


def test_mesh_groups_on_4_ranks(dist4):
    # dp 2 x sp 2: neighbours share a sequence
    got = dist4.run(mesh_ranks, 2, None)
    assert [g["sp"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["ring"] for g in got] == [g["sp"] for g in got]  # no usp: the ring is the group
    assert [g["coords"] for g in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(g["shard_mesh"] == 4 for g in got)
    # sp 4 = ring 2 x ulysses 2: Ulysses groups are runs of neighbours, rings stride over them
    got = dist4.run(mesh_ranks, 4, 2)
    assert [g["ulysses"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["ring"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def restart_world_between_usp_runs():
    """What torchrun does between recipe stages: the world is destroyed and made anew in the
    same process. USP groups derived from the first world must not be used in the second."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [((1, 2, 8, 2, 16), True, torch.float32)]
    first = check_method("usp_attn", 2, cases)
    before = usp_groups(None, 2)
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port[0]}",
                            timeout=datetime.timedelta(seconds=60))
    second = check_method("usp_attn", 2, cases)
    after = usp_groups(None, 2)
    return first, second, before.ring is not after.ring


def deepspeed_after_the_world_is_restarted():
    """DeepSpeed's cached clone of the world (made by a ZeRO engine's broadcast) outlives a
    world restarted with torch.distributed: the next engine's start must not use it."""
    from deepspeed.utils import groups

    from easy_context.train.engines.deepspeed import _start_deepspeed_comm

    rank, world = dist.get_rank(), dist.get_world_size()
    _start_deepspeed_comm()
    groups._get_broadcast_src_rank()  # caches DeepSpeed's clone of this world
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port[0]}",
                            timeout=datetime.timedelta(seconds=60))
    _start_deepspeed_comm()
    return groups._get_broadcast_src_rank()


def test_deepspeed_after_the_world_is_restarted(dist2):
    assert dist2.run(deepspeed_after_the_world_is_restarted) == [0, 0]


def test_usp_after_the_world_is_restarted(dist4):
    for first, second, renewed in dist4.run(restart_world_between_usp_runs):
        assert renewed
        for report in (first, second):
            for errors in report.values():
                assert all(err <= 2e-5 for err, _ in errors.values()), report


@pytest.mark.parametrize("sp,ring_degree,message", [
    (3, None, "not divisible by --sp-size 3"), (4, 3, "--ring-degree 3 does not divide"),
    (0, None, "--sp-size must be >= 1")])
def test_bad_grids_are_refused_before_any_group(sp, ring_degree, message):
    with pytest.raises(ValueError, match=message):
        ec.mesh.check_mesh(4, sp, ring_degree)
