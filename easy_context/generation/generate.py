"""Sequence-parallel generation: the prompt prefilled by any method on N ranks, each rank
keeping the KV cache of its shard, every decode step merged across the ranks.

Every rank of the group calls :func:`generate` with the same (B, L) prompts and gets the
same (B, L + T) sequences back, as transformers' ``generate`` returns them. Prompts of
different lengths come left-padded with an ``attention_mask``, as transformers takes them;
here each prompt is moved to the start of its row (its positions 0, 1, ..., as
transformers numbers a left-padded prompt) and the row is padded at its end, which no real
token attends to under causality; the cache marks every pad slot invalid. Nothing of the
padding is attended: the result is exact, not approximated.

The prefill never builds logits for the prompt: the decoder's last hidden state of each
prompt's last token (held by one rank) goes through the head alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..integrations.hf import (IMAGE_SPANS_KWARG, KV_CACHE_KWARG, RESCALING_ROPE,
                                apply_sequence_parallel,
                                between_decoder_and_head, config_layer_types,
                                generation_defaults, output_head, rope_types,
                                token_mixing_types)
from ..integrations.hf_recurrent import (RUNS as RECURRENT_RUNS, recurrent_layer_types,
                                         unroutable_stateful_layers, unrouted_stateful_layers)
from ..integrations.vision import decoder_input_ids, vision_embeddings
from ..mesh import group_size, process_group
from ..parallel import get_method
from ..parallel.comm import gather_shards
from ..parallel.settings import SequenceParallelSettings, module_settings
from ..sequence_parallel import required_multiple, shard_sequence
from ..utils.decoder import decoder_of, text_config
from .cache import ShardedKVCache, group_rank
from .sampling import LogitsProcessing, SamplingConfig, StopCriteria, TokenChooser
from .vision_prompt import check_vision_prompt, media_digest, prepare_vision_prompt

Tensor = torch.Tensor


@dataclass
class GenerationResult:
    """What ``generate(..., return_stats=True)`` returns."""

    sequences: Tensor  # (B, L + T): the prompts as given, then the new tokens (pad after a stop)
    prefill_seconds: float
    decode_seconds: float
    new_tokens: int  # decode steps run (T)
    lengths: list[int]  # each row's new tokens up to and including the one that stopped it
    cache_bytes: int  # this rank's KV cache (keys, values, positions, validity; recurrent states)
    # with output_logits: each step's (B, V) float32 logits before any processor, as
    # transformers' generate(output_logits=True) gives them
    logits: list[Tensor] | None = None


def _settings(model: nn.Module, method: str | None, group, ring_degree: int | None
              ) -> SequenceParallelSettings:
    if method is not None:
        apply_sequence_parallel(model, method, group=group, ring_degree=ring_degree)
    found = next((s for s in map(module_settings, model.modules()) if s is not None), None)
    if found is None:
        raise ValueError("the model is not switched to sequence-parallel attention: pass "
                         "method= (and group=), or call easy_context.apply_sequence_parallel "
                         "first")
    return found


def check_rope_range(config, longest: int) -> None:
    """A prompt plus its new tokens beyond ``max_position_embeddings`` with plain RoPE is a
    length the model was not made for: refuse it, saying what to change."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and longest > limit and rope_types(config) <= {"default"}:
        raise ValueError(
            f"prompt plus new tokens ({longest}) exceed the model's RoPE range "
            f"(max_position_embeddings={limit}) with no RoPE scaling: shorten the prompt, give "
            "a RoPE scaling (--rope-scaling yarn:4), or, if the model was trained that long "
            "(a raised RoPE base), set max_position_embeddings in its config.json")


def _eos_ids(model: nn.Module, eos_token_id) -> list[int]:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]


