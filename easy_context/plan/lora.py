"""LoRA in the memory planner: a frozen base, and adapters that carry the gradients and states.

``estimate_memory(..., lora=LoRASpec(rank=16))`` changes the full fine-tuning estimate where
LoRA changes what a step holds (easy_context/train/lora.py trains this way):

- parameters: the frozen base as the engine stores it, plus the adapters; ``T`` adapter
  parameters = rank x (in + out) for each adapted linear module of each layer;
- gradients and AdamW states: the adapters' only (the base is in no optimizer);
- sharded engines gather one layer's weights as before, but hold its adapters' gradients
  only (no weight gradients of the frozen base);
- activations: what full fine-tuning stores, plus each adapted module's ``A x`` (rank values
  a token, saved for B's gradient; the module's input is saved once, by ``A``, as the base
  would have saved it), less what only the frozen weights' gradients needed: each RMSNorm's
  normalized value, and the first layer's norm input (measured on CPU within a few percent:
  benchmarks/results/lora_memory.json);
- loss: the chunked loss forms no gradient of the frozen output head.

How the engines store the frozen base: FSDP2 keeps it in fp32 (the model is built in fp32;
mixed precision casts it for compute); ZeRO-3 in the compute dtype (bf16), with no fp32 master
copy, which only trainable parameters get. ``--offload params`` moves it to the host with the
rest. A 4-bit base (``base_4bit``, QLoRA, FSDP only; easy_context/train/qlora.py): the decoder
layers' linear weights are NF4 (half a byte per weight, plus one fp32 scale per block of 64)
on every device, not sharded; the embeddings, norms and output head stay as above. Each
4-bit matmul dequantizes its weight to the compute dtype for the time of one product.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .shapes import ModelShape, linear_dims
from .states import States, loss_head_grad_bytes, model_states, pinned_rounding

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
NF4_BLOCK = 64


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    targets: tuple[str, ...] = LINEAR
    """adapted modules of each decoder layer (default: every linear one, --lora-targets all-linear)"""
    base_4bit: bool = False
    """QLoRA: the decoder layers' linear weights stored in 4-bit NF4, replicated"""

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = set(self.targets) - set(LINEAR)
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be among {LINEAR}, got {self.targets}")

    def describe(self) -> str:
        what = "all linear" if set(self.targets) == set(LINEAR) else ",".join(self.targets)
        return f"LoRA r={self.rank} on {what}" + (", 4-bit base" if self.base_4bit else "")


def parse_targets(text: str | None) -> tuple[str, ...]:
    """``--lora-targets`` (all-linear, or comma-separated names) as LoRASpec.targets."""
    if not text or text.strip() == "all-linear":
        return LINEAR
    return tuple(t.strip() for t in text.split(",") if t.strip())


def adapter_params_per_layer(shape: ModelShape, spec: LoRASpec) -> int:
    dims = linear_dims(shape)
    return sum(spec.rank * (dims[t][0] + dims[t][1]) for t in spec.targets)


def adapter_params(shape: ModelShape, spec: LoRASpec) -> int:
    return shape.layers * adapter_params_per_layer(shape, spec)


