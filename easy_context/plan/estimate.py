"""Per-device memory of one training step: model states, activations, attention, loss.

A step's peak comes in one of two phases, and the estimate is the larger:

    backward  = P + O + G_bwd + gathered + stored + max(mlp_bwd, attn_bwd + buffers, loss) + runtime
    step      = P + O + G                + step temporaries                                 + runtime

P, O: parameters and optimizer states (held all along); G: every gradient (at the end of
backward); G_bwd: the gradients alive at the start of backward (the output head's and one
layer's, as they are created layer by layer; DeepSpeed keeps a persistent partitioned buffer,
so all of them); gathered: sharded engines' unsharded layer weights (resharded when backward
ends, so not during the optimizer step); stored: activations kept
from forward to backward (every layer); then the largest transient of backward: the loss
(every layer's stored activations are alive while it is computed), or the last layer's
backward: its MLP half (the layer's recomputed activations plus MLP gradients) or its
attention half (the MLP's saved tensors are freed by then; attention gradients and the
method's communication buffers). runtime: the CUDA context / CPU runtime, a constant.

In max-length mode (easy_context.memory.maxlen: ``mlp_tile``, ``heads_per_chunk``,
``keep_every``) the stored activations and the layer's two halves are those of the fused
layer instead (plan/fused.py), or of the generic layer (plan/generic.py) where a layer kind
takes that path (ModelShape.maxlen_path), and the loss phase keeps the un-normed last hidden states,
whose gradient its backward writes over them.

Batch size 1 (one packed sequence per step), as long-context training does; token counts are
per device: s = seq_len / world_size. Bytes per element: ``a`` for activations (2 in bf16
mixed precision, 4 in fp32); softmax statistics (lse), norm statistics and attention
accumulators are fp32 whatever ``a``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..parallel import get_method
from .shapes import ModelShape
from .states import States, loss_head_grad_bytes, model_states
from .recurrent import (  # noqa: F401 - re-exported: the recurrent layers' terms live there
    CHUNK_MATRICES, DELTA_CHUNK, GPU_CHUNK_MATRICES, GPU_HEAD_VECTORS, HEAD_VECTORS,
    pieces_per_rank, recurrent_saved_per_token, recurrent_transient_per_token, state_bytes,
    state_communication_per_layer)
from .vision import estimate_terms
from ..attention.workspace import DEFAULT_SMS, backward_workspace, planned_family

GIB = 2**30
ENGINES = ("fsdp", "deepspeed", "replicated")
OFFLOADS = ("none", "optimizer", "params")
CHECKPOINTING = ("none", "full", "offload", "attention")
DTYPES = ("bf16", "fp32")
# What a CPU process adds on first use of the runtime (oneDNN, autograd engine, gloo buffers),
# measured by benchmarks/plan_validation.py --calibrate on a model of a few MB (19.5 MiB).
CPU_RUNTIME_BYTES = 20 * 2**20
# CUDA context, NCCL communicators and cuBLAS workspaces: about 1-2 GiB in practice; we
# reserve 2 GiB (allocator fragmentation comes on top: the CLI plans with 95% of the memory).
GPU_RUNTIME_BYTES = 2 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device; ``total`` is the predicted peak (see the module docstring)."""

    model: str
    seq_len: int
    world_size: int
    method: str
    engine: str
    offload: str
    checkpointing: str
    dtype: str
    parameters: int
    gradients: int  # all of them, at the end of backward
    gradients_in_backward: int  # alive at the start of backward
    optimizer: int
    optimizer_step: int  # temporaries of the AdamW step
    gathered_parameters: int
    stored_activations: int
    mlp_backward: int  # last layer's recomputed activations + its MLP-backward gradients
    attention_backward: int  # ... once the MLP's are freed: + attention-backward gradients
    attention_buffers: int  # the method's communication buffers (ring K/V, gathered K/V, a2a)
    loss: int
    runtime: int
    host_bytes: int  # CPU memory per device for offloaded states / checkpoints (not in total)
    communication_per_layer: int = 0  # bytes a device sends per layer, fwd + bwd (not memory)
    # the kernel's backward workspace of one call (attention/workspace.py: flash-attn's float32
    # dq_accum, GQA's expanded dK/dV, deterministic splits), with the head groups chosen
    attention_workspace: int = 0
    # max-length mode (easy_context.memory.maxlen; plan/fused.py): None = the untiled layer
    mlp_tile: int | None = None
    heads_per_chunk: int | None = None
    keep_every: int = 1
    # hybrid models (plan/layers.py): layers with attention / with a recurrent mixer, and per
    # recurrent layer the bytes one rank sends per step for its state exchange (the (A, B)
    # all-gather and the conv halo, fwd + bwd: recurrent.mixer.Mixer.comm_bytes) and the
    # gathered (A, B) maps it holds (every rank's pieces, float32)
    attention_layers: int = 0
    recurrent_layers: int = 0
    state_communication_per_layer: int = 0
    state_bytes_per_layer: int = 0
    # sliding-window attention layers (of attention_layers) and what one of them sends: the
    # ring methods move only the K/V rows the window reads (parallel/window_cost.py)
    window_layers: int = 0
    window_communication_per_layer: int = 0
    # a vision-language model's tower (plan/vision.py): what encoding this rank's images
    # stores until the tower's backward (held through the decoder's backward), and the
    # largest transient of the tower's own backward; its parameters are in the model states
    vision_activations: int = 0
    vision_backward: int = 0
    vision_parameters: int = 0  # the tower's and projector's parameter count (not bytes)
    image_tokens: int = 0  # placeholder tokens this rank encodes (the worst rank's)
    # multi-head latent attention under a method that sends the latent (all-gather): the
    # values a token's latent holds (kv_lora_rank + rope); 0: the expanded K/V travel
    latent_values: int = 0

    COMPONENTS = ("parameters", "gradients", "gradients_in_backward", "optimizer",
                  "optimizer_step", "gathered_parameters", "stored_activations", "mlp_backward",
                  "attention_backward", "attention_buffers", "attention_workspace", "loss",
                  "runtime")
    VISION = ("vision_activations", "vision_backward")

    @property
    def communication_per_step(self) -> int:
        """Bytes one rank sends per step over every layer: attention (window layers at their
        own figure) and state exchange."""
        return ((self.attention_layers - self.window_layers) * self.communication_per_layer
                + self.window_layers * self.window_communication_per_layer
                + self.recurrent_layers * self.state_communication_per_layer)

    @property
    def layer_phase(self) -> int:
        """The last layer's backward: the larger of its MLP and attention halves."""
        return max(self.mlp_backward, self.attention_layer)

    @property
    def attention_layer(self) -> int:
        """The last layer's attention half: its gradients, the method's buffers and one
        kernel call's workspace."""
        return self.attention_backward + self.attention_buffers + self.attention_workspace

    @property
    def backward_phase(self) -> int:
        # the tower's saved tensors live from its forward (first) to its backward (last);
        # its backward's transient is counted beside the decoder's stored activations,
        # which are freed by then (conservative)
        return (self.gathered_parameters + self.gradients_in_backward + self.stored_activations
                + self.vision_activations + max(self.layer_phase, self.loss,
                                                self.vision_backward))

    @property
    def step_phase(self) -> int:
        return self.gradients + self.optimizer_step

    @property
    def total(self) -> int:
        # FSDP and ZeRO-3 reshard every layer when backward ends: the gathered weights count
        # in the backward phase only, not while the optimizer steps
        held = self.parameters + self.optimizer + self.runtime
        return held + max(self.backward_phase, self.step_phase)

    def components(self) -> dict[str, int]:
        names = self.COMPONENTS + (self.VISION if self.vision_parameters else ())
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "backward_phase": self.backward_phase,
                "step_phase": self.step_phase,
                "communication_per_step": self.communication_per_step}

    def table(self) -> str:
        """A text breakdown, GiB per device. Rows marked with the phase they belong to; only
        the larger phase (and within backward, the larger transient) is in the total."""
        bwd = self.backward_phase >= self.step_phase
        # the backward phase's held terms, then its largest transient (as backward_phase)
        held = {"gathered_parameters", "gradients_in_backward", "stored_activations",
                "vision_activations"}
        if not bwd:
            peak = {"gradients", "optimizer_step"}
        elif self.vision_backward > max(self.layer_phase, self.loss):
            peak = held | {"vision_backward"}
        elif self.loss > self.layer_phase:
            peak = held | {"loss"}
        elif self.mlp_backward >= self.attention_layer:
            peak = held | {"mlp_backward"}
        else:
            peak = held | {"attention_backward", "attention_buffers", "attention_workspace"}
        phase = {"gradients": "step", "optimizer_step": "step",
                 "gradients_in_backward": "backward", "stored_activations": "backward",
                 "gathered_parameters": "backward",
                 "mlp_backward": "backward, layer", "attention_backward": "backward, layer",
                 "attention_buffers": "backward, layer", "attention_workspace": "backward, layer",
                 "loss": "backward, loss", "vision_activations": "backward",
                 "vision_backward": "backward, tower"}
        lines = [f"{self.model}: L={self.seq_len:,} on {self.world_size} device(s), "
                 f"{self.method}, {self.engine}, offload={self.offload}, "
                 f"checkpointing={self.checkpointing}, {self.dtype}  (per device)"]
        if self.mlp_tile is not None:
            lines.append(f"  max-length mode: MLP tiles of {self.mlp_tile} tokens, "
                         f"{self.heads_per_chunk} query head(s) per attention chunk"
                         + (f", one layer input in {self.keep_every} kept (nested recompute)"
                            if self.keep_every > 1 else ""))
        for name, value in self.components().items():
            tag = phase.get(name, "held")
            lines.append(f"  {name.replace('_', ' '):24s} {value / GIB:10.2f} GiB   [{tag}]"
                         + ("" if tag == "held" or name in peak else " (not at peak)"))
        lines.append(f"  {'total (peak)':24s} {self.total / GIB:10.2f} GiB   "
                     f"[{'backward' if bwd else 'optimizer step'} phase]")
        if self.vision_parameters:
            lines.append(f"  vision tower: {self.vision_parameters / 1e6:,.1f}M parameters (in "
                         f"the states above), encoding {self.image_tokens:,} image tokens here")
        if self.host_bytes:
            lines.append(f"  {'host memory (offloaded)':24s} {self.host_bytes / GIB:10.2f} GiB")
        if self.communication_per_layer:
            lines.append(f"  {'sent per layer (fwd+bwd)':24s} "
                         f"{self.communication_per_layer / GIB:10.2f} GiB"
                         + (f"   [each of {self.attention_layers} attention layers]"
                            if self.recurrent_layers else "")
                         + (f"   [MLA latent: {self.latent_values} values a token, not the "
                            "expanded K/V]" if self.latent_values else ""))
        if self.window_layers and self.communication_per_layer:
            lines.append(f"  {'sent per window layer':24s} "
                         f"{self.window_communication_per_layer / GIB:10.2f} GiB   [each of "
                         f"{self.window_layers} sliding-window layers]")
        if self.recurrent_layers:
            lines.append(f"  {'state exchange per layer':24s} "
                         f"{self.state_communication_per_layer / GIB:10.4f} GiB   [each of "
                         f"{self.recurrent_layers} recurrent layers; holds "
                         f"{self.state_bytes_per_layer / 2**20:.1f} MiB of gathered states]")
            states = self.recurrent_layers * self.state_communication_per_layer
            lines.append(f"  {'sent per step, all layers':24s} "
                         f"{self.communication_per_step / GIB:10.2f} GiB   [state exchange "
                         f"{states / max(self.communication_per_step, 1):.1%}]")
        return "\n".join(lines)


