"""What each activation-checkpointing choice costs: memory kept against compute redone.

Full checkpointing keeps each layer's input and re-runs the layer's forward in backward, its
attention included (and a sequence-parallel attention's communication with it);
attention-saving checkpointing (easy_context.attention.saving) also keeps each attention
layer's output and lse, so the recompute skips the attention kernel; no checkpointing keeps
everything and redoes nothing. The memory side is the estimate's (plan.estimate.activations);
the time side is counted in FLOPs, per rank and step, batch 1:

- a layer's linear layers: 2 x (their weights) per token and pass (the MoE layers' active
  experts only); forward F, backward 2F;
- attention: 2 x ctx x Hq x (d_qk + d_v) per query token, ctx the keys a query sees on
  average (causal: (L + 1) / 2; a window of w: w - w (w - 1) / 2L), the same split over ranks;
- a recurrent layer's kernel (chunked, chunks of 64): per token and head, 4 d_k d_v for the
  state and 2 x 64 x (d_k + d_v) within the chunk, d_v widened by the scan's identity block
  when sequence-parallel;
- the output head: 2 H V per token.

The step is forward + backward + the recompute; a FLOP share is what the recompute adds as a
fraction of that step. FLOPs are not time (attention kernels and small GEMMs run at different
efficiencies, communication overlaps or not), so the shares rank the choices; they are not
measured step times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .estimate import estimate_memory
from .shapes import ModelShape

CHUNK = 64  # the chunked recurrent kernels' block (fla, transformers' torch fallback)


def mean_context(seq_len: int, window: int | None = None, chunk: int | None = None) -> float:
    """Keys a causal query sees on average over a sequence of ``seq_len`` tokens: all earlier
    ones, the last ``window`` (sliding window), or those of its own ``chunk``-token chunk
    (chunked attention)."""
    if chunk is not None and chunk < seq_len:
        full, rest = divmod(seq_len, chunk)
        return (full * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2) / seq_len
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return window - window * (window - 1) / (2 * seq_len)


def layer_flops_per_token(shape: ModelShape, seq_len: int, world_size: int) -> dict[str, float]:
    """Forward FLOPs per local token over all layers: {"linear", "attention", "recurrent",
    "head"}."""
    h = shape.hidden
    linear = attention = recurrent = 0.0
    qk, v = shape.hd, shape.v_head_dim or shape.hd
    for kind, n in shape.layer_counts():
        per = 0.0
        if kind.attention:
            per += 2 * shape.attention_params()
            ctx = mean_context(seq_len, shape.window if kind.attention == "window" else None,
                               shape.attention_chunk if kind.attention == "chunk" else None)
            attention += n * 2 * ctx * shape.heads * (qk + v)
        if kind.recurrent:
            r = shape.recurrent
            per += 2 * (h * r.projection + r.inner * h)
            if r.heads:
                dk = r.key_width
                dv = r.value_width // r.heads + (dk if world_size > 1 else 0)
                recurrent += n * r.heads * (4 * dk * dv + 2 * CHUNK * (dk + dv))
        if kind.mlp == "dense":
            per += 2 * (3 if shape.gated_mlp else 2) * h * shape.intermediate
        elif kind.mlp == "moe":
            per += 2 * shape.moe.matrices * h * shape.moe.active_intermediate()
        linear += n * per
    return {"linear": linear, "attention": attention, "recurrent": recurrent,
            "head": 2.0 * h * shape.vocab}


@dataclass(frozen=True)
class CheckpointingCost:
    checkpointing: str
    total_bytes: int  # the estimate's peak per device
    stored_bytes: int  # activations kept from forward to backward
    fits: bool | None  # within the budget given (None: no budget)
    step_flops: float  # per rank: forward + backward + recompute
    recompute_flops: float
    recompute_share: float  # recompute / step
    attention_recompute_share: float  # the attention kernels' part of the recompute / step

    def to_dict(self) -> dict:
        return asdict(self)


def checkpointing_costs(shape: ModelShape, seq_len: int, world_size: int, method: str,
                        budget: int | None = None,
                        choices: tuple[str, ...] = ("none", "attention", "full", "offload"),
                        **kw) -> list[CheckpointingCost]:
    """Each checkpointing choice's memory (plan.estimate) and recompute (module docstring)
    for one setup; ``kw`` goes to estimate_memory (engine, offload, dtype, ...)."""
    s = seq_len // world_size
    f = layer_flops_per_token(shape, seq_len, world_size)
    layers = s * (f["linear"] + f["attention"] + f["recurrent"])
    forward = layers + s * f["head"]
    out = []
    for ckpt in choices:
        est = estimate_memory(shape, seq_len, world_size, method, checkpointing=ckpt, **kw)
        if ckpt == "none":
            redo = attn = 0.0
        elif ckpt == "attention":
            redo, attn = layers - s * f["attention"], 0.0
        else:  # full, offload: the whole layer again, attention included
            redo, attn = layers, s * f["attention"]
        step = 3 * forward + redo
        out.append(CheckpointingCost(ckpt, est.total, est.stored_activations,
                                     None if budget is None else est.total <= budget,
                                     step, redo, redo / step, attn / step))
    return out


def describe(costs: list[CheckpointingCost], gib: float = 2**30) -> list[str]:
    """Lines for the CLI: each choice's peak, stored activations and recompute share."""
    lines = ["checkpointing choices (per device; recompute as a share of the step's FLOPs):"]
    full = next((c for c in costs if c.checkpointing == "full"), None)
    for c in costs:
        extra = ""
        if full is not None and c.checkpointing == "attention":
            extra = (f"; keeps {(c.stored_bytes - full.stored_bytes) / gib:.2f} GiB more than "
                     f"full (attention outputs + lse), saves recomputing attention: "
                     f"{full.attention_recompute_share:.1%} of a fully checkpointed step")
        fits = "" if c.fits is None else ("  fits" if c.fits else "  does NOT fit")
        lines.append(f"  {c.checkpointing:9s} peak {c.total_bytes / gib:8.2f} GiB, stored "
                     f"{c.stored_bytes / gib:8.2f} GiB, recompute {c.recompute_share:6.1%} "
                     f"(attention {c.attention_recompute_share:5.1%}){fits}{extra}")
    return lines


__all__ = ["CheckpointingCost", "checkpointing_costs", "describe", "layer_flops_per_token",
           "mean_context"]
