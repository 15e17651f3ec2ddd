"""The strict collective check (easy_context/utils/strict_collectives.py) on one gloo rank:
it sees torch.distributed's calls and the functional collectives DTensor and FSDP2 use, and
raises on tensors of a device type the group has no backend for (a group made for CUDA only
stands in for NCCL's)."""

from __future__ import annotations

import pytest


def _collectives(group_device_types) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from easy_context.utils.strict_collectives import CollectiveDeviceError, StrictCollectives

    t = torch.ones(3)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(3), t),
        "functional all_reduce": lambda: fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD)),
    }
    out = {}
    for name, call in calls.items():
        try:
            with StrictCollectives(group_device_types) as seen:
                call()
            out[name] = dict(seen.counts)
        except CollectiveDeviceError as e:
            out[name] = str(e)
    return out


def test_it_passes_host_tensors_over_gloo_and_counts_them(dist1):
    got = dist1.run(_collectives, None)[0]
    assert all(isinstance(v, dict) and sum(v.values()) == 1 for v in got.values()), got


@pytest.mark.parametrize("types", [{"cuda"}])
def test_it_raises_on_host_tensors_over_a_group_for_cuda_only(dist1, types):
    got = dist1.run(_collectives, types)[0]
    for name, message in got.items():
        assert isinstance(message, str) and "['cpu'] tensors" in message and "NCCL" in message, (name, message)
