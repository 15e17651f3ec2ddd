"""FSDP2 engine: ZeRO-3-style sharding of parameters, gradients and optimizer states.

``fully_shard`` goes on every decoder layer, then on the root, over all ranks (dp x sp): the
sequence-parallel ranks compute on the same weights, so sharding across them too saves as
much memory as across data-parallel ranks.

Gradients are *summed* across ranks, not averaged: each rank's loss gradient is already its
share of the global token mean (easy_context.memory.loss), so the sum is the exact gradient.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ...integrations.hf import CausalLMLoss

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks named in the model's ``_no_split_modules`` (its decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} "
                         "(no _no_split_modules): FSDP needs them to shard layer by layer")
    return layers


class FSDPEngine:
    name = "fsdp"

    def __init__(self, model: nn.Module, mesh, learning_rate: float, mixed_precision: str,
                 offload: str, chunked_loss: bool | None = None, pin_memory: bool = False):
        """``mesh``: the 1-D device mesh over every rank (easy_context.mesh.ParallelMesh's
        shard_mesh); ``pin_memory``: page-lock offloaded states (needs an accelerator)."""
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision == "bf16" else MixedPrecisionPolicy())
        if offload == "none":
            offload_policy = OffloadPolicy()
        else:
            if offload == "optimizer":
                log.info("FSDP2 offloads parameters, gradients and optimizer states together; "
                         "--offload optimizer alone needs --engine deepspeed")
            # Pinned host memory speeds up copies to a GPU; without a GPU it cannot be had.
            offload_policy = CPUOffloadPolicy(pin_memory=pin_memory)
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload_policy)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        # The root is the loss module, so embeddings, final norm and head are gathered
        # for the whole loss computation (see CausalLMLoss).
        self.loss_module = fully_shard(CausalLMLoss(model, chunked=chunked_loss), **kw)
        for m in self.loss_module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                # a plain SUM (gloo has no pre-multiplied sum; with factor 1 none is needed)
                m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                                           weight_decay=0.0, eps=1e-8)

    def loss(self, **batch) -> torch.Tensor:
        return self.loss_module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        # With max_norm = inf this only measures the norm (for the log).
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm or float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- checkpoints: every rank writes its shards (torch.distributed.checkpoint)
    def save(self, folder: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.loss_module, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder))

    def load(self, folder: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.loss_module, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.loss_module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0's CPU (other ranks get an empty dict)."""
        state = get_model_state_dict(self.loss_module, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("model."): v for k, v in state.items()}
