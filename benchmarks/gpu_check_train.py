"""gpu_check, part 3: one training step of a Llama-3-8B-shaped model, and attention TFLOP/s.

Training step: full width (hidden 4096, 32 heads on 8 KV heads, MLP 14336, vocabulary
128256), 2 of its 32 layers, random weights in bf16, one sequence of L tokens on one device
through the public API: a transformers model from its config, apply_sequence_parallel (local
on one device), full activation checkpointing (easy_context.memory.checkpointing), the
chunked loss (causal_lm_loss), backward, AdamW. Measured: peak allocated and reserved memory
above the weights during forward + backward, and during the optimizer step; tokens/s; model
FLOP utilisation (6 x matmul parameters + 6 x layers x L x hidden per token, recompute not
counted, over the GPU's dense bf16 peak). Predicted: easy_context.plan.estimate_memory's
per-layer components for the same model, L and checkpointing (stored activations, the last
layer's backward, the loss) plus the gradients alive when backward starts (the output
head's and one layer's, bf16 here): what the measured peak above the weights should be.

The same step in max-length mode (MLP tiles, one KV head's query heads per attention chunk)
at the longest length: its measured peak against the planner's fused-layer terms.

Attention TFLOP/s: causal forward + backward at 32K tokens, 32 heads on 8 KV heads, D=128,
bf16, through local_attention (the kernel easy_context picks) against torch's
scaled_dot_product_attention; FLOPs = 3.5 x the forward's 2 x H x S^2 x D (causal).
"""

from __future__ import annotations

import time

import torch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12,
                   "B200": 2250e12, "GH200": 989e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    hits = [v for k, v in PEAK_BF16_FLOPS.items() if k in name]
    return max(hits) if hits else None