# --------------------------------------------------------------------------- activations
def layer_saved_per_token(shape: ModelShape, a: int, method: str, world_size: int,
                          ring_degree: int | None = None) -> dict[str, int]:
    """Bytes per local token that one decoder layer saves for backward (no checkpointing).

    From what autograd keeps in a Llama block (transformers' code, our attention functions):
    - each RMSNorm: its fp32 upcast input (4; in fp32 the input itself), the normalized value
      in the input dtype (a) and its output (a), which the next projections save as their
      input: H x (4 + 2a);
    - attention: what the method's description says (Method.saved_per_token: RoPE'd q, k, v,
      the output and the lse; Ulysses keeps its head-sharded copies instead);
    - gated MLP: gate, SiLU(gate), up and their product (down_proj's input): 4 x I x a.
    """
    norm = shape.hidden * (4 + 2 * a)
    m = get_method("local" if world_size == 1 else method)
    attn = m.saved_per_token(shape.attention_dims(), a, world_size, ring_degree)
    width = latent_width(shape, method) if world_size > 1 else 0
    if width:  # MLA sending its latent keeps the whole sequence's K/V and latent (hf_latent.py)
        _, hkv, hd = shape.attention_dims()
        attn += (world_size - 1) * 2 * hkv * hd * a + world_size * width * a
    return {"input_norm": norm, "attention": attn, "post_norm": norm,
            "mlp": (4 if shape.gated_mlp else 2) * shape.intermediate * a}


