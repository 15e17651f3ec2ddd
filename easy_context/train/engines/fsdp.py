"""FSDP2 engine: ZeRO-3-style sharding of parameters, gradients and optimizer states.

``fully_shard`` goes on every decoder layer, then on the root, over all ranks (dp x sp): the
sequence-parallel ranks compute on the same weights, so sharding across them too saves as
much memory as across data-parallel ranks.

Gradients are *summed* across ranks, not averaged: each rank's loss gradient is already its
share of the global token mean (easy_context.memory.loss), so the sum is the exact gradient.

A model built on the meta device (easy_context.train.weights) is sharded first and then
materialised and loaded shard by shard: no rank ever holds the whole model.

The root (the loss module) does not cast its floating-point inputs to the compute dtype:
its only one is the step's count of valid targets, which bf16 would round (100001 ->
99840, a 0.16% error in the loss and every gradient). Its real activations are made
inside it, and each decoder layer still casts its own inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..weights import (Pretrained, SafetensorsFolder, checkpoint_names, decoder_layers,  # noqa: F401
                       has_meta_parameters)

log = logging.getLogger(__name__)


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 that this rank's shard of ``param`` holds: FSDP2 splits
    dim 0 as torch.chunk does (ceil(n / world) rows each; the last ranks may get fewer or none)."""
    n = param.shape[0]
    if not isinstance(param, DTensor):
        return 0, n
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"loading into {param.placements} on a {param.device_mesh.ndim}-D "
                                  "mesh; this engine shards dim 0 over a 1-D mesh")
    chunk = math.ceil(n / param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * chunk, n)
    return start, min(start + chunk, n)


def materialise(root: nn.Module, model: nn.Module, buffers: dict[str, torch.Tensor],
                device: torch.device, offload: bool) -> None:
    """Give a meta model's shards memory (values come after) and put its real ``buffers``
    (rotary tables) back, on ``device``.

    Offloaded shards are made in host memory: FSDP2's CPUOffloadPolicy keeps them there and
    copies them to the device for each all-gather. Made on the GPU instead, FSDP moves each
    local tensor to pinned host memory under a parameter that still points at the GPU, and
    the model fails before its first step ("Attempted to set the storage of a tensor on
    device "cpu" to a storage on different device "cuda:0"", benchmarks/gpu_check.py on an
    H200). Buffers are not sharded and stay on the compute device either way.
    """
    root.to_empty(device=torch.device("cpu") if offload else device)
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = value.to(device)


class FSDPEngine:
    name = "fsdp"

    def __init__(self, model: nn.Module, mesh, learning_rate: float, mixed_precision: str,
                 offload: str, chunked_loss: bool | None = None,
                 device: torch.device = torch.device("cpu"), pretrained: Pretrained | None = None):
        """``mesh``: the 1-D device mesh over every rank (easy_context.mesh.ParallelMesh's
        shard_mesh); ``device``: this rank's device; ``pretrained``: where the weights of a
        model built on the meta device come from (required for one)."""
        meta = has_meta_parameters(model)
        if meta and pretrained is None:
            raise ValueError("the model's parameters are on the meta device: pass pretrained= "
                             "to load them")
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision == "bf16" else MixedPrecisionPolicy())
        if offload == "none":
            offload_policy = OffloadPolicy()
        else:
            if offload == "optimizer":
                log.info("FSDP2 offloads parameters, gradients and optimizer states together; "
                         "--offload optimizer alone needs --engine deepspeed")
            # Pinned host memory speeds up copies to a GPU; without a GPU it cannot be had.
            offload_policy = CPUOffloadPolicy(pin_memory=device.type != "cpu")
        # Real buffers (rotary tables) survive the materialisation of a meta model.
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if meta else {}
        from ..vision import layers_to_shard, loss_module

        for layer in layers_to_shard(model, decoder_layers(model)):
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload_policy)
        # The root is the loss module, so embeddings, final norm and head are gathered
        # for the whole loss computation (see CausalLMLoss). It keeps its inputs as they
        # are (the module docstring says why).
        self.loss_module = fully_shard(
            loss_module(model, chunked_loss), mesh=mesh, offload_policy=offload_policy,
            mp_policy=dataclasses.replace(mp, cast_forward_inputs=False))
        for m in self.loss_module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                # a plain SUM (gloo has no pre-multiplied sum; with factor 1 none is needed)
                m.set_force_sum_reduction_for_comms(True)
        self.model = model
        if meta:
            materialise(self.loss_module, model, buffers, device, offload != "none")
            self._load_pretrained(pretrained)
        # Frozen parameters (LoRA's base) have no optimizer state; checkpoints leave them out.
        self.frozen = any(not p.requires_grad for p in model.parameters())
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0,
                                           eps=1e-8)

    def _load_pretrained(self, pretrained: Pretrained) -> None:
        folder = pretrained.folder()
        names = None if folder is None else checkpoint_names(self.model, folder)
        if names is not None:
            self._read_shards(folder, names)
            return
        log.warning("%s: the checkpoint's tensor names are not the model's; rank 0 loads the "
                    "whole model with from_pretrained and broadcasts it (one model of host "
                    "memory on rank 0)", pretrained.path)
        full = {}
        if dist.get_rank() == 0:
            full = {f"model.{k}": v for k, v in pretrained.load_full().state_dict().items()}
        set_model_state_dict(self.loss_module, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def _read_shards(self, folder: SafetensorsFolder, names: dict[str, str]) -> None:
        """Each rank reads only the rows its shards hold, straight into them."""
        persistent = set(self.model.state_dict().keys())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                start, stop = shard_rows(param)
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.shape[0] != stop - start:
                    raise RuntimeError(f"{name}: shard of {local.shape[0]} rows, expected "
                                       f"rows {start}:{stop} of {param.shape[0]}")
                if stop > start:
                    local.copy_(folder.read(names[name], (start, stop)))
            for name, buf in self.model.named_buffers():
                if name in persistent and name in names:
                    buf.copy_(folder.read(names[name]))

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
    def save(self, folder: Path) -> list[Path]:
        """Writes this rank's shards; returns the files it wrote that still need an fsync:
        none, as DCP's writer syncs each file it writes (and rank 0's metadata)."""
        model_sd, optim_sd = get_state_dict(self.loss_module, self.optimizer, options=self._options())
        dcp.save({"model": model_sd, "optimizer": optim_sd},
                 storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))
        return []

    def load(self, folder: Path) -> None:
        options = self._options()
        model_sd, optim_sd = get_state_dict(self.loss_module, self.optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.loss_module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)

    def _options(self) -> StateDictOptions:
        # Frozen weights are read from the model folder again on resume, not checkpointed;
        # loading then must not ask for them (strict=False), and only then.
        return StateDictOptions(ignore_frozen_params=self.frozen, strict=not self.frozen)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0's CPU (other ranks get an empty dict);
        ``trainable_only``: only those that require a gradient (LoRA's adapters)."""
        state = get_model_state_dict(self.loss_module, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only))
        return {k.removeprefix("model."): v for k, v in state.items()}
