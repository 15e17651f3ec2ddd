"""The training loop: DP x SP, exact global loss, atomic checkpoints, exact resume, export.

One optimizer step:
1. every dp rank takes its ``gradient_accumulate_every`` micro-batches (train/data.py); the sp
   ranks of a group take the same ones and keep their shards;
2. the loss denominator is the number of valid targets in the whole step (all dp ranks, all
   micro-batches), so each micro-batch's loss is its exact share of the step's token mean,
   and the sum of the logged values is that mean;
3. backward; FSDP sums gradient shares across ranks; clip; AdamW; schedule.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention.documents import document_ids_from_positions, is_packed
from ..integrations.hf import apply_sequence_parallel
from ..memory.checkpointing import apply_activation_checkpointing
from ..mesh import ParallelMesh, build_mesh, check_mesh
from ..models import load_config
from ..parallel import get_method
from ..sequence_parallel import shard_batch
from ..utils.allocator import configure_allocator
from ..memory.peak import PeakMemory
from .checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig, save_config
from .data import TrainBatches, load_training_dataset
from .determinism import deterministic_kernels
from .logs import MetricsLogger
from .model import build_empty_model, load_tokenizer
from .memory_mode import apply_memory_mode, resolve_auto_memory
from .schedule import lr_lambda
from .vision import check_vision_run, has_images, is_vision_config, shard_vision_batch
from .weights import params_on_meta

log = logging.getLogger("easy_context.train")


class NonFiniteLoss(RuntimeError):
    pass


def build_model_and_engine(config: TrainConfig, device: torch.device, mesh: ParallelMesh):
    """The model, built empty, made sequence-parallel, sharded by its engine and then loaded
    shard by shard: no rank ever holds the whole model (easy_context.train.weights)."""
    if config.engine == "deepspeed":
        from .engines.deepspeed import DeepSpeedEngine, zero_init

        init = lambda mc: zero_init(config, mc, device)  # noqa: E731
        model, pretrained = build_empty_model(config, init, buffers_outside=True)
    else:
        from .engines.fsdp import FSDPEngine

        init = lambda _: params_on_meta()  # noqa: E731
        model, pretrained = build_empty_model(config, init)
    if config.lora_rank:
        from .lora import add_lora  # peft is imported only for LoRA runs

        # The adapters are made empty like the model (meta, or ZeRO-3 partitions).
        model, pretrained = add_lora(model, pretrained, config, init(model.config), device)
    # local (data parallelism) keeps packed documents apart too: transformers' sdpa path
    # would ignore document_ids.
    apply_sequence_parallel(model, config.parallel_mode, group=mesh.sp,
                            ring_degree=config.ring_degree)
    sp = config.sp_size_for(dist.get_world_size())
    if not apply_memory_mode(model, config, sp, device):  # max-length mode checkpoints itself
        apply_activation_checkpointing(model, config.checkpointing)
    model.train()
    if config.engine == "deepspeed":
        return model, DeepSpeedEngine(model, device, config, pretrained)
    return model, FSDPEngine(model, mesh.shard_mesh, config.learning_rate, config.mixed_precision,
                             config.offload, chunked_loss=config.chunked_loss, device=device,
                             pretrained=pretrained)


def _step_target_count(micro_batches: list[dict], dp_group, device) -> torch.Tensor:
    """Valid targets in this optimizer step, over every dp rank and micro-batch."""
    count = sum(int((b["target_ids"] != -100).sum()) for b in micro_batches)
    total = torch.tensor([count], dtype=torch.float64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    return total


def train(config: TrainConfig, device: torch.device) -> dict:
    """Run (or resume) a training run on this rank. Returns the final metrics on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = resolve_auto_memory(config, world, device)  # --auto-memory: the planner's setup
    method = get_method(config.parallel_mode)
    sp = config.sp_size_for(world)
    # Every rule of the grid and the method, before any collective: all ranks raise the same.
    check_mesh(world, sp, config.ring_degree)
    multiple = method.required_multiple(sp, config.ring_degree)
    if config.seq_length % multiple:
        raise ValueError(f"--seq-length {config.seq_length} is not divisible by {multiple} "
                         f"({method.name} over {sp} ranks); use a multiple of {multiple}, e.g. "
                         f"{-(-config.seq_length // multiple) * multiple}")
    dataset = load_training_dataset(config.dataset)
    # images (prepare-data --processor) or a vision-language model: checked before any
    # collective, from the dataset's columns and the model's config
    vision = is_vision_config(load_config(config.model, trust_remote_code=config.trust_remote_code))
    check_vision_run(config, has_images(dataset), vision)
    torch.manual_seed(config.seed)
    mesh = build_mesh(sp, config.ring_degree, device.type)
    output = Path(config.output_dir)
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        save_config(config, output / "train_config.yaml")
        log.info("%s; method %s", mesh.describe(), method.name)
    model, engine = build_model_and_engine(config, device, mesh)
    tokenizer = load_tokenizer(config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lr_lambda(config.lr_schedule, config.warmup_steps, config.max_train_steps))

    batches = TrainBatches(dataset, config.seq_length, config.batch_size, mesh.dp, mesh.dp_rank,
                           config.seed)
    step = 0
    if config.resume:
        folder = latest_checkpoint(output)
        if folder is None:
            log.info("--resume: no checkpoint in %s, starting from step 0", output)
        else:
            state = load_checkpoint(engine, folder)
            scheduler.load_state_dict(state["scheduler"])
            step = state["step"]
            log.info("resumed from %s at step %d", folder, step)
    metrics = MetricsLogger(output, config, rank == 0, resume_step=step)

    accum = config.gradient_accumulate_every
    tokens_per_step = config.seq_length * config.batch_size * mesh.dp * accum
    last = {}
    while step < config.max_train_steps:
        start = time.perf_counter()
        micro_batches = [batches.get(step * accum + i) for i in range(accum)]
        denom = _step_target_count(micro_batches, mesh.dp_group, device)
        step_loss = 0.0
        with PeakMemory(device) as peak:
            for batch in micro_batches:
                if vision:  # each rank cuts the step and encodes its own images
                    local = shard_vision_batch(model, batch, method.name, mesh.sp_rank, sp,
                                               config.ring_degree, device)
                else:
                    # Decided on the whole batch, which every sp rank holds, so all ranks agree.
                    if is_packed(batch["position_ids"]):
                        batch["document_ids"] = document_ids_from_positions(batch["position_ids"])
                    local = {k: t.to(device) for k, t in shard_batch(
                        batch, method.name, mesh.sp_rank, sp, config.ring_degree).items()}
                loss = engine.loss(**local, group=dist.group.WORLD, num_items_in_batch=denom)
                engine.backward(loss)
                step_loss += loss.item()
            if not math.isfinite(step_loss):
                save_checkpoint(engine, output, step, _trainer_state(step, scheduler, config))
                raise NonFiniteLoss(f"step {step + 1}: loss is {step_loss}; stopped, with a "
                                    f"checkpoint of step {step} in {output / 'checkpoints'}. "
                                    "Lower --learning-rate, use --grad-clip, or check the data")
            grad_norm = engine.clip_grad_norm(config.grad_clip)
            engine.step()
            scheduler.step()
        step += 1
        elapsed = time.perf_counter() - start
        last = {"step": step, "loss": step_loss, "ppl": math.exp(min(step_loss, 50.0)),
                "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                "peak_memory_mb": (None if peak.process_peak_bytes is None
                                   else peak.process_peak_bytes / 2**20)}
        metrics.log(last, force=step == config.max_train_steps)
        if config.save_every and step % config.save_every == 0 and step < config.max_train_steps:
            save_checkpoint(engine, output, step, _trainer_state(step, scheduler, config))
    save_checkpoint(engine, output, step, _trainer_state(step, scheduler, config))
    if config.export and config.lora_rank:
        from .lora import export_lora

        export_lora(engine, model, tokenizer, config, output)
    elif config.export:
        state_dict = engine.full_state_dict()
        if rank == 0:
            export_hf(model, state_dict, tokenizer, output / "final_model", config.seq_length)
            log.info("exported the model to %s", output / "final_model")
        dist.barrier()
    metrics.close()
    return last