def backward_transients(shape: ModelShape, a: int) -> tuple[int, int]:
    """(MLP half, attention half) gradient bytes per local token alive in a layer's backward.

    Both carry the residual-stream gradient in and out (2 x H x a). MLP: autograd frees each
    node's saved tensors once it has run, so while the gradients of the I-wide intermediates
    are formed, one I-wide saved tensor has already gone: net one I x a. Attention: dout,
    the dq/dk/dv results and one kernel call's dq/dk/dv, in the input dtype (the methods'
    fp32 accumulators are in :func:`attention_buffers`).
    """
    h, hd, hq, hkv = shape.hidden, shape.hd, shape.heads, shape.kv_heads
    residual = 2 * h * a
    return (residual + shape.intermediate * a,
            residual + hq * hd * a + 2 * (hq + 2 * hkv) * hd * a)


def kernel_workspace(device: str, a: int, kernel: str | None = None,
                     deterministic: bool = False, sms: int = DEFAULT_SMS):
    """The planner's ``workspace(sq, sk, hq, hkv, d, a)`` for one batch row: the backward
    workspace of the kernel family the device runs (attention/workspace.py), or None where
    it is not counted (the CPU's flash op)."""
    family = planned_family(device, "bf16" if a == 2 else "fp32", kernel)
    if family is None:
        return None
    return lambda sq, sk, hq, hkv, d, a: backward_workspace(
        family, 1, sq, sk, hq, hkv, d, a, deterministic=deterministic, sms=sms)


