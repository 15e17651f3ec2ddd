"""Rank functions for the LoRA tests (tests/dist/test_lora.py).

Adapters start with B = 0 (peft's initialisation), where every gradient of A is zero: the
model-level checks give B random values first, and the engine-level checks compare the
gradients of the second step, after one AdamW update has made B non-zero.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from easy_context.train.config import TrainConfig
from easy_context.train.lora import inject_lora, is_adapter, peft_config

from .hf_cases import make_batch, reference_loss, sharded_loss, tiny_model

RANK = 4


def lora_model(seed: int = 0, hybrid: str | None = None):
    """The tiny Llama of hf_cases (or the tiny ``hybrid`` of hf_recurrent_cases.HYBRIDS) with
    adapters on every linear module of its decoder layers (a hybrid's recurrent layers'
    projections too), B drawn at random so that the gradients of A are not zero."""
    if hybrid is None:
        model = tiny_model("llama", seed)
    else:
        from .hf_recurrent_cases import tiny_hybrid

        model = tiny_hybrid(hybrid, seed)
    inject_lora(model, peft_config(TrainConfig(model="tiny", dataset="-", lora_rank=RANK)))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _adapter_errors(sp_model, ref_model) -> tuple[float, list[str]]:
    """(largest relative error of an adapter gradient summed over ranks, frozen parameters
    that got a gradient on any rank)."""
    worst, frozen_with_grad = 0.0, []
    for (name, p), (_, r) in zip(sp_model.named_parameters(), ref_model.named_parameters()):
        if not is_adapter(name):
            if p.grad is not None or r.grad is not None:
                frozen_with_grad.append(name)
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        scale = r.grad.abs().max().clamp(min=1e-12)
        worst = max(worst, ((g - r.grad).abs().max() / scale).item())
    return worst, frozen_with_grad


def check_lora_methods(methods: list[str], hybrid: str | None = None
                       ) -> dict[str, tuple[float, float, list[str]]]:
    """For each method: (loss relative error, adapter gradient relative error, frozen
    parameters with a gradient), the LoRA model on this rank's shard against one process."""
    world = dist.get_world_size()
    base = lora_model(hybrid=hybrid)
    inputs, positions, targets = make_batch(2 * world * 5, base.config.vocab_size)
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    report = {}
    for method in methods:
        ring_degree = 1 if method == "usp_attn" else None  # one ring member: Ulysses x ring
        model, loss = sharded_loss(base, method, inputs, positions, targets, ring_degree)
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        report[method] = (loss_err, *_adapter_errors(model, ref))
    return report


def engine_step_gradients(workdir: str, **overrides) -> dict:
    """Build the trainer's model and engine for a LoRA run, take one optimizer step, then
    return (rank 0) the second step's loss and every adapter's full gradient, the names of
    the parameters the optimizer holds and of the frozen ones that got a gradient."""
    from easy_context.mesh import build_mesh
    from easy_context.parallel import get_method
    from easy_context.sequence_parallel import shard_batch
    from easy_context.train.data import TrainBatches, load_training_dataset
    from easy_context.train.trainer import _ensure_process_group, _step_target_count, build_model_and_engine

    work = Path(workdir)
    values = dict(model=str(work / "model"), dataset=str(work / "data"), seq_length=32,
                  learning_rate=1e-2, mixed_precision="fp32", checkpointing="full", seed=7,
                  lora_rank=RANK, grad_clip=0.0, output_dir=str(work / "unused"))
    values.update(overrides)
    config = TrainConfig(**values)
    config.validate()
    device = _ensure_process_group(config)
    world = dist.get_world_size()
    sp = config.sp_size_for(world)
    method = get_method(config.parallel_mode)
    mesh = build_mesh(sp, config.ring_degree, device.type)
    model, engine = build_model_and_engine(config, device, mesh)
    batches = TrainBatches(load_training_dataset(config.dataset), config.seq_length,
                           config.batch_size, mesh.dp, mesh.dp_rank, config.seed)
    losses = []
    for step in range(2):
        batch = batches.get(step)
        denom = _step_target_count([batch], mesh.dp_group, device)
        local = shard_batch(batch, method.name, mesh.sp_rank, sp, config.ring_degree)
        loss = engine.loss(**local, group=dist.group.WORLD, num_items_in_batch=denom)
        engine.backward(loss)
        losses.append(loss.item())
        if step == 0:
            engine.clip_grad_norm(0.0)
            engine.step()
    grads = {name: _full_grad(engine, p) for name, p in model.named_parameters()
             if p.requires_grad}
    frozen_with_grad = [n for n, p in model.named_parameters()
                        if not p.requires_grad and _has_grad(engine, p)]
    # What the optimizer steps, summed over ranks: FSDP's shards of the parameters, or
    # DeepSpeed's fp32 partitions of them (flattened, padded to a multiple of the world).
    if engine.name == "deepspeed":  # the torch optimizer sees them only during its step
        held = engine.engine.optimizer.fp32_partitioned_groups_flat
    else:
        held = [p for g in engine.optimizer.param_groups for p in g["params"]]
    optimized = torch.tensor([sum(_local_numel(p) for p in held)])
    dist.all_reduce(optimized)
    engine.step()  # leaves DeepSpeed's accumulation counter where a new step expects it
    dist.barrier()
    return {"losses": losses, "grads": grads, "frozen_with_grad": frozen_with_grad,
            "optimized": int(optimized), "trainable": sorted(grads)} if dist.get_rank() == 0 else {}


def _full_grad(engine, param) -> torch.Tensor:
    if engine.name == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param).detach().cpu().clone()
    grad = param.grad
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu().clone()


def _has_grad(engine, param) -> bool:
    if engine.name == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param) is not None
    return param.grad is not None


def _local_numel(tensor) -> int:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).numel()
