"""The planner's state exchange against the bytes a hybrid model's recurrent layers really
send: one training step of a tiny hybrid, sequence-parallel, every state all-gather (and its
reduce-scatter in backward) counted as it runs. Run on each rank."""

from __future__ import annotations

import torch.distributed as dist

from easy_context.recurrent import scan as scan_module

from .hf_cases import make_batch, sharded_loss
from .hf_recurrent_cases import tiny_hybrid, tiny_qwen3_next


def measured_state_bytes(family: str, method: str, length: int) -> dict:
    """{"sent": bytes this rank sent in the state collectives over one step (both rows of
    the batch), "calls": how many, "config": the model's config (for the planner)}."""
    world = dist.get_world_size()
    base = tiny_qwen3_next() if family == "qwen3_next" else tiny_hybrid(family)
    sent = {"bytes": 0, "calls": 0}
    gather, scatter = scan_module.gather_shards, scan_module.reduce_scatter_into

    def counted_gather(x, group):  # all-gather: this rank's part to the N-1 others
        sent["bytes"] += (world - 1) * x.numel() * x.element_size()
        sent["calls"] += 1
        return gather(x, group)

    def counted_scatter(out, grad, group=None):  # reduce-scatter: N-1 parts sent
        sent["bytes"] += (world - 1) * out.numel() * out.element_size()
        sent["calls"] += 1
        return scatter(out, grad, group=group)

    scan_module.gather_shards, scan_module.reduce_scatter_into = counted_gather, counted_scatter
    try:
        inputs, positions, targets = make_batch(length, base.config.vocab_size)
        sharded_loss(base, method, inputs, positions, targets, chunked=False)
    finally:
        scan_module.gather_shards, scan_module.reduce_scatter_into = gather, scatter
    return {"sent": sent["bytes"], "calls": sent["calls"], "rows": inputs.size(0),
            "config": base.config.to_dict(), "model_type": base.config.model_type}


# benchmarks/hybrid.py's Qwen3-Next-shaped model (3 gated-DeltaNet layers, 1 attention layer,
# hidden 64) with twice its recurrent heads, so that at a few thousand tokens the per-token
# terms stand well above the few MB a CPU process adds per step that no tensor accounts for
MAXLEN_HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=8)


def maxlen_step_rise(length: int, tile: int, heads_per_chunk: int) -> int:
    """Run in a fresh process started with MALLOC_MMAP_THRESHOLD_ (benchmarks/common.py): how
    far the resident high-water mark rises in a steady-state fp32 training step (forward and
    backward, after a 512-token warm-up step) of ``length`` tokens of the model above in
    max-length mode (full checkpointing, one process). One length a process: a second step
    would reuse the heap the first one left resident."""
    import torch

    import easy_context as ec
    from benchmarks import hybrid
    from easy_context.memory.maxlen import apply_max_length
    from easy_context.memory.peak import PeakMemory

    torch.set_num_threads(1)
    hybrid.CONFIG.update(MAXLEN_HYBRID)  # this process only
    model = hybrid.build_model().train()
    apply_max_length(model, tile, heads_per_chunk, checkpointing="full")

    def step(n: int) -> None:
        inputs, positions, targets = hybrid.batch(n)
        ec.causal_lm_loss(model, inputs, positions, targets, chunked=True).backward()

    step(512)
    model.zero_grad(set_to_none=True)
    with PeakMemory("cpu") as pm:
        step(length)
    return pm.peak_bytes