def _trainer_state(step: int, scheduler, config: TrainConfig) -> dict:
    return {"step": step, "micro_batches_consumed": step * config.gradient_accumulate_every,
            "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(config),
            "world_size": dist.get_world_size()}


def _ensure_process_group(config: TrainConfig) -> torch.device:
    from ..launch import free_port, init_distributed

    if not dist.is_initialized() and "RANK" not in os.environ:
        # One process: a one-rank group keeps a single code path (FSDP, checkpoints).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return init_distributed(config.pg_timeout_minutes)


def run_training(config: TrainConfig) -> dict:
    """Entry point on each rank (spawned, torchrun, accelerate or a single process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # before any tensor: the allocator the memory planner assumes (utils/allocator.py)
    allocator = configure_allocator("cuda" if torch.cuda.is_available() else "cpu")
    device = _ensure_process_group(config)
    if dist.get_rank() == 0:
        log.info("%s", allocator)
    if dist.get_rank() != 0:
        logging.getLogger("easy_context").setLevel(logging.WARNING)
    # No log.exception here: the error reaches the user once, through launch (RankError) or
    # the exception itself, and the traceback with --debug.
    with deterministic_kernels(config.deterministic):
        return train(config, device)


def results_of(output_dir: Path) -> list[dict]:
    """The per-step metrics a run wrote (rank 0's metrics.jsonl)."""
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