def llama3_8b_config(layers: int, tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=160, vocab_size=512,
                           max_position_embeddings=1 << 20, attention_dropout=0.0)
    return LlamaConfig(hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                       max_position_embeddings=1 << 20, rope_theta=500000.0,
                       attention_dropout=0.0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reserved(device) -> int | None:
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def _reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def predicted(config, length: int, device, maxlen: dict | None = None) -> dict:
    from easy_context.plan.estimate import estimate_memory
    from easy_context.plan.shapes import shape_from_config

    shape = shape_from_config(config, "Llama-3-8B (2 layers)")
    est = estimate_memory(shape, length, 1, "local", engine="replicated", checkpointing="full",
                          dtype="bf16", device="gpu" if device.type == "cuda" else "cpu",
                          **(maxlen or {}))
    grads_at_start = (shape.vocab * shape.hidden + shape.layer_params()) * 2
    above_weights = est.stored_activations + max(est.layer_phase, est.loss) + grads_at_start
    return {"stored_activations": est.stored_activations, "mlp_backward": est.mlp_backward,
            "attention_backward": est.attention_backward, "loss": est.loss,
            "gradients_in_backward_bf16": grads_at_start, "above_weights": above_weights}


def top_ops(device: torch.device, run, top: int = 15) -> dict:
    """What ``run()`` spends its time in, from torch.profiler: the ``top`` operators (on a GPU:
    kernels) by self time on the device that runs them, each with its calls, milliseconds and
    share of the total; the next GPU run then says where a step's time went."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    # torch >= 2.4 names the device column self_device_time_total (self_cuda_time_total before)
    attr = next((a for a in ("self_device_time_total", "self_cuda_time_total")
                 if cuda and hasattr(prof.key_averages()[0], a)), "self_cpu_time_total")
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total_us = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return {"clock": attr, "total_ms": round(total_us / 1e3, 3),
            "top": [{"name": e.key[:120], "calls": e.count,
                     "self_ms": round(getattr(e, attr) / 1e3, 3),
                     "share": round(getattr(e, attr) / total_us, 4) if total_us else None}
                    for e in events[:top]]}


def train_step(length: int, device: torch.device, tiny: bool, free_bytes: int | None,
               maxlen: dict | None = None, profile: bool = False) -> dict:
    """One step at ``length``; ``maxlen`` ({"mlp_tile": T, "heads_per_chunk": C}): in
    max-length mode (easy_context.memory.maxlen, full checkpointing) instead of the plain
    layers with full activation checkpointing. ``profile``: after the timed step, one more
    forward + backward under torch.profiler (top_ops), so the timing itself is unprofiled."""
    from transformers import AutoModelForCausalLM

    import easy_context as ec
    from easy_context.memory.checkpointing import apply_activation_checkpointing
    from easy_context.memory.peak import PeakMemory

    config = llama3_8b_config(2, tiny)
    pred = predicted(config, length, device, maxlen)
    row = {"L": length, "max_length_mode": maxlen, "predicted_bytes": pred}
    # Past the free memory by a margin the planner could be wrong by, an OOM is certain and
    # costs time for nothing; nearer, the attempt (or its OOM) checks the prediction.
    if free_bytes is not None and pred["above_weights"] > 1.25 * free_bytes:
        row["skipped"] = (f"predicted {pred['above_weights'] / 2**30:.1f} GiB above the weights, "
                          f"{free_bytes / 2**30:.1f} GiB free")
        return row
    torch.manual_seed(0)
    with torch.device(device):  # initialised in place (1.5B parameters)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ec.apply_sequence_parallel(model, "local")
    if maxlen:
        from easy_context.memory.maxlen import apply_max_length

        apply_max_length(model, maxlen["mlp_tile"], maxlen["heads_per_chunk"], "full")
    else:
        apply_activation_checkpointing(model, "full")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(length, device=device)[None]
    _reset(device)
    with PeakMemory(device) as fb:
        t0 = time.perf_counter()
        loss = ec.causal_lm_loss(model, inputs, pos, targets)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
    fb_reserved = _reserved(device)
    _reset(device)
    with PeakMemory(device) as st:
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
    step_reserved = _reserved(device)
    n_matmul = sum(p.numel() for n, p in model.named_parameters()
                   if p.dim() == 2 and "embed_tokens" not in n)
    flops = length * (6 * n_matmul + 6 * config.num_hidden_layers * length * config.hidden_size)
    pf = peak_flops(device)
    row.update({
        "loss": loss.item(), "forward_backward_s": round(t1 - t0, 3), "optimizer_s": round(t2 - t1, 3),
        "tokens_per_s": round(length / (t2 - t0), 1),
        "peak_allocated_above_weights_bytes": fb.peak_bytes,
        "peak_reserved_bytes": fb_reserved, "optimizer_peak_above_start_bytes": st.peak_bytes,
        "optimizer_peak_reserved_bytes": step_reserved,
        "measured_over_predicted": round(fb.peak_bytes / pred["above_weights"], 3),
        "model_tflops_per_s": round(flops / (t2 - t0) / 1e12, 4),
        "mfu": None if pf is None else round(flops / (t2 - t0) / pf, 3)})
    if profile:
        def step():
            ec.causal_lm_loss(model, inputs, pos, targets).backward()
        row["profile"] = top_ops(device, step)
        opt.zero_grad(set_to_none=True)
    del model, opt, loss
    _reset(device)
    return row


def attention_tflops(device: torch.device, tiny: bool, repeats: int = 5) -> dict:
    import torch.nn.functional as F

    from easy_context.attention import select_kernel
    from easy_context.parallel.local import local_attention

    s, hq, hkv, d = (256, 4, 2, 64) if tiny else (32768, 32, 8, 128)
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, d, generator=g).to(device=device, dtype=dtype)
                   for h in (hq, hkv, hkv, hq))
    flops = 3.5 * 2 * hq * s * s * d

    def ours():
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        local_attention(*ins, causal=True).backward(do)

    def sdpa():
        ins = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ins, is_causal=True, enable_gqa=True).backward(
            do.transpose(1, 2))

    def timed(fn):
        fn()
        _sync(device)
        if device.type == "cuda":  # what one call adds above its inputs, at its peak
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            fn()
            _sync(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    def sdpa_on(backend):
        from torch.nn.attention import sdpa_kernel

        def run():
            with sdpa_kernel([backend]):
                sdpa()
        return run

    from easy_context.attention.workspace import backward_workspace

    out = {"L": s, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": "bf16",
           "kernel": select_kernel(q).name,
           # what the head-group budget counts for one backward call (flash op, and cuDNN's
           # assumed the same): to read beside the measured peaks
           "modelled_backward_workspace_bytes": backward_workspace("flash2", 1, s, s, hq, hkv,
                                                                   d, 2)}
    contenders = [("easy_context", ours), ("torch_sdpa", sdpa)]
    if device.type == "cuda":  # which of sdpa's backends its default picks, by their times
        from torch.nn.attention import SDPBackend

        contenders += [(f"torch_sdpa_{b.name.lower()}", sdpa_on(b)) for b in
                       (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION)]
        contenders.append(("cudnn_op_with_lse", lambda: cudnn_op(q, k, v, do)))
    for name, fn in contenders:
        try:
            peaks = []
            t = timed(fn)
            out[name] = {"fwd_bwd_s": round(t, 5), "tflops_per_s": round(flops / t / 1e12, 4),
                         "peak_above_inputs_bytes": peaks[0] if peaks else None}
        except Exception as e:  # noqa: BLE001 - recorded
            out[name] = {"failed": f"{type(e).__name__}: {e}"[:400]}
    if device.type == "cuda":
        try:
            out["cudnn_op_against_flash_op"] = cudnn_against_flash(q, k, v, do)
        except Exception as e:  # noqa: BLE001 - recorded
            out["cudnn_op_against_flash_op"] = {"failed": f"{type(e).__name__}: {e}"[:400]}
    return out


def _cudnn(q, k, v, do):
    """aten's cuDNN attention op with its log-sum-exp, forward and backward, K/V repeated to
    the query heads: (out, lse, dq, dk, dv), heads first. A probe for a cuDNN kernel behind
    easy_context's contract (not one yet): does it run, how fast, what lse layout."""
    qh = q.transpose(1, 2)
    g = q.size(2) // k.size(2)
    kh, vh = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, True,
                                                            False)
    out, lse, cq, ck, mq, mk, seed, offset = res[:8]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do.transpose(1, 2), qh, kh, vh, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True)
    return out, lse, dq, dk, dv


