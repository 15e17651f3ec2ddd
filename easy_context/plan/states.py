"""Model states per device: parameters, gradients, optimizer states and what the engine
gathers, for full fine-tuning (this module) and LoRA (lora.py builds on the same record)."""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape, linear_dims


@dataclass(frozen=True)
class States:
    params: int
    grads: int
    grads_in_backward: int
    optim: int
    step: int
    gathered: int
    host: int


def loss_head_grad_bytes(shape: ModelShape, a: int) -> int:
    """Bytes the chunked loss's backward holds for the output head's gradient beyond the
    gradient itself (easy_context.memory.loss.add_matmul_): in float32 the chunks accumulate
    into it inside the GEMM (nothing more); in bf16 its float32 accumulator, and each chunk's
    (V, H) product in bf16 before it is added (an accelerator whose GEMM writes float32 into
    the accumulator forms none: counted anyway, since that is probed at run time)."""
    if a == 4:
        return 0
    return shape.vocab * shape.hidden * (a + 4)


def parameter_shapes(shape: ModelShape, linears: bool = True) -> list[tuple[int, int]]:
    """(rows, columns) of every parameter tensor (norms: (hidden, 1)), as FSDP2 shards them
    (along rows); ``linears=False`` leaves out the decoder layers' linear weights."""
    h = shape.hidden
    layer = [(out, inp) for inp, out in linear_dims(shape).values()] if linears else []
    layer += [(h, 1), (h, 1)]
    if shape.qkv_bias:
        layer += [(shape.heads * shape.hd, 1)] + [(shape.kv_heads * shape.hd, 1)] * 2
    embeddings = [(shape.vocab, h)] * (1 if shape.tied_embeddings else 2)
    return layer * shape.layers + embeddings + [(h, 1)]


def pinned_rounding(shape: ModelShape, world_size: int, bytes_per: int = 4,
                    without_linears: bool = False) -> int:
    """Host bytes torch's caching host allocator adds to one copy of FSDP2's pinned shards
    (``CPUOffloadPolicy(pin_memory=True)``: each parameter's shard a block of its own, rounded
    up to a power of two; memory/pinned.py). ``without_linears``: the decoder layers' linear
    weights are not FSDP parameters (a 4-bit base)."""
    from ..memory.pinned import caching_allocator_bytes

    extra = 0
    for rows, cols in parameter_shapes(shape, linears=not without_linears):
        nbytes = -(-rows // world_size) * cols * bytes_per
        extra += caching_allocator_bytes(nbytes) - nbytes
    return extra


def model_states(shape: ModelShape, world_size: int, engine: str, offload: str,
                 dtype: str, device: str = "gpu", vision=None) -> States:
    """Parameters, gradients and optimizer states per device, and their host share.

    AdamW keeps two fp32 moments (8 B/param). bf16 mixed precision keeps fp32 master weights:
    - fsdp (FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): sharded fp32
      params 4/N, fp32 grads 4/N, moments 8/N; offload=params (CPUOffloadPolicy) moves all
      three to the host. FSDP has no optimizer-only offload.
    - deepspeed (ZeRO-3, bf16): bf16 params 2/N, bf16 grads 2/N, fp32 master + moments 12/N;
      offload=optimizer moves the 12/N (and fp32 gradient copies, 4/N) to the host,
      offload=params also the bf16 params and grads.
    - replicated (plain data parallelism, one process on CPU): everything on every device;
      bf16 adds a bf16 working copy (autocast's weight cache) to fp32 params.
    fp32 training: 4 (params) + 4 (grads) + 8 (moments), no master copy.
    Gradients appear layer by layer in backward (set_to_none between steps): at its start
    only the output head's and one layer's exist. DeepSpeed keeps its partitioned gradient
    buffer between steps, so there all of them count from the start.
    The AdamW step on the device (torch's foreach implementation) makes one temporary the
    size of the moments it updates (sqrt of the second moment): 4 B per device-held param.
    Sharded engines gather the full weights of the layer being computed and of the one being
    prefetched, and hold that layer's unsharded gradients until they are reduce-scattered:
    2 x (params + grads) of the largest unit, a decoder layer or the embedding/output head.
    FSDP's offloaded parameters and gradients on a GPU are pinned, one block per parameter
    shard through torch's caching host allocator, which rounds each up to a power of two:
    the host share counts that rounding (pinned_rounding). The moments are not pinned.
    ``vision`` (a plan.vision.VisionShape): the vision tower and projector train too, sharded
    as the decoder is (its blocks are units of their own: FSDP2 wraps each, ZeRO-3 gathers
    each when it runs); the largest unit gathered is the larger of a decoder layer's and
    a tower block's (or its embedding, or merger).
    """
    p = shape.num_params()
    head, layer = shape.vocab * shape.hidden, shape.layer_params()
    if vision is not None:
        p += vision.num_params()
        layer = max(layer, vision.largest_unit())
    if engine == "fsdp" and offload == "optimizer":
        raise ValueError("FSDP offloads parameters, gradients and optimizer states together "
                         "(CPUOffloadPolicy): use offload='params', or engine='deepspeed'")
    if engine == "replicated":
        if offload != "none":
            raise ValueError("offload needs a sharding engine (fsdp or deepspeed)")
        param_b = 4 + (2 if dtype == "bf16" else 0)
        return States(p * param_b, p * 4, (head + layer) * 4, p * 8, p * 4, 0, 0)
    n = world_size
    compute_b = 2 if dtype == "bf16" else 4
    gathered = 2 * max(layer, head) * 2 * compute_b
    if dtype == "bf16" and engine == "deepspeed":
        per = {"params": 2, "grads": 2, "optim": 12}
    else:
        per = {"params": 4, "grads": 4, "optim": 8}
    on_host = {"none": (), "optimizer": ("optim",), "params": ("params", "grads", "optim")}[offload]
    dev = {k: 0 if k in on_host else -(-p * v // n) for k, v in per.items()}
    host = sum(-(-p * per[k] // n) for k in on_host)
    if engine == "deepspeed" and "optim" in on_host:
        host += -(-p * 4 // n)  # ZeRO-Offload's fp32 gradient copies for the CPU Adam step
    if engine == "fsdp" and offload == "params" and device != "cpu":
        host += 2 * pinned_rounding(shape, n)  # the pinned fp32 params and gradients
    grads_bwd = dev["grads"] if engine == "deepspeed" else -(-(head + layer) * per["grads"] // n)
    grads_bwd = min(grads_bwd, dev["grads"])
    step = 0 if "optim" in on_host else -(-p * 4 // n)
    return States(dev["params"], dev["grads"], grads_bwd, dev["optim"], step, gathered, host)