def attention_buffers(shape: ModelShape, s: int, a: int, method: str, world_size: int,
                      ring_degree: int | None = None, device: str = "gpu",
                      workspace=None) -> int:
    """The method's communication buffers alive in one layer's backward, bytes, for s local
    tokens (its description's ``buffers``; each method's module says what they are), with
    the KV-head groups it forms under the device's buffer budget
    (easy_context.parallel.head_groups), counting the kernel's ``workspace`` in that budget
    as the methods do at run time. One device (N = 1): none."""
    if world_size == 1:
        return 0
    m, dims = get_method(method), shape.attention_dims()
    if latent_width(shape, method):  # MLA's latent expands every head's K/V at once: one group
        return m.group_buffers(dims, s, a, world_size, ring_degree, dims.kv_heads)
    return m.buffers(dims, s, a, world_size, ring_degree, budget=_budget(device),
                     workspace=workspace)


def attention_workspace(shape: ModelShape, s: int, a: int, method: str, world_size: int,
                        ring_degree: int | None = None, device: str = "gpu",
                        workspace=None) -> int:
    """One backward kernel call's workspace, bytes, with the head groups the method picks
    (one device: the local call on the whole sequence)."""
    m = get_method("local" if world_size == 1 else method)
    if world_size > 1 and latent_width(shape, method):  # every head in one call (hf_latent.py)
        return m.workspace(shape.attention_dims(), s, a, world_size, ring_degree,
                           shape.kv_heads, workspace)
    return m.call_workspace(shape.attention_dims(), s, a, world_size, ring_degree,
                            budget=_budget(device), workspace=workspace)