def cudnn_op(q, k, v, do):
    _cudnn(q, k, v, do)


def cudnn_against_flash(q, k, v, do) -> dict:
    """The cuDNN op's output, lse and gradients against the flash op's (easy_context's path
    on this GPU), as max |difference| / max |flash|; the lse's shape and strides."""
    from easy_context.attention.cuda_ops import cuda_backward, cuda_forward

    out, lse, dq, dk, dv = _cudnn(q, k, v, do)
    f_out, f_lse = cuda_forward(q, k, v, True, path="flash")
    f_dq, f_dk, f_dv = cuda_backward(do, q, k, v, f_out, f_lse, True, path="flash")
    hkv, g = k.size(2), q.size(2) // k.size(2)
    fold = lambda t: t.transpose(1, 2).unflatten(2, (hkv, g)).sum(3)  # noqa: E731

    def rel(a, b):
        a, b = a.float(), b.float()
        return round(((a - b).abs().max() / b.abs().max()).item(), 6)

    return {"lse_shape": list(lse.shape), "lse_stride": list(lse.stride()),
            "lse_dtype": str(lse.dtype), "out": rel(out.transpose(1, 2), f_out),
            "lse": rel(lse.reshape(f_lse.shape), f_lse), "dq": rel(dq.transpose(1, 2), f_dq),
            "dk": rel(fold(dk), f_dk), "dv": rel(fold(dv), f_dv)}
