"""A check that every collective's tensors are on a device type its process group has a
backend for: what NCCL enforces and gloo forgives.

NCCL carries CUDA tensors only; gloo takes host and CUDA tensors alike. A collective on host
tensors (FSDP2's CPU-offloaded gradients in ``clip_grad_norm_``, a broadcast from host
memory) therefore runs on a CPU test machine and raises on GPUs over an NCCL-only group. This
mode sees every collective at the dispatcher (``c10d`` ops, as ``torch.distributed``'s calls
reach it, and ``_c10d_functional`` ops, as DTensor's and FSDP2's do) and raises on one whose
tensors are on a device type the group does not cover, or that mixes device types.

On a CPU machine host and device are one type, so a trainer run under it passes there by
construction; ``group_device_types`` stands in for a group made for other devices only (an
NCCL-only group is ``{"cuda"}``), which is how the check itself is tested on a CPU.
``benchmarks/gpu_check.py`` runs the trainer under it on CUDA, where it bites.

    with StrictCollectives() as seen:
        train(...)
    seen.counts  # collectives by op name
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_SKIP = {"wait_tensor", "_wrap_tensor_autograd"}  # waits on a collective already checked


class CollectiveDeviceError(RuntimeError):
    pass


def _group_of(func, args, kwargs):
    """The process group a c10d op runs on (an object argument, or a group name)."""
    for arg, value in zip(func._schema.arguments, list(args) + [None] * len(func._schema.arguments)):
        value = kwargs.get(arg.name, value)
        if "ProcessGroup" in str(arg.type) and value is not None:
            return dist.ProcessGroup.unbox(value) if not isinstance(value, dist.ProcessGroup) else value
        if arg.name == "group_name" and isinstance(value, str):
            return dist.distributed_c10d._resolve_process_group(value)
    return None


class StrictCollectives(TorchDispatchMode):
    def __init__(self, group_device_types: set[str] | None = None):
        super().__init__()
        self.group_device_types = group_device_types
        self.counts: Counter[str] = Counter()

    def _covered(self, group) -> set[str]:
        if self.group_device_types is not None:
            return set(self.group_device_types)
        return {d.type for d in group._device_types}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace in _NAMESPACES and name not in _SKIP:
            flat, _ = tree_flatten((args, kwargs))
            devices = {t.device.type for t in flat if isinstance(t, torch.Tensor)}
            group = _group_of(func, args, kwargs)
            covered = self._covered(group) if group is not None else devices
            if len(devices) > 1 or not devices <= covered:
                raise CollectiveDeviceError(
                    f"{func.namespace}.{name} on {sorted(devices)} tensors over a process group "
                    f"with backends for {sorted(covered)} only: NCCL would raise here (create "
                    "the group with a backend for host tensors, or move them to the device)")
            self.counts[f"{func.namespace}.{name}"] += 1
        return func(*args, **kwargs)