def _budget(device: str) -> int:
    from ..parallel.head_groups import BUDGETS

    return BUDGETS["cpu" if device == "cpu" else "cuda"]


def communication_per_layer(shape: ModelShape, s: int, a: int, method: str, world_size: int,
                            ring_degree: int | None = None) -> int:
    """Bytes one rank sends per layer, forward and backward (Method.comm_bytes); for multi-head
    latent attention under a method that moves the latent, its latent instead of K/V
    (Method.latent_comm_bytes: kv_lora_rank + rope values a token, integrations/hf_latent.py)."""
    if world_size == 1:
        return 0
    m = get_method(method)
    width = latent_width(shape, method)
    if width:
        return m.latent_comm_bytes(width, s, a, world_size)
    return m.comm_bytes(shape.attention_dims(), s, a, world_size, ring_degree)


def latent_width(shape: ModelShape, method: str) -> int:
    """Values a token's latent holds where ``method`` sends multi-head latent attention's
    latent (kv_lora_rank + qk_rope_head_dim), else 0 (it sends the expanded K/V)."""
    if not shape.kv_lora_rank or get_method(method).latent_comm_bytes is None:
        return 0
    return shape.kv_lora_rank + (shape.rope_head_dim or 0)


def window_communication_per_layer(shape: ModelShape, s: int, a: int, method: str,
                                   world_size: int, ring_degree: int | None = None) -> int:
    """Bytes one rank sends per sliding-window layer, forward and backward: a global layer's
    (communication_per_layer) with its ring part scaled to the K/V rows the window reads
    (parallel/window_cost.window_traffic: the busiest rank's rows; a ring step nobody reads
    sends nothing; all-gather attention's halo, parallel/halo.py). The all-to-all methods,
    and all-gather moving multi-head latent attention's latent, send what a global layer
    sends."""
    full = communication_per_layer(shape, s, a, method, world_size, ring_degree)
    if (not full or shape.window is None or shape.window >= s * world_size
            or latent_width(shape, method)):
        return full
    from ..parallel.window_cost import window_traffic

    t = window_traffic(method, shape.attention_dims(), s * world_size, world_size,
                       shape.window, a, ring_degree)
    if t["forward_bytes"] is None:  # not ring-shaped: the window changes nothing sent
        return full
    ring, ring_global = (t["forward_bytes"] + t["backward_bytes"],
                         t["global_forward_bytes"] + t["global_backward_bytes"])
    if method == "usp_attn":  # the figures are its ring's; its all-to-all moves the same
        return full - ring_global + ring
    return full * ring // max(ring_global, 1)


