"""Rank functions for tests/dist/test_sharded_loading.py: build a model the way the trainer
does (empty, sharded by its engine, then loaded) and report what it holds or costs."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from easy_context.mesh import build_mesh
from easy_context.train.config import TrainConfig
from easy_context.train.trainer import build_model_and_engine
from easy_context.memory.peak import rss_bytes


def _config(model_dir: str, engine: str, **overrides) -> TrainConfig:
    values = dict(model=model_dir, dataset="unused", engine=engine, seq_length=32,
                  parallel_mode="zigzag_ring_attn", mixed_precision="fp32",
                  checkpointing="none", output_dir="unused")
    values.update(overrides)
    return TrainConfig(**values)


def _setup(model_dir: str, engine: str, **overrides):
    config = _config(model_dir, engine, **overrides)
    mesh = build_mesh(config.sp_size_for(dist.get_world_size()), None, "cpu")
    return build_model_and_engine(config, torch.device("cpu"), mesh)


def loaded_differences(model_dir: str, engine: str, mixed_precision: str = "fp32") -> list[str]:
    """Rank 0: every tensor of the engine's full state dict (the fp32 master weights) and
    every buffer that is not bit-equal, dtype included, to what from_pretrained loads in
    fp32; and every tensor missing."""
    from transformers import AutoModelForCausalLM

    model, eng = _setup(model_dir, engine, mixed_precision=mixed_precision)
    state = eng.full_state_dict()
    if dist.get_rank() != 0:
        return []
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Parameters once (a tied weight under its first name, as DeepSpeed's export keeps
    # it) and every buffer, the rotary tables too.
    expected = {n: p.detach() for n, p in want.named_parameters()}
    expected.update(dict(want.named_buffers()))
    got = dict(state)
    got.update({n: b for n, b in model.named_buffers()})
    bad = [f"missing {k}" for k in expected if k not in got]
    bad += [f"{k}: {got[k].dtype} {tuple(got[k].shape)}" for k in expected
            if k in got and not (got[k].dtype == expected[k].dtype
                                 and torch.equal(got[k].cpu(), expected[k]))]
    return bad


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def setup_memory(model_dir: str, warmup_dir: str, engine: str) -> dict:
    """This rank's resident memory (MB, from /proc/self/status, outside the code under test)
    before building the model and its engine, after it, and the high-water mark in between.

    DeepSpeed: also at the entry of deepspeed.initialize, i.e. with the model built and
    loaded but before DeepSpeed makes its optimizer's fp32 partitions and gradient buffers
    (which this change does not touch, and which dominate the whole setup's peak).
    """
    _setup(warmup_dir, engine)  # imports, kernels and allocator pools of a tiny model
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here
        f.write("5")
    result = {"before": rss_bytes() / 2**20}
    restore = None
    if engine == "deepspeed":
        import deepspeed

        restore = deepspeed.initialize

        def initialize(*args, **kwargs):
            result.update(loaded=rss_bytes() / 2**20, loaded_peak=_status_mb("VmHWM"))
            return restore(*args, **kwargs)

        deepspeed.initialize = initialize
    try:
        model, eng = _setup(model_dir, engine)
    finally:
        if restore is not None:
            deepspeed.initialize = restore
    gc.collect()
    result.update(after=rss_bytes() / 2**20, peak=_status_mb("VmHWM"))
    dist.barrier()
    del model, eng
    return result
