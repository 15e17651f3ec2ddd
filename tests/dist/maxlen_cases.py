"""Rank functions for max-length mode: the fused, tiled, head-chunked model against the plain one.

Each rank builds the same tiny model and batch (same seeds); the reference is the plain model
on the whole batch in this process (no collectives, untiled, sdpa); the max-length model runs
sequence-parallel on this rank's shard. Returns (loss relative error, worst gradient error
relative to each parameter's max |grad|, gradients summed over ranks).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec
from easy_context.attention.documents import document_ids_from_positions
from easy_context.memory.maxlen import apply_max_length

from .hf_cases import FAMILIES, VARIANT_FAMILIES, make_batch, reference_loss

# 8 query / 4 KV heads: head chunks of 2 or 4 query heads (1 or 2 KV heads) split over 2 and 4
# Ulysses ranks; chunks of 1 query head take half of a KV head's.
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=8,
             max_position_embeddings=512, attention_dropout=0.0)


DROP = "<drop>"  # an override that removes a SHAPE entry (Falcon's head_dim is read-only)


def tiny(family: str, seed: int = 0, **overrides):
    """A family of hf_cases at this shape (the attention-variant ones with their own eager
    attention as the reference: sdpa has no sinks or soft-capping)."""
    dropped = [k for k, v in overrides.items() if v == DROP]
    if dropped:
        config = AutoConfig.for_model(family, **{k: v for k, v in {**SHAPE, **overrides}.items()
                                                 if k not in dropped})
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    if family in VARIANT_FAMILIES:
        extra = {k: v for k, v in VARIANT_FAMILIES[family].items()
                 if k not in ("num_key_value_heads", "head_dim")}
        config = AutoConfig.for_model(family.removesuffix("_sliding"),
                                      **{**SHAPE, **extra, **overrides})
        attn = "eager"
    else:
        config = AutoConfig.for_model(family, **{**SHAPE, **FAMILIES.get(family, {}), **overrides})
        attn = "sdpa"
    torch.manual_seed(seed)
    return _drawn_logit_scale(AutoModelForCausalLM.from_config(config,
                                                               attn_implementation=attn).float())


def _drawn_logit_scale(model):
    """A learned per-vocabulary logit scale (Dory's head) starts at 1 for every entry: drawn
    between 0.5 and 2 here, so that a dropped or misplaced factor shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.mul_(torch.empty_like(p).uniform_(0.5, 2.0))
    return model


# A reference gradient below this fraction of the model's largest is zero but for fp32
# rounding (a key projection's bias without RoPE, OPT's and BioGPT's: softmax ignores a number
# added to a whole row of scores; ~1e-10 against ~0.4): it has no scale of its own and is
# compared on the model's largest gradient.
ZERO_GRAD = 1e-8


def grad_errors(model, ref, world: int) -> float:
    """The worst gradient error relative to each parameter's max |grad| (NaN when a
    gradient holds one: torch.maximum keeps it). Frozen parameters (LoRA's base) have no
    gradient on either side, nor do unused ones (Whisper's cross-attention without encoder
    states)."""
    worst = torch.zeros(())
    grads = [r.grad.abs().max() for r in ref.parameters() if r.grad is not None]
    largest = torch.stack(grads).max() if grads else torch.ones(())
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None and not p.requires_grad:
            continue
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if world > 1:
            dist.all_reduce(g)
        want = r.grad if r.grad is not None else torch.zeros_like(p)
        scale = want.abs().max()
        scale = largest if scale < ZERO_GRAD * largest else scale.clamp(min=1e-6)
        worst = torch.maximum(worst, (g - want).abs().max() / scale)
    return float(worst)


class _MixingNorm(nn.Module):
    """A norm followed by a running mean along the sequence: a layer that mixes tokens
    outside its attention (what the tiled backward's check must turn away)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        steps = torch.arange(1, x.size(1) + 1, dtype=x.dtype, device=x.device)[:, None]
        return self.norm(x) + 0.5 * x.cumsum(dim=1) / steps


def with_token_mixing(model):
    """``model`` whose decoder layers' post_attention_layernorm also mixes tokens."""
    for layer in model.model.layers:
        layer.post_attention_layernorm = _MixingNorm(layer.post_attention_layernorm)
    return model


def check_max_length(family: str, method: str, cases: list[tuple], ring_degree: int | None = None,
                     packed: bool = False, overrides: dict | None = None, path: str = "auto",
                     lora: bool = False, mixing: bool = False) -> dict:
    """{case: (loss error, grad error)} for each (mlp_tile, heads_per_chunk, checkpointing,
    keep_every) in ``cases``; ``overrides``: config entries of the family's tiny model;
    ``path``: the max-length path to force ("auto": each layer's own); ``lora``: a peft LoRA
    adapter on every linear module of the decoder layers (non-zero B, base frozen);
    ``mixing``: with_token_mixing (one process only: the running mean does not cross shards)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    base = tiny(family, **(overrides or {}))
    if lora:
        base = with_lora(base)
    if mixing:
        base = with_token_mixing(base)
    length = 2 * world * 6
    inputs, positions, targets = make_batch(length, base.config.vocab_size)
    doc = None
    if packed:  # three documents per row, straddling the shards
        positions = positions.clone()
        for cut in (5, length // 2 + 3):
            positions[:, cut:] -= positions[:, cut:cut + 1].clone()
        targets = targets.clone()
        targets[:, 4] = targets[:, length // 2 + 2] = -100
        doc = document_ids_from_positions(positions)
    ref = copy.deepcopy(base)
    if packed:
        total, count = 0.0, 0
        for row in range(inputs.size(0)):
            starts = [0] + [i for i in range(1, length) if positions[row, i] == 0]
            for a, b in zip(starts, starts[1:] + [length]):
                logits = ref(input_ids=inputs[row:row + 1, a:b]).logits.float()
                total = total + torch.nn.functional.cross_entropy(
                    logits[0], targets[row, a:b], ignore_index=-100, reduction="sum")
                count += int((targets[row, a:b] != -100).sum())
        ref_loss = total / count
    else:
        ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    report = {}
    for tile, chunk, kind, keep_every in cases:
        model = copy.deepcopy(base)
        ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
        apply_max_length(model, tile, chunk, kind, keep_every=keep_every, path=path)
        local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world,
                                               "cpu", ring_degree=ring_degree)
        kw = {}
        if doc is not None:
            kw["document_ids"] = ec.shard_sequence(doc, method, rank, world,
                                                   ring_degree=ring_degree)
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=True, chunk_size=5, **kw)
        loss.backward()
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        report[f"tile={tile} chunk={chunk} {kind} keep_every={keep_every}"] = (
            loss_err, grad_errors(model, ref, world))
    return report


def check_against_plain(family: str, method: str, cases: list[tuple],
                        overrides: dict | None = None) -> dict:
    """{case: (loss error, grad error)} of max-length mode against plain sequence parallelism
    on the same ranks, shards and chunked loss (gradients summed over ranks on both sides),
    and under "plain SP vs one process" plain sequence parallelism's own errors against the
    one-process model: for families whose fp32 rounding puts plain SP itself past the
    tolerance at several ranks (Gemma 4), where max-length mode must give plain SP's numbers."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    base = tiny(family, **(overrides or {}))
    length = 2 * world * 6
    inputs, positions, targets = make_batch(length, base.config.vocab_size)
    ref = copy.deepcopy(base)
    ref_loss = reference_loss(ref, inputs, positions, targets)
    ref_loss.backward()
    local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world, "cpu")

    def run(model):
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=True, chunk_size=5)
        loss.backward()
        return loss

    plain = copy.deepcopy(base)
    ec.apply_sequence_parallel(plain, method)
    plain_loss = run(plain)
    for p in plain.parameters():  # plain's gradients summed over the ranks, in place
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(p.grad)
    report = {"plain SP vs one process": (
        abs(plain_loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        grad_errors(plain, ref, 1))}
    for tile, chunk, kind, keep_every in cases:
        model = copy.deepcopy(base)
        ec.apply_sequence_parallel(model, method)
        apply_max_length(model, tile, chunk, kind, keep_every=keep_every)
        loss = run(model)
        report[f"tile={tile} chunk={chunk} {kind} keep_every={keep_every}"] = (
            abs(loss.item() - plain_loss.item()) / abs(plain_loss.item()),
            grad_errors(model, plain, world))
    return report


def with_lora(model):
    """``model`` with a LoRA adapter (rank 4) on every linear layer of its decoder layers,
    the base frozen and the adapters' B non-zero (so they change the output)."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                             exclude_modules=["lm_head"])
    peft.inject_adapter_in_model(config, model)
    torch.manual_seed(7)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def tiled_backward_verdicts(family: str, method: str, cases: list[tuple], path: str = "auto",
                            mixing: bool = False, packed: bool = False,
                            **overrides) -> tuple[dict, dict]:
    """check_max_length's report, and whether each layer class took the tiled backward
    (memory/tiled_backward.py: None) or why not."""
    from easy_context.memory import tiled_backward

    tiled_backward.VERDICTS.clear()
    tiled_backward._VERDICTS.clear()
    report = check_max_length(family, method, cases, overrides=overrides, path=path,
                              mixing=mixing, packed=packed)
    return report, dict(tiled_backward.VERDICTS)


def paths_of(family: str, lora: bool = False, **overrides) -> list[str]:
    """Each decoder layer's max-length path (maxlen.path_for) for this tiny family."""
    from easy_context.memory.maxlen import decoder_layers, path_for

    model = tiny(family, **overrides)
    if lora:
        model = with_lora(model)
    return [path_for(layer, model) for layer in decoder_layers(model)]


def generic_calls(family: str, tile: int, chunk: int, **overrides) -> dict:
    """What the generic path hands the model's own modules in one forward and backward of
    one rank: the query heads of each attention call and the tokens of each MLP call."""
    model = tiny(family, **overrides)
    ec.apply_sequence_parallel(model, "local")
    seen = {"heads": [], "tokens": []}
    from easy_context.memory.generic_layer import mlp_sites
    from easy_context.memory.maxlen import decoder_layers

    for layer in decoder_layers(model):
        _, owner, attr = mlp_sites(layer)[0]
        # an MLP child's forward, or the first linear layer of an inline fc1 -> act -> fc2
        mlp = getattr(owner, attr[0]) if isinstance(attr, tuple) else owner

        def spy(x, forward=mlp.forward):
            seen["tokens"].append(x.size(1))
            return forward(x)

        mlp.forward = spy  # an instance forward: the tiles call it
    apply_max_length(model, tile, chunk, "full", path="generic")
    seen["tokens"].clear()  # the probe's (apply_max_length checks the MLP is per token)
    return step_counting_heads(model, seen)


def step_counting_heads(model, seen: dict) -> dict:
    """One forward and backward of ``model`` on 24 tokens, each attention call's query heads
    appended to ``seen["heads"]``; returns ``seen``. The tiled backward's verdicts are
    forgotten first, so its check (8 tokens) runs in this step whatever ran before."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from easy_context.memory import tiled_backward

    tiled_backward._VERDICTS.clear()

    name = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(name, None)

    def attention(module, q, *args, **kwargs):
        seen["heads"].append(q.size(1))
        return inner(module, q, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    try:
        inputs, positions, targets = make_batch(24, model.config.vocab_size)
        ec.causal_lm_loss(model, inputs, positions, targets, chunked=True).backward()
    finally:
        ALL_ATTENTION_FUNCTIONS.register(name, inner)
    return seen


def tiled_layer_runs(family: str, **overrides) -> tuple[int, int]:
    """(how many layer calls ran max-length mode's own forward (fused or generic) in one
    forward of one process, how many layers the model has): a layer called in a way the
    patched forward does not recognise runs as it was, untiled, and must not pass unseen."""
    from easy_context.memory import maxlen

    model = tiny(family, **overrides)
    ec.apply_sequence_parallel(model, "local")
    apply_max_length(model, 5, 1, "full")
    runs = []
    for cls in (maxlen.GenericLayer, maxlen.FusedLayer):
        apply = cls.apply

        def counted(*args, _apply=apply):
            runs.append(1)
            return _apply(*args)

        cls.apply = counted
    try:
        inputs, positions, targets = make_batch(24, model.config.get_text_config().vocab_size)
        ec.causal_lm_loss(model, inputs, positions, targets, chunked=True)
    finally:
        del maxlen.GenericLayer.apply, maxlen.FusedLayer.apply
    return len(runs), len(maxlen.decoder_layers(model))


def max_length_step_error(family: str, method: str, case: tuple, **overrides) -> str:
    """The ValueError one max-length step (check_max_length) raises for this case."""
    try:
        check_max_length(family, method, [case], overrides=overrides)
    except ValueError as e:
        return str(e)
    return "no error"


def max_length_error(family: str, method: str, chunk: int, ring_degree: int | None = None,
                     path: str = "auto", **overrides) -> str:
    """The ValueError apply_max_length raises for this model / method / chunk."""
    model = tiny(family, **overrides)
    ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
    try:
        apply_max_length(model, 4, chunk, "full", path=path)
    except ValueError as e:
        return str(e)
    return "no error"


def fused_layer_work(family: str, tile: int, chunk: int, length: int = 24) -> dict:
    """How often one fused layer (the second) projects q and v (F.linear calls on a tile with
    those weights' rows) and runs its input norm (with grad: in backward) in one forward and
    backward of one process."""
    import torch.nn.functional as F

    from easy_context.memory import fused_layer

    model = tiny(family)
    ec.apply_sequence_parallel(model, "local")
    apply_max_length(model, tile, chunk, "full", path="fused")
    layer = model.model.layers[1]
    weights = {"q": layer.self_attn.q_proj.weight, "v": layer.self_attn.v_proj.weight}
    counts = {"q": 0, "v": 0, "norm1": 0, "norm1 with grad": 0}
    linear = F.linear

    def spy(x, w, b=None):
        for name, weight in weights.items():
            if w.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
                counts[name] += 1
        return linear(x, w, b)

    def hook(module, args, out):
        counts["norm1"] += 1
        counts["norm1 with grad"] += int(torch.is_grad_enabled())

    handle = layer.input_layernorm.register_forward_hook(hook)
    fused_layer.F.linear = spy
    try:
        inputs, positions, targets = make_batch(length, model.config.vocab_size)
        ec.causal_lm_loss(model, inputs, positions, targets, chunked=True).backward()
    finally:
        fused_layer.F.linear = linear
        handle.remove()
    return counts