def activations(shape: ModelShape, s: int, a: int, method: str, world_size: int,
                checkpointing: str, ring_degree: int | None = None,
                device: str = "gpu") -> tuple[int, int, int, int]:
    """(stored on device, MLP-half and attention-half working sets, host) bytes, s tokens.

    - none: every layer's saved tensors stay until its backward; the working sets are the
      backward's gradients (the attention half starts once the MLP's saved tensors are gone).
    - full: torch.utils.checkpoint per layer keeps only each layer's input (H x a); backward
      recomputes one layer at a time: its saved tensors (less the input norm's fp32 input,
      which in fp32 training is that stored input itself) plus its gradients.
    - offload: as full, but the layer inputs go to host memory; the device keeps two (one
      being copied out or prefetched back, one in use).
    - attention (easy_context.attention.saving, LightSeq's rematerialisation-aware
      checkpointing): as full, but each layer also keeps its attention output and lse, so
      the recompute does not run attention (nor its communication) again.
    Always stored besides: the final norm, its output (saved by the loss) and the RoPE
    cos/sin tables (H x (4 + 2a) + 2 D a per token).

    Hybrid and MoE models (plan/layers.py): each kind of layer counts its own blocks (a
    recurrent mixer: :func:`recurrent_saved_per_token`, its gathered states
    :func:`state_bytes`; experts: the top-k experts' and the shared expert's widths), and the
    working sets are those of the costliest kind.
    """
    saved = layer_saved_per_token(shape, a, method, world_size, ring_degree)
    mlp_tr, attn_tr = backward_transients(shape, a)
    head = shape.hidden * (4 + 2 * a) + 2 * shape.hd * a
    x = shape.hidden * a  # one layer's input
    shared = shape.hidden * 4 if a == 4 else 0  # the input norm's fp32 input is x in fp32
    residual = 2 * shape.hidden * a
    rec = rec_tr = states = 0
    if shape.recurrent_layers:
        rec = recurrent_saved_per_token(shape, a, world_size, device)
        rec_tr = recurrent_transient_per_token(shape, a, world_size)
        states = state_bytes(shape, s, method, world_size, ring_degree)
    moe_mlp = moe_tr = 0
    if shape.moe is not None:
        act = shape.moe.active_intermediate()
        moe_mlp = (4 if shape.moe.matrices == 3 else 2) * act * a + shape.moe.experts * 4  # + router
        moe_tr = residual + act * a
    kept = shape.heads * (shape.v_head_dim or shape.hd) * a + shape.heads * 4  # out and lse
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    stored = stored_seq = 0
    mlp_w = attn_w = 0  # per token
    attn_w_seq = 0  # per sequence (the gathered states of a recurrent layer)
    host = 0
    for kind, n in shape.layer_counts():
        mixes = kind.attention is not None or kind.recurrent
        mix_half = (saved["input_norm"] if mixes else 0) + (
            saved["attention"] if kind.attention else 0) + (rec if kind.recurrent else 0)
        mlp_half = (saved["post_norm"] + (saved["mlp"] if kind.mlp == "dense" else moe_mlp)
                    if kind.mlp else 0)
        mix_tr = ((attn_tr if kind.attention else 0) + (rec_tr if kind.recurrent else 0)
                  - (residual if kind.attention and kind.recurrent else 0))
        m_tr = (mlp_tr if kind.mlp == "dense" else moe_tr) if kind.mlp else 0
        layer_states = states if kind.recurrent else 0
        if checkpointing == "none":
            stored += n * (mix_half + mlp_half)
            stored_seq += n * 2 * layer_states  # the gathered maps and the chained states
            mlp_w = max(mlp_w, m_tr)
            attn_w = max(attn_w, max(0, mix_tr - mlp_half))
            attn_w_seq = max(attn_w_seq, layer_states)  # their gradient
            continue
        k = kept if checkpointing == "attention" and kind.attention else 0
        stored += n * (x if checkpointing != "offload" else 0) + n * k
        recomputed = mix_half + mlp_half - shared - k
        if kind.mlp:
            mlp_w = max(mlp_w, recomputed + m_tr)
        if mixes:
            attn_w = max(attn_w, mix_half - shared - k + mix_tr)
            attn_w_seq = max(attn_w_seq, 3 * layer_states)  # recomputed, kept, gradient
    if checkpointing == "offload":
        stored += 2 * x
        host = shape.layers * x * s
    return s * (stored + head) + stored_seq, s * mlp_w, s * attn_w + attn_w_seq, host


def loss_bytes(shape: ModelShape, s: int, a: int, chunk: int | None) -> int:
    """The loss phase's extra bytes for s local tokens.

    chunked (easy_context.memory.loss): one (C, V) block of fp32 logits (plus its matmul
    output in bf16 before the upcast), in bf16 the head gradient's fp32 accumulator and the
    (V, H) product added to it (states.loss_head_grad_bytes), the gradient of the hidden
    states (s x H x a) and the per-token lse.
    unchunked (transformers' path): the (s, V) logits in the model dtype, upcast to fp32, the
    saved log-softmax, and the fp32 gradient: s x V x (a + 12).
    """
    v, h = shape.vocab, shape.hidden
    if chunk is None:
        return s * v * (a + 12)
    c = min(chunk, s)
    block = c * v * (4 + (a if a != 4 else 0))
    return block + loss_head_grad_bytes(shape, a) + s * h * a + s * 4


