"""The trainer's memory settings from the planner: ``--auto-memory`` and max-length mode.

- :func:`resolve_auto_memory` (``--auto-memory``): the fastest setup in which this run's
  length fits these devices (easy_context.plan.auto.plan_for_length: method, engine, offload,
  checkpointing, MLP tile, head chunk, nested recompute) replaces the flags;
- :func:`apply_memory_mode`: ``--mlp-tile`` / ``--head-chunk`` / ``--keep-every``. With
  ``auto`` (the default) the planner decides: the untiled layers when they fit the device
  (they are the faster), else the fastest tiling that fits; numbers force a tiling, ``off``
  the untiled layers.

Every rank must take the same decision (head chunks change the collectives), so the memory
budgets are the smallest over the ranks. The device budget is 95% of a GPU's memory, or on
a CPU 90% of the memory available now shared by the local ranks; host memory (for offload)
is what is available per local rank on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from .config import TrainConfig, parse_tiling

log = logging.getLogger(__name__)
GIB = 2**30


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def budgets(device: torch.device, device_gib: float | None = None) -> tuple[int, int | None]:
    """(device bytes, host bytes or None) the planner may use per rank, min over ranks;
    ``device_gib`` (--auto-memory-budget) replaces the device's own figure."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_gib is not None:
        dev = int(device_gib * GIB)
        host = _mem_available() // local if device.type == "cuda" else None
    elif device.type == "cuda":
        dev = int(torch.cuda.get_device_properties(device).total_memory * 0.95)
        host = _mem_available() // local
    else:  # the host is the device: offloading to it saves nothing
        dev, host = int(_mem_available() * 0.9) // local, None
    values = torch.tensor([dev, host if host is not None else -1], dtype=torch.float64,
                          device=device)  # NCCL reduces device tensors only
    if dist.is_initialized() and dist.get_world_size() > 1:
        values[1] = -values[1]  # min of host = -max(-host): one MIN all-reduce for both
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        values[1] = -values[1]
    dev, host = values.tolist()
    return int(dev), (None if host < 0 else int(host))


def _shape(config: TrainConfig):
    from ..plan.shapes import load_shape

    return load_shape(config.model)


def _setups_here(shape, devices: int, device: torch.device):
    from ..plan.auto import _bases

    bases = _bases(shape, devices)
    if device.type != "cuda":  # host = device on a CPU: no offload of anything
        bases = [b for b in bases if b.offload == "none" and b.checkpointing != "offload"]
    return bases


def resolve_auto_memory(config: TrainConfig, world: int, device: torch.device) -> TrainConfig:
    """``--auto-memory``: the planner's setup for this length on ``world`` devices."""
    if not config.auto_memory:
        return config
    from ..plan.auto import plan_for_length

    shape = _shape(config)
    dev_bytes, host_bytes = budgets(device, config.auto_memory_budget)
    bases = [dataclasses.replace(b, deterministic=config.deterministic)
             for b in _setups_here(shape, world, device)]
    plan = plan_for_length(shape, config.seq_length, world, dev_bytes, host_bytes,
                           config.mixed_precision, bases=bases)
    if plan.setup is None:
        raise ValueError(f"--auto-memory: {plan.reason} ({dev_bytes / GIB:.1f} GiB per device); "
                         f"`easy-context plan --auto --model {config.model} --devices {world}` "
                         "gives the longest that fits")
    s = plan.setup
    if plan.seq_len != config.seq_length:
        raise ValueError(f"--auto-memory chose {s.method}, which needs --seq-length divisible "
                         f"by its shards: use {plan.seq_len}")
    resolved = dataclasses.replace(
        config, parallel_mode="data_parallel" if s.method == "local" else s.method,
        ring_degree=s.ring_degree, sp_size=None, engine=s.engine, offload=s.offload,
        checkpointing=s.checkpointing, mlp_tile=str(s.mlp_tile) if s.fused else "off",
        head_chunk=str(s.heads_per_chunk) if s.fused else "off", keep_every=s.keep_every)
    if dist.get_rank() == 0:
        log.info("--auto-memory: %s (planned peak %.2f GiB of %.2f GiB per device)",
                 s.train_flags(config.seq_length, world, config.mixed_precision),
                 plan.estimate.total / GIB, dev_bytes / GIB)
    return resolved


