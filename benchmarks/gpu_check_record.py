"""gpu_check's record section: a full-depth Llama-3-8B-shaped model fine-tuned with LoRA in
max-length mode on one device, at the longest length the planner gives it.

The model: Llama-3-8B's shape (32 layers, hidden 4096, 32 heads on 8 KV heads, MLP 14336,
vocabulary 128256), random weights built in place on the device (nothing is downloaded or
read from disk), kept in fp32 with the step under bf16 autocast: the frozen base as the
planner's one-device LoRA estimate counts it (engine "replicated", plan/lora.py). Adapters of
rank 16 on every linear module of every layer (peft, as ``easy-context train --lora-rank 16``
injects them), the sequence on one device (method "local").

The length: easy_context.plan.auto.plan_longest over this device's free memory and this
machine's available host memory (offloaded layer inputs go there), LoRA included: it picks
the checkpointing kind, the MLP tile, the head chunk and the nested recompute. A step at that
length may take longer than the call's time budget allows; the step then runs at the longest
length (a multiple of 8K) whose predicted time fits the budget left, from the attention section's
measured TFLOP/s when it ran (else 400), and the row says both lengths. Measured: the step's
time (forward + backward + AdamW on the adapters), its peak allocated memory from before the
model was built, and that peak against the planner's total for the length run.

Anchors (their published figures, not measured here): Unsloth's 342K tokens for Llama-3.1-8B
QLoRA on one 80 GB GPU; ALST's 500K tokens of full fine-tuning on one H100.
"""

from __future__ import annotations

import time

import torch

RANK = 16
GRANULARITY = 8192
ASSUMED_TFLOPS = 400.0


def _host_bytes() -> int:
    from easy_context.train.memory_mode import _mem_available

    return _mem_available()


def _setups(lora):
    from easy_context.plan.auto import Setup

    # one device, no sharding engine: the base where the model was built
    return [Setup("local", None, "replicated", "none", ckpt, lora=lora)
            for ckpt in ("attention", "full", "offload")]


def plan(config, device: torch.device, tiny: bool, device_bytes: int | None = None,
         host_bytes: int | None = None):
    """(AutoPlan, shape): the planner's longest setup for this model with LoRA here."""
    from easy_context.plan.auto import plan_longest
    from easy_context.plan.lora import LoRASpec
    from easy_context.plan.shapes import shape_from_config

    shape = shape_from_config(config, "Llama-3-8B" if not tiny else "tiny Llama")
    lora = LoRASpec(RANK)
    if device_bytes is None:
        device_bytes = (int(torch.cuda.mem_get_info(device)[0] * 0.95) if device.type == "cuda"
                        else 5 * 2**29)  # --cpu --tiny: the planner counts a GPU runtime (2 GiB)
    if host_bytes is None:
        host_bytes = _host_bytes() if device.type == "cuda" else None
    auto = plan_longest(shape, 1, device_bytes, host_bytes, "bf16" if device.type == "cuda"
                        else "fp32", granularity=GRANULARITY if not tiny else 128,
                        bases=_setups(lora))
    return auto, shape


def step_flops(config, length: int) -> float:
    """Model FLOPs of one LoRA step (recompute not counted): forward 2 x matmul parameters
    per token, backward 2 x again (the input gradients; the frozen weights get none), and
    causal attention 2 x 2 x L^2 / 2 x hidden per layer forward, 2.5 x that in backward."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = h * config.num_key_value_heads // config.num_attention_heads
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size) \
        + h * config.vocab_size
    attention = layers * 2 * length * length * h  # forward, causal
    return 4 * matmul * length + 3.5 * attention


def _length_within(config, planned: int, seconds: float, tflops: float) -> int:
    length = planned
    while length > GRANULARITY and step_flops(config, length) / (tflops * 1e12) > seconds:
        length -= GRANULARITY
    return length


def run(device: torch.device, tiny: bool, log, seconds_left: float,
        attention_tflops: float | None = None) -> dict:
    import peft
    from transformers import AutoModelForCausalLM

    import easy_context as ec
    from easy_context.memory.maxlen import apply_max_length
    from easy_context.memory.peak import PeakMemory
    from easy_context.plan.lora import LINEAR

    from benchmarks.gpu_check_train import llama3_8b_config, peak_flops

    config = llama3_8b_config(4 if tiny else 32, tiny)
    auto, shape = plan(config, device, tiny)
    row = {"layers": config.num_hidden_layers, "lora_rank": RANK, "planned_reason": auto.reason,
           "planned_length": auto.seq_len}
    if auto.setup is None:
        return {**row, "skipped": auto.reason}
    setup = auto.setup
    row["setup"] = {"checkpointing": setup.checkpointing, "mlp_tile": setup.mlp_tile,
                    "heads_per_chunk": setup.heads_per_chunk, "keep_every": setup.keep_every}
    tflops = attention_tflops or ASSUMED_TFLOPS
    length = auto.seq_len if tiny else _length_within(config, auto.seq_len, 0.6 * seconds_left,
                                                      tflops)
    if tiny:
        length = min(length, 512)
    row.update({"L": length, "assumed_tflops": tflops,
                "cut_to_the_time_budget": not tiny and length < auto.seq_len})
    from easy_context.plan.estimate import estimate_memory

    est = estimate_memory(shape, length, 1, setup.method, **setup.kw(
        "bf16" if device.type == "cuda" else "fp32"))
    row["planned_total_bytes"] = est.total
    row["planned_host_bytes"] = est.host_bytes
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # initialised in place: nothing read from disk
        model = AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LINEAR),
                           lora_dropout=0.0, bias="none")
    from easy_context.train.lora import inject_lora

    inject_lora(model, lora)
    ec.apply_sequence_parallel(model, "local")
    if setup.fused:
        apply_max_length(model, setup.mlp_tile, setup.heads_per_chunk, setup.checkpointing,
                         setup.keep_every)
    else:
        from easy_context.memory.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, setup.checkpointing)
    model.train()
    row["build_s"] = round(time.perf_counter() - t_build, 1)
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), device=device)
    pos = torch.arange(length, device=device)[None]
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    with PeakMemory(device) as peak:
        t0 = time.perf_counter()
        with autocast:
            loss = ec.causal_lm_loss(model, ids[:, :-1], pos, ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    flops = step_flops(config, length)
    pf = peak_flops(device)
    row.update({"loss": loss.item(), "loss_finite": bool(torch.isfinite(loss)),
                "step_s": round(seconds, 2), "tokens_per_s": round(length / seconds, 1),
                "model_tflops_per_s": round(flops / seconds / 1e12, 3),
                "mfu": None if pf is None else round(flops / seconds / pf, 3),
                "trainable_parameters": sum(p.numel() for p in adapters),
                "peak_above_start_bytes": peak.peak_bytes})
    if device.type == "cuda":  # from before the model was built: what the plan totals
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_over_planned"] = round(row["peak_allocated_bytes"] / est.total, 3)
    log(f"record: L={length} (planned {auto.seq_len}), {row['step_s']} s, loss {row['loss']:.3f}")
    del model, opt, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row
