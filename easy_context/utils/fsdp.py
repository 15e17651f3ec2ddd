"""Parameters that FSDP2 keeps sharded outside their own module's forward.

The chunked losses read the head's weight (and in max-length mode the final norm's) without
calling those modules. accelerate's FSDP2 setup gives ``[final norm, lm_head]`` an FSDP unit of
their own, gathered when the norm runs; under PEFT, or when the norm is skipped, nothing in
the forward gathers it, and the weight is still a sharded DTensor when the loss reads it.
Unsharding the unit explicitly is FSDP2's own API for that: the gradient then lands on the
unsharded parameter, and the root's end-of-backward callback reduce-scatters it (and
reshards) for every unit whose post-backward hook did not fire, as for any other unit.
"""

from __future__ import annotations

from torch import nn


def unshard_for_direct_use(*modules: nn.Module | None) -> None:
    """All-gather each module's own parameters if FSDP2 holds them sharded; no-op otherwise."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without FSDP2: nothing is ever sharded this way
        return
    for module in modules:
        if module is None:
            continue
        sharded = any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
        if not sharded:
            continue
        if not isinstance(module, FSDPModule):
            raise RuntimeError(
                f"{type(module).__name__}'s parameters are sharded (FSDP2) by an enclosing unit "
                "that is not running; shard this module as its own unit (fully_shard) or with "
                "the root, so that the loss can gather it")
        module.unshard()
