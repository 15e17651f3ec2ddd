"""One training step of DeepSpeed's Arctic Long Sequence Training (ALST) stack, on N gloo ranks.

The peer of ``easy-context train`` in benchmarks/maxlen.py, built as ALST's recipe describes
(DeepSpeed 0.19.8, ``deepspeed.runtime.sequence_parallel.ulysses_sp``), unpatched:
- ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", N, ...)``: Ulysses
  all-to-alls around transformers' sdpa attention;
- ``TiledMLP``: every decoder layer's MLP (a gated MLP or an MoE block, router and shared
  expert included) computed over ceil(seq_local / hidden) sequence shards and recomputed
  shard by shard in backward (its docstring's monkey patch, on each layer's MLP module);
- ALST's Ulysses drops the attention mask (it relies on sdpa's causal flag and position ids),
  so sliding-window layers (Gemma 3's) attend to the whole causal prefix there: more work,
  the same memory order with sdpa; for MLA (DeepSeek-V3) the value heads are padded to the
  query-key head size, which Ulysses' all-to-all requires;
- ``TiledFusedLogitsLoss``: the head and the loss over shards of about 64 MiB of float32
  logits, backward run inside forward;
- ZeRO-3 (``deepspeed.initialize``, a torch AdamW client optimizer) and transformers'
  per-layer gradient checkpointing.
The model is built from ``--model`` (a folder written by benchmarks/maxlen.py) in float32; each
rank takes its contiguous 1/N of one random sequence with its global position ids, as
``UlyssesSPDataLoaderAdapter`` would hand it. One step: forward, loss (the global token mean:
the summed loss of every rank over the global count), backward, AdamW step. Rank 0 prints one
JSON line (``RESULT {...}``) with the step time and the loss; memory is read from outside
(benchmarks/common.py:watch_ranks), exactly as for ``easy-context train``.

    python benchmarks/alst_step.py --model /tmp/m --seq-len 16384 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

LOGITS_SHARD_BYTES = 64 * 2**20


def _tiled(forward):
    """ALST's patch of an MLP class's forward (TiledMLP's docstring), for any MLP module (a
    gated MLP, an MoE block with its router and shared expert): shards of about `hidden`
    tokens, the same count on every rank (max over ranks) so that ZeRO-3's parameter gathers
    stay in step; every parameter of the module is handed to TiledMLP."""

    def tiled_forward(self, x):
        import torch
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        bs, seqlen, hidden = x.shape
        shards = torch.tensor(math.ceil(seqlen / hidden), device=x.device)
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)
        return TiledMLP.apply(forward, self, x, int(shards.item()), list(self.parameters()))

    return tiled_forward


def _patch_mlps(model) -> None:
    # per instance, not per class: an MoE's shared expert is of the dense MLP's class and runs
    # inside the tiled MoE block, on its shard
    import types

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(_tiled(type(layer.mlp).forward), layer.mlp)


def _pad_values(attention, qk_dim: int, v_dim: int):
    """Ulysses' all-to-all takes one head size for q, k and v: a value head narrower than the
    query-key head (MLA's) is padded with zeros to it and the output cut back (what
    transformers itself does for flash attention on DeepSeek-V3)."""
    import torch.nn.functional as F

    def padded(module, query, key, value, attention_mask, *args, **kwargs):
        value = F.pad(value, (0, qk_dim - v_dim))
        out, weights = attention(module, query, key, value, attention_mask, *args, **kwargs)
        # Ulysses returns (B, S_local, heads * qk_dim), heads flattened
        out = out.unflatten(-1, (-1, qk_dim))[..., :v_dim]  # (B, S_local, heads, v_dim)
        return out.contiguous(), weights

    return padded


def _loss_sum(model, hidden, shift_labels):
    """The summed token loss of one shard of hidden states (ArcticTraining's fused_logits_loss_fn)."""
    logits = model.lm_head(hidden)
    good = (shift_labels != -100).sum()
    if good == 0:
        return (logits.sum() * 0.0).float()
    loss = model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                               shift_labels=shift_labels)
    return loss * good


def rank_main(rank: int, world: int, port: int, args: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss,
                                                                UlyssesSPAttentionHF)
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    config = model.config
    qk_dim, v_dim = getattr(config, "qk_head_dim", None), getattr(config, "v_head_dim", None)
    mla = qk_dim is not None and v_dim is not None
    head_dim = getattr(config, "head_dim", None)
    if mla:  # Ulysses sizes its buffers from config.head_dim: MLA's query-key head, for it
        config.head_dim = qk_dim
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length=args["seq_len"], seq_length_is_variable=True)
    if mla:
        config.head_dim = head_dim
        if qk_dim != v_dim:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = _pad_values(ALL_ATTENTION_FUNCTIONS["sdpa"],
                                                          qk_dim, v_dim)
    _patch_mlps(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # from_pretrained returns eval mode, where transformers skips checkpointing
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu)

    L, vocab = args["seq_len"], model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, L + 1), generator=gen)
    s = L // world
    sl = slice(rank * s, (rank + 1) * s)
    input_ids, labels = ids[:, :-1][:, sl], ids[:, 1:][:, sl]
    position_ids = torch.arange(L).unsqueeze(0)[:, sl]
    shards = max(1, math.ceil(s * vocab * 4 / LOGITS_SHARD_BYTES))
    dist.barrier()
    t0 = time.perf_counter()
    hidden = engine.module.model(input_ids=input_ids, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    loss_sum = TiledFusedLogitsLoss.apply(_loss_sum, engine.module, hidden, labels, None, shards,
                                          [engine.module.lm_head.weight], "sum")
    good = (labels != -100).sum().float()
    total = good.clone()
    dist.all_reduce(total)
    loss = loss_sum / total  # this rank's share of the global token mean
    engine.backward(loss)
    engine.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    value = loss.detach().clone()
    dist.all_reduce(value)
    if rank == 0:
        print("RESULT " + json.dumps({"step_s": elapsed, "loss": value.item(), "world": world,
                                      "seq_len": L, "loss_shards": shards}), flush=True)
    dist.barrier()
    # measured and printed: leave without tearing down (on the MoE shape DeepSpeed's teardown
    # aborts, "terminate called without an active exception", after a finished step)
    os._exit(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from easy_context.testing import free_port

    mp.start_processes(rank_main, args=(args.nproc, free_port(), vars(args)), nprocs=args.nproc,
                       join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