def _left_padded_lengths(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(B,) real prompt lengths; the mask must be left padding (zeros, then ones)."""
    b, length = input_ids.shape
    if attention_mask is None:
        return torch.full((b,), length, dtype=torch.long)
    mask = attention_mask.to("cpu", torch.long)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    lengths = mask.sum(dim=1)
    expected = torch.arange(length)[None] >= (length - lengths)[:, None]
    if not torch.equal(mask.bool(), expected):
        raise ValueError("attention_mask must be left padding (zeros, then ones) with no holes: "
                         "tokenize with padding_side='left'")
    if (lengths == 0).any():
        raise ValueError("a prompt in the batch is empty (its attention_mask is all zeros)")
    return lengths


def _next_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """(B, V) float32 logits of (B, D) hidden states through the head (and the family's
    logit transform: Gemma's final soft-capping, Cohere's scale)."""
    head = model.get_output_embeddings()
    _, transform = output_head(model)
    logits = head(hidden).float()
    return transform.apply_(logits) if transform is not None else logits


def _parameters_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are sharded and gathered module by module in each
    forward (FSDP2's DTensors, DeepSpeed ZeRO-3's partitioned parameters): then every rank
    that shares them must run the same forwards."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor shards nothing this way
        DTensor = ()
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


@contextmanager
def _fsdp_root_forward(model: nn.Module):
    """Yield a runner that calls a function as a forward of ``model`` when ``model`` is an
    FSDP2 root, and plainly otherwise.

    generate calls the decoder and the head directly, not ``model.forward``; under FSDP2
    the root's own parameters (embeddings, final norm, head) are gathered only in the root's
    forward, and the root must run first (the first unit to run becomes the root). FSDP2's
    register_fsdp_forward_method runs a method between the root's pre- and post-forward
    hooks: the whole generation runs as one root forward, each decoder layer still gathers
    and frees its own parameters in its own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        yield lambda fn: fn()
        return
    if not isinstance(model, FSDPModule):
        wrapped = {id(p) for m in model.modules() if isinstance(m, FSDPModule)
                   for p in m.parameters()}
        if any(isinstance(p, DTensor) and id(p) not in wrapped for p in model.parameters()):
            raise ValueError(
                "some of the model's parameters are sharded (FSDP2) by a unit outside the model "
                "(the training engine's loss module): generate with a model sharded as "
                "transformers' Trainer and accelerate shard it (fully_shard on each decoder "
                "layer, then on the model itself), or on an unsharded copy")
        yield lambda fn: fn()
        return
    name = "_easy_context_generation_pass"
    setattr(model, name, lambda fn: fn())
    register_fsdp_forward_method(model, name)
    try:
        yield getattr(model, name)
    finally:
        delattr(model, name)


def _fingerprint(input_ids: Tensor, attention_mask: Tensor | None, settings: dict) -> int:
    """A 63-bit hash of the prompts and every setting that decides the tokens."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(str(tuple(input_ids.shape)).encode())
    h.update(input_ids.detach().to("cpu", torch.long).contiguous().numpy().tobytes())
    if attention_mask is not None:
        h.update(attention_mask.detach().to("cpu", torch.long).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def agree_and_seed(fingerprint: int, seed: int | None, group, world: int,
                   device: torch.device) -> int:
    """One all-gather over the sequence-parallel group: every rank must hold the same prompts
    and settings (``fingerprint``), or every rank raises the same ValueError before the
    prefill; the seed is group rank 0's (a fresh one drawn there when ``seed`` is None).
    On the model's device (NCCL gathers device tensors only)."""
    mine = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    if world == 1:
        return mine
    parts = gather_shards(torch.tensor([[fingerprint, mine]], dtype=torch.long, device=device),
                          group)[:, 0].cpu()  # (world, 2)
    differ = [r for r in range(world) if int(parts[r, 0]) != int(parts[0, 0])]
    if differ:
        raise ValueError(
            f"the ranks of the sequence-parallel group were given different prompts or "
            f"generation settings (group ranks {differ} differ from rank 0): every rank of a "
            "group must call generate with the same input_ids, attention_mask and flags")
    return int(parts[0, 1])


def _resolve(model: nn.Module, given: dict) -> dict:
    """The call's settings where given (not None), else the model's generation_config's, else
    transformers' defaults: the priority transformers' generate gives them."""
    config = getattr(model, "generation_config", None)
    defaults = generation_defaults()
    out = {}
    for name, value in given.items():
        if value is None and config is not None:
            value = getattr(config, name, None)
        out[name] = value if value is not None else defaults.get(name)
    return out


@torch.no_grad()
def generate(model: nn.Module, input_ids: Tensor, *, method: str | None = None, group=None,
             ring_degree: int | None = None, attention_mask: Tensor | None = None,
             max_new_tokens: int = 32, do_sample: bool | None = None,
             temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, seed: int | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             stop_strings: str | list[str] | None = None, tokenizer=None,
             return_stats: bool = False,
             beyond_rope_range: bool = False, min_p: float | None = None,
             repetition_penalty: float | None = None, min_new_tokens: int | None = None,
             num_return_sequences: int | None = None, streamer=None,
             synced_gpus: bool | None = None,
             output_logits: bool = False, pixel_values: Tensor | None = None,
             image_grid_thw: Tensor | None = None,
             pixel_values_videos: Tensor | None = None, video_grid_thw: Tensor | None = None,
             second_per_grid_ts: Tensor | None = None,
             mm_token_type_ids: Tensor | None = None,
             token_type_ids: Tensor | None = None,
             image_position_ids: Tensor | None = None,
             image_sizes: Tensor | None = None) -> Tensor | GenerationResult:
    """Generate up to ``max_new_tokens`` after each of the (B, L) prompts, sequence-parallel.

    Every rank of the group calls this with the same ``input_ids`` (and ``attention_mask``,
    left padding for prompts of different lengths, and the same flags: checked before the
    prefill). ``method`` (with ``group``, ``ring_degree``) switches the model first; without
    it the model must already be switched (easy_context.apply_sequence_parallel).

    The model's ``generation_config`` is honoured as transformers' ``generate`` honours it:
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``min_new_tokens`` and ``num_return_sequences`` left None come from it, then from
    transformers' defaults (greedy; top_k 50 when sampling). Greedy gives token for token
    what transformers' greedy ``generate`` gives in one process; sampling gives the same
    tokens on any number of ranks for a ``seed`` (None: a fresh seed each call, drawn on
    group rank 0). A row stops at an EOS token (``eos_token_id``, default the model's
    generation config) or after a stop string (needs ``tokenizer``); stopped rows are filled
    with ``pad_token_id``. ``streamer`` gets the prompts, then each step's tokens (``put``),
    then ``end()``, as transformers calls it. With parameters sharded across data-parallel
    groups too (FSDP2, ZeRO-3; ``synced_gpus`` None detects it), a group that is done keeps
    running forward passes until every group is (transformers' ``synced_gpus``). Returns
    (B * num_return_sequences, L + T) on every rank, or a GenerationResult with timings and
    this rank's cache bytes when ``return_stats`` (and each step's logits with
    ``output_logits``). A prompt plus its new tokens beyond the
    model's RoPE range (``max_position_embeddings`` with plain RoPE) is refused unless
    ``beyond_rope_range``: for probing where a model breaks down on purpose.

    A vision-language model's prompt images come as its processor gives them
    (``pixel_values``, ``image_grid_thw``, videos, ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``, Gemma 4's ``image_position_ids``, an any-resolution tower's
    ``image_sizes``; the same on every rank):
    each rank encodes the images its shard of
    the prompt holds, Gemma 3's images attend both ways inside at the prefill, the positions are the
    model's own (multimodal RoPE's ``get_rope_index``), and the new tokens continue them as
    transformers does (generation/vision_prompt.py).
    """
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be (batch, length) int64, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    from ..memory.maxlen import max_length_settings

    if max_length_settings(model) is not None:
        raise ValueError("generate runs the plain layers: load the model without max-length mode")
    layer_types = config_layer_types(text_config(model.config))
    stateful = unroutable_stateful_layers(model) or sorted(
        token_mixing_types(layer_types) - recurrent_layer_types(model, layer_types))
    if stateful:
        # the routed recurrent layers keep their prompt state for the decode steps
        # (integrations/hf_recurrent.py); any other would decode each new token from no state
        raise ValueError(f"{type(model).__name__} has layers that carry a recurrent or "
                         f"convolution state ({', '.join(stateful)}), which easy_context.generate "
                         f"does not cache (it carries those of {RECURRENT_RUNS}): generate in "
                         "one process with model.generate (training runs sequence-parallel)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or between_decoder_and_head(model, head):
        raise ValueError(f"{type(model).__name__}'s logits are not its output head applied to "
                         "the decoder's last hidden state (a transform with parameters sits "
                         "between them, as in BERT-style heads), which generate needs: "
                         "generate in one process with model.generate")
    flags = _resolve(model, dict(do_sample=do_sample, temperature=temperature, top_k=top_k,
                                 top_p=top_p, min_p=min_p,
                                 repetition_penalty=repetition_penalty,
                                 min_new_tokens=min_new_tokens,
                                 num_return_sequences=num_return_sequences))
    sampling = SamplingConfig(bool(flags["do_sample"]), float(flags["temperature"]),
                              flags["top_k"], float(flags["top_p"]), 0,
                              None if flags["min_p"] is None else float(flags["min_p"]))
    copies = int(flags["num_return_sequences"] or 1)
    if copies < 1:
        raise ValueError(f"num_return_sequences must be >= 1, got {copies}")
    if copies > 1 and not sampling.do_sample:
        raise ValueError(f"num_return_sequences={copies} with greedy decoding gives the same "
                         "sequence each time: set do_sample=True, or num_return_sequences=1")
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    eos = _eos_ids(model, eos_token_id)
    stops = StopCriteria(eos, stop_strings, tokenizer)
    process = LogitsProcessing(float(flags["repetition_penalty"]),
                               int(flags["min_new_tokens"] or 0), eos)
    if pad_token_id is None:
        config = getattr(model, "generation_config", None)
        pad_token_id = getattr(config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)

    # the prompt's images (vision-language models): refused up front where not exact
    media = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                 pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                 second_per_grid_ts=second_per_grid_ts, image_position_ids=image_position_ids,
                 image_sizes=image_sizes)
    vision = check_vision_prompt(model, media, mm_token_type_ids, input_ids, attention_mask,
                                 copies, _parameters_sharded(model), token_type_ids)

    settings = _settings(model, method, group, ring_degree)
    unrouted = unrouted_stateful_layers(model)
    if unrouted:
        raise ValueError(f"{type(model).__name__}'s recurrent layers ({', '.join(unrouted)}) are "
                         "not switched to sequence parallelism (an attention implementation set "
                         "alone): pass method= to generate, or call "
                         "easy_context.apply_sequence_parallel")
    m = get_method(settings.method)
    world = 1 if m.layout == "whole" else group_size(settings.group)
    rank = group_rank(settings, world)
    if copies > 1:  # each prompt repeated in place, as transformers expands it
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    lengths = _left_padded_lengths(input_ids, attention_mask)
    if not beyond_rope_range:
        check_rope_range(text_config(model.config), int(lengths.max()) + max_new_tokens)
    rescaling = rope_types(text_config(model.config)) & RESCALING_ROPE
    if world > 1 and rescaling:
        # Training takes the length from the whole sequence (integrations.whole_sequence);
        # decoding would also need the prefill's padded positions kept out of it and each
        # step's growth, which transformers applies to new keys only: not reproduced here.
        raise ValueError(f"{'/'.join(sorted(rescaling))} RoPE scaling rescales from the longest "
                         "position a forward sees, which decoding grows token by token: "
                         "generate on one rank (training is exact on any number), or use "
                         "linear or yarn scaling")
    if synced_gpus is None:
        synced_gpus = (dist.is_initialized() and dist.get_world_size() > world
                       and _parameters_sharded(model))

    device = next(model.parameters()).device
    pg = process_group(settings.group)
    # before any other collective: the same prompts and flags on every rank of the group
    fingerprint = _fingerprint(input_ids, attention_mask, dict(
        flags, max_new_tokens=max_new_tokens, seed=seed, eos=eos, pad=pad_token_id,
        stop_strings=stop_strings, beyond_rope_range=beyond_rope_range,
        synced_gpus=bool(synced_gpus),
        vision=media_digest(media) if vision is not None else None))
    sampling.seed = agree_and_seed(fingerprint, seed, pg, world, device)

    b, length = input_ids.shape
    # each prompt from the start of its row; rows padded at the end to a length the method
    # can shard (pads: token 0 in an invalid slot; positions counting on)
    longest = int(lengths.max())
    multiple = required_multiple(m.name, world, settings.ring_degree)
    padded = -(-longest // multiple) * multiple
    ids = torch.zeros(b, padded, dtype=torch.long)
    for row in range(b):
        ids[row, :lengths[row]] = input_ids[row, length - lengths[row]:].cpu()
    process.start([ids[row, :lengths[row]] for row in range(b)])
    positions = torch.arange(padded).expand(b, padded)
    valid = positions < lengths[:, None]
    local = [shard_sequence(t, m.name, rank, world, ring_degree=settings.ring_degree)
             for t in (ids, positions, valid)]
    ids_l, pos_l, valid_l = (t.to(device) for t in local)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    images = (prepare_vision_prompt(model, m.name, ids, valid, lengths, rank, world,
                                    settings.ring_degree, media, device)
              if vision is not None else None)

    cache = ShardedKVCache(settings, world, rank, ShardedKVCache.share(max_new_tokens, world))
    decoder = decoder_of(model)
    choose = TokenChooser(sampling)
    done = torch.zeros(b, dtype=torch.bool)
    new: list[Tensor] = []
    texts: list[list[int]] = [[] for _ in range(b)]
    timings = {}
    raw: list[Tensor] = []

    def run() -> None:
        nonlocal done
        start = time.perf_counter()
        cache.start_prefill(pos_l, valid_l, lengths)
        if images is None:
            hidden = decoder(input_ids=decoder_input_ids(model, ids_l), position_ids=pos_l,
                             use_cache=False,
                             **{KV_CACHE_KWARG: cache}).last_hidden_state  # (B, S_local, D)
        else:  # this shard's embeddings with its images' features; the model's positions
            embeds, extra = vision_embeddings(model, ids_l, images.shard)
            if any(images.shard.image_spans):  # Gemma 3, 4: the prompt's images both ways
                extra[IMAGE_SPANS_KWARG] = images.shard.image_spans
            hidden = decoder(inputs_embeds=embeds, position_ids=images.positions,
                             use_cache=False, **extra,
                             **{KV_CACHE_KWARG: cache}).last_hidden_state
        # each prompt's last token: on one rank; summed over the group, the others add zeros
        last = (pos_l == (lengths.to(device) - 1)[:, None]) & valid_l  # (B, S_local)
        h = hidden[torch.arange(b, device=device), last.int().argmax(dim=1)]  # (B, D)
        h = h * last.any(dim=1, keepdim=True).to(h.dtype)
        if world > 1:
            dist.all_reduce(h, group=pg)
        logits = _next_logits(model, h)
        timings["prefill"] = time.perf_counter() - start

        start = time.perf_counter()
        finished = False  # this group's rows are all done
        step = 0
        query = lengths.to(device)
        token = None
        while True:
            if not finished:
                if output_logits:
                    raw.append(logits.cpu())
                token = choose(process(logits, step))
                if world > 1:  # one source of truth for the token: group rank 0's (all agree)
                    dist.broadcast(token, src=0 if pg is None else dist.get_global_rank(pg, 0),
                                   group=pg)
                token = torch.where(done.to(token.device), torch.full_like(token, pad_token_id),
                                    token)
                new.append(token.cpu())
                if streamer is not None:
                    streamer.put(new[-1])
                process.add(new[-1])
                for row in range(b):
                    if not done[row]:
                        texts[row].append(int(token[row]))
                done = stops.update(texts, new[-1], done)
                finished = bool(done.all()) or step == max_new_tokens - 1
                query = (lengths + step).to(device)  # the new token's position in each row
            if synced_gpus:
                # transformers' synced_gpus: every rank sharing the parameters runs forwards
                # until all are done (their all-gathers pair up across the groups)
                going = torch.tensor([0.0 if finished else 1.0], device=device)
                dist.all_reduce(going)
                if float(going) == 0.0:
                    break
            elif finished:
                break
            # a done group's forward keeps nothing and its logits are not used
            cache.start_decode(step, query, keep=not finished)
            rotary = query if images is None else query + images.deltas  # (B,)
            hidden = decoder(input_ids=decoder_input_ids(model, token[:, None]),
                             position_ids=rotary[:, None],
                             use_cache=False, **{KV_CACHE_KWARG: cache}).last_hidden_state[:, -1]
            cache.finish_decode()
            logits = _next_logits(model, hidden)
            step += 1
        timings["decode"] = time.perf_counter() - start

    with _fsdp_root_forward(model) as forward:
        forward(run)
    if streamer is not None:
        streamer.end()
    sequences = torch.cat([input_ids.cpu(), torch.stack(new, dim=1)], dim=1).to(input_ids.device)
    if not return_stats:
        return sequences
    return GenerationResult(sequences, timings["prefill"], timings["decode"], len(new),
                            [len(t) for t in texts], cache.nbytes(),
                            raw if output_logits else None)