def apply_memory_mode(model, config: TrainConfig, sp: int, device: torch.device) -> bool:
    """Max-length mode on ``model`` when the flags (or the planner, for ``auto``) ask for it;
    returns whether it is on (then the layers do their own checkpointing)."""
    from ..memory.maxlen import apply_max_length, unsupported_reason
    from ..plan.auto import Setup, chunk_choices, fastest_tiling
    from ..plan.shapes import shape_from_config

    tile, chunk = parse_tiling(config.mlp_tile), parse_tiling(config.head_chunk, "head_chunk")
    if config.lora_rank and "auto" in (tile, chunk):
        # auto keeps a LoRA run's layers untiled (not tested with the planner's LoRA tiles);
        # forced tiles run the adapters (their layers take max-length mode's generic path)
        if config.keep_every > 1:
            raise ValueError("--keep-every with --lora-rank needs --mlp-tile and --head-chunk "
                             "as numbers or off (`easy-context plan --auto --lora-rank R` "
                             "prints them)")
        return False
    if tile is None and chunk is None:
        if config.keep_every > 1:
            raise ValueError("--keep-every needs max-length mode (--mlp-tile or --head-chunk)")
        return False
    if "auto" in (tile, chunk):
        # auto never stops a run the untiled layers can do: a model the planner cannot read,
        # or whose layers max-length mode cannot fuse, trains untiled
        why = unsupported_reason(model)
        try:
            shape = shape_from_config(model.config, name=str(config.model))
        except (AttributeError, TypeError, ValueError) as e:  # ValueError: the planner refuses
            why = why or f"the planner cannot plan it ({e})"
        if why:
            if tile == chunk == "auto" and config.keep_every == 1:
                log.info("max-length mode off: %s", why)
                return False
            raise ValueError(f"max-length mode: {why}")
    else:  # numbers: nothing to plan (the planner reads not every model max-length mode runs:
        # Jamba's Mamba-1, Kimi Linear's KDA), the heads from the config
        shape = None
    if "auto" in (tile, chunk):
        from ..parallel import get_method

        method = "local" if sp == 1 else get_method(config.parallel_mode).name
        base = Setup(method, config.ring_degree, config.engine, config.offload, config.checkpointing)
        dev_bytes, host_bytes = budgets(device, config.auto_memory_budget)
        untiled_allowed = tile == "auto" and chunk == "auto" and config.keep_every == 1
        setup, est = fastest_tiling(
            shape, config.seq_length, sp, base, dev_bytes, host_bytes, config.mixed_precision,
            allow_untiled=untiled_allowed, tile=tile if tile != "auto" else None,
            chunk=chunk if chunk != "auto" else None, keep_every=config.keep_every)
        if setup is not None and not setup.fused:
            return False
        if setup is None:
            log.warning("the planner finds no tiling that fits %d tokens in %.1f GiB per device "
                        "(%.1f GiB at the most frugal); trying the most frugal",
                        config.seq_length, dev_bytes / GIB, (est.total if est else 0) / GIB)
            setup = Setup(method, None, config.engine, config.offload, config.checkpointing,
                          512, min(chunk_choices(shape, base, sp)), config.keep_every)
        tile = setup.mlp_tile if tile == "auto" else tile
        chunk = setup.heads_per_chunk if chunk == "auto" else chunk
    tile = tile or config.seq_length  # off: one tile, the whole local sequence
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = shape.heads if shape is not None else text.num_attention_heads
    chunk = chunk or heads  # off: every head at once
    apply_max_length(model, tile, chunk, config.checkpointing, keep_every=config.keep_every)
    if dist.get_rank() == 0:
        log.info("max-length mode: MLP tiles of %d tokens, %d query head(s) per attention chunk, "
                 "checkpointing %s%s", tile, min(chunk, heads), config.checkpointing,
                 f", one layer input in {config.keep_every} kept" if config.keep_every > 1 else "")
    return True