def _chunk_rows(loss_chunk: int | str | None, shape: ModelShape, device: str) -> int | None:
    if loss_chunk == "auto":
        from ..memory.loss import default_chunk_size

        return default_chunk_size(shape.vocab, device)
    return loss_chunk


def estimate_memory(model_shape: ModelShape, seq_len: int, world_size: int, method: str,
                    engine: str = "deepspeed", offload: str = "none", checkpointing: str = "full",
                    dtype: str = "bf16", *, loss_chunk: int | str | None = "auto",
                    ring_degree: int | None = None, runtime_bytes: int | None = None,
                    device: str = "gpu", mlp_tile: int | None = None,
                    heads_per_chunk: int | None = None, keep_every: int = 1,
                    lora=None, kernel: str | None = None, deterministic: bool = False,
                    sms: int = DEFAULT_SMS, vision=None, image_tokens: int = 0
                    ) -> MemoryEstimate:
    """Predicted peak memory per device of one training step (see the module docstring).

    method: a key of easy_context.METHODS, or "local" on one device. loss_chunk: "auto" (what
    causal_lm_loss uses: easy_context.memory.loss.default_chunk_size), or rows of the
    chunked loss (None: the full-logits loss). runtime_bytes: the per-process constant
    (default: GPU_RUNTIME_BYTES, or CPU_RUNTIME_BYTES with device="cpu").
    mlp_tile / heads_per_chunk / keep_every: max-length mode's fused layers (either given turns
    it on; the other defaults to the whole sequence / all heads), plan/fused.py.
    lora: a easy_context.plan.lora.LoRASpec for a LoRA run (frozen base, adapters trained).
    kernel / deterministic / sms: the attention kernel family whose backward workspace is
    counted (attention/workspace.py; default: flash-attn 2 / torch's flash op for bf16 on a
    GPU, the efficient op for fp32, none on a CPU), deterministic backward (--deterministic:
    flash-attn's dq_accum once per split) and the GPU's SM count.
    vision / image_tokens: a vision-language model's tower (a plan.vision.VisionShape) and the
    image and video placeholder tokens of the whole sequence; the worst rank is planned:
    it holds min(image_tokens, seq_len / world_size) of them (images can crowd into one
    shard; each rank encodes its own, integrations/vision.py). The tower's parameters train
    and shard with the decoder's.
    """
    for value, allowed, what in ((engine, ENGINES, "engine"), (offload, OFFLOADS, "offload"),
                                 (checkpointing, CHECKPOINTING, "checkpointing"),
                                 (dtype, DTYPES, "dtype")):
        if value not in allowed:
            raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    if seq_len % world_size:
        raise ValueError(f"seq_len {seq_len} is not divisible by world_size {world_size}")
    a = 2 if dtype == "bf16" else 4
    s = seq_len // world_size
    if vision is not None and (lora is not None or mlp_tile is not None
                               or heads_per_chunk is not None):
        raise ValueError("the planner counts a vision tower for full fine-tuning without "
                         "max-length mode (not yet beside its fused layers): plan LoRA or "
                         "max-length mode without the vision tower (--image-tokens)")
    if image_tokens and vision is None:
        raise ValueError("image_tokens need the model's vision tower (vision=): plan a "
                         "vision-language model's config")
    st = model_states(model_shape, world_size, engine, offload, dtype, device, vision)
    workspace = kernel_workspace(device, a, kernel, deterministic, sms)
    loss = loss_bytes(model_shape, s, a, _chunk_rows(loss_chunk, model_shape, device))
    fused = mlp_tile is not None or heads_per_chunk is not None
    paths = [p for _, p in model_shape.maxlen_paths()] if fused else []
    refused = [p for p in paths if p not in ("fused", "generic")]
    if refused:
        raise ValueError(f"{model_shape.name}: max-length mode (--mlp-tile, --head-chunk) "
                         f"does not run every layer of this model ({refused[0]}): plan it "
                         "untiled")
    if fused:
        # each kind of layer on the path max-length mode takes for it (shapes.maxlen_path):
        # the fused layer's terms, or the generic layer's where any layer takes that path
        from .fused import fused_terms
        from .generic import generic_terms

        terms = generic_terms if "generic" in paths else fused_terms
        mlp_tile = s if mlp_tile is None else mlp_tile
        heads_per_chunk = model_shape.heads if heads_per_chunk is None else heads_per_chunk
        on = {"device": device} if terms is generic_terms else {}  # its recurrent kernels
        ft = terms(model_shape, s, a, method, world_size, checkpointing, mlp_tile,
                   heads_per_chunk, ring_degree, keep_every, workspace=workspace,
                   budget=_budget(device), **on)
        stored, mlp_w, attn_w, act_host = ft.stored + ft.head, ft.mlp_half, ft.attention_half, ft.host
        # The loss keeps the un-normed last hidden states and its backward writes their
        # gradient over them (tiled_loss.py): the one s x H tensor loss_bytes counts.
        buffers, call_workspace = ft.buffers, ft.workspace
    else:
        stored, mlp_w, attn_w, act_host = activations(model_shape, s, a, method, world_size,
                                                      checkpointing, ring_degree, device)
        buffers = attention_buffers(model_shape, s, a, method, world_size, ring_degree, device,
                                    workspace)
        call_workspace = attention_workspace(model_shape, s, a, method, world_size,
                                             ring_degree, device, workspace)
    if runtime_bytes is None:
        runtime_bytes = CPU_RUNTIME_BYTES if device == "cpu" else GPU_RUNTIME_BYTES
    windows = model_shape.count(lambda k: k.attention == "window")  # sliding-window layers
    est = MemoryEstimate(
        model=model_shape.name, seq_len=seq_len, world_size=world_size, method=method,
        engine=engine, offload=offload, checkpointing=checkpointing, dtype=dtype,
        parameters=st.params, gradients=st.grads, gradients_in_backward=st.grads_in_backward,
        optimizer=st.optim, optimizer_step=st.step, gathered_parameters=st.gathered,
        stored_activations=stored, mlp_backward=mlp_w, attention_backward=attn_w,
        attention_buffers=buffers, attention_workspace=call_workspace, loss=loss,
        runtime=runtime_bytes,
        host_bytes=st.host + act_host,
        communication_per_layer=communication_per_layer(model_shape, s, a, method, world_size,
                                                        ring_degree),
        mlp_tile=mlp_tile if fused else None,
        heads_per_chunk=heads_per_chunk if fused else None, keep_every=keep_every,
        attention_layers=model_shape.attention_layers,
        recurrent_layers=model_shape.recurrent_layers,
        state_communication_per_layer=state_communication_per_layer(
            model_shape, s, a, method, world_size, ring_degree),
        state_bytes_per_layer=state_bytes(model_shape, s, method, world_size, ring_degree),
        window_layers=windows,
        latent_values=latent_width(model_shape, method) if world_size > 1 else 0,
        window_communication_per_layer=window_communication_per_layer(
            model_shape, s, a, method, world_size, ring_degree) if windows else 0,
        **estimate_terms(vision, min(image_tokens, s), a))
    if lora is not None:
        from .lora import with_lora

        est = with_lora(est, model_shape, lora, _chunk_rows(loss_chunk, model_shape, device),
                        device)
    return est


__all__ = ["MemoryEstimate", "States", "estimate_memory", "model_states", "activations",
           "loss_bytes", "attention_buffers", "communication_per_layer", "ENGINES", "OFFLOADS", "CHECKPOINTING", "DTYPES",
           "CPU_RUNTIME_BYTES", "GPU_RUNTIME_BYTES"]