def nf4_bytes(weights: int) -> int:
    """Bytes of ``weights`` stored as NF4: two per byte, one fp32 absmax per block."""
    return -(-weights // 2) + 4 * -(-weights // NF4_BLOCK)


def quantized_weights_per_layer(shape: ModelShape) -> int:
    return sum(a * b for a, b in linear_dims(shape).values())


def lora_states(shape: ModelShape, spec: LoRASpec, world_size: int, engine: str, offload: str,
                dtype: str, device: str = "gpu"):
    """Model states per device (estimate.States) of a LoRA run; see the module docstring."""
    if engine == "fsdp" and offload == "optimizer":
        raise ValueError("FSDP offloads parameters, gradients and optimizer states together "
                         "(CPUOffloadPolicy): use offload='params', or engine='deepspeed'")
    if spec.base_4bit and engine == "deepspeed":
        raise ValueError("a 4-bit base (QLoRA) runs on the fsdp engine only")
    p, t = shape.num_params(), adapter_params(shape, spec)
    t_layer = adapter_params_per_layer(shape, spec)
    quant = shape.layers * quantized_weights_per_layer(shape) if spec.base_4bit else 0
    q_bytes = nf4_bytes(quant)
    head, layer = shape.vocab * shape.hidden, shape.layer_params()
    compute_b = 2 if dtype == "bf16" else 4
    if engine == "replicated":
        if offload != "none":
            raise ValueError("offload needs a sharding engine (fsdp or deepspeed)")
        # autocast caches a compute-dtype copy of the weights that require a gradient only
        param_b = 4 + (2 if dtype == "bf16" else 0)
        return States((p - quant) * 4 + q_bytes + t * param_b, t * 4, t_layer * 4, t * 8, t * 4,
                      0, 0)
    n = world_size
    if dtype == "bf16" and engine == "deepspeed":
        base_b, per = 2, {"params": 2, "grads": 2, "optim": 12}
    else:
        base_b, per = 4, {"params": 4, "grads": 4, "optim": 8}
    on_host = {"none": (), "optimizer": ("optim",), "params": ("params", "grads", "optim")}[offload]
    sharded = {k: -(-t * v // n) for k, v in per.items()}
    sharded["params"] += -(-(p - quant) * base_b // n)  # the frozen base, less its 4-bit part
    dev = {k: 0 if k in on_host else v for k, v in sharded.items()}
    dev["params"] += q_bytes  # not sharded, never offloaded: every device computes with it
    host = sum(sharded[k] for k in on_host)
    if engine == "deepspeed" and "optim" in on_host:
        host += -(-t * 4 // n)  # ZeRO-Offload's fp32 gradient copies for the CPU Adam step
    if engine == "fsdp" and offload == "params" and device != "cpu":
        # the pinned shards of the frozen base, each rounded up (states.pinned_rounding)
        host += pinned_rounding(shape, n, base_b, without_linears=spec.base_4bit)
    grads_bwd = dev["grads"] if engine == "deepspeed" else min(
        dev["grads"], -(-t_layer * per["grads"] // n))
    step = 0 if "optim" in on_host else -(-t * 4 // n)
    # The unsharded weights of the layer in use and of the one prefetched, and the layer's
    # adapter gradients; a 4-bit layer gathers its norms only and dequantizes one weight.
    unit = layer - (quantized_weights_per_layer(shape) if spec.base_4bit else 0)
    gathered = 2 * (max(unit, head) + t_layer) * compute_b
    if spec.base_4bit:
        gathered += max(a * b for a, b in linear_dims(shape).values()) * compute_b
    return States(dev["params"], dev["grads"], grads_bwd, dev["optim"], step, gathered, host)


def with_lora(est, shape: ModelShape, spec: LoRASpec, chunk_rows: int | None,
              device: str = "gpu"):
    """``est`` (a full fine-tuning MemoryEstimate) for the same step with LoRA."""
    if spec.base_4bit and est.engine == "deepspeed":
        raise ValueError("a 4-bit base (QLoRA) runs on the fsdp engine only")
    full = model_states(shape, est.world_size, est.engine, est.offload, est.dtype, device)
    st = lora_states(shape, spec, est.world_size, est.engine, est.offload, est.dtype, device)
    a = 2 if est.dtype == "bf16" else 4
    s = est.seq_len // est.world_size
    # Added: A x of each adapted module, per token, saved for B's gradient. Removed: the
    # RMSNorms' normalized value (H x a), which only their (frozen) weight's gradient needs;
    # and in the first layer, its input norm's fp32 input (H x 4): nothing before the first
    # adapter needs a gradient. Saved for the step's backward (no checkpointing: every
    # layer) or in the one layer being recomputed (the others); the final norm's in both.
    attn_extra = spec.rank * a * sum(t in ATTENTION for t in spec.targets)
    extra = spec.rank * a * len(spec.targets)
    norm = shape.hidden * a
    stored, mlp_w, attn_w = est.stored_activations - s * norm, est.mlp_backward, est.attention_backward
    if est.checkpointing == "none":
        stored += shape.layers * s * (extra - 2 * norm) - s * shape.hidden * 4
    else:
        mlp_w, attn_w = mlp_w + s * (extra - 2 * norm), attn_w + s * (attn_extra - norm)
    # the chunked loss's head gradient terms (estimate.loss_bytes): the head is frozen
    head_grad = 0 if chunk_rows is None else loss_head_grad_bytes(shape, a)
    return dataclasses.replace(
        est, model=f"{est.model} ({spec.describe()})", parameters=st.params,
        gradients=st.grads, gradients_in_backward=st.grads_in_backward, optimizer=st.optim,
        optimizer_step=st.step, gathered_parameters=st.gathered, stored_activations=stored,
        mlp_backward=mlp_w, attention_backward=attn_w, loss=est.loss - head_grad,
        host_bytes=est.host_bytes - full.host + st.host)
