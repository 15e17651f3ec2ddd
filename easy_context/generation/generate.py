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

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..integrations.hf import (KV_CACHE_KWARG, RESCALING_ROPE, apply_sequence_parallel,
                                between_decoder_and_head, output_head, rope_types)
from ..mesh import group_size, process_group
from ..parallel import get_method
from ..parallel.settings import SequenceParallelSettings, module_settings
from ..sequence_parallel import required_multiple, shard_sequence
from ..utils.decoder import decoder_of, text_config
from .cache import ShardedKVCache, group_rank
from .sampling import SamplingConfig, StopCriteria, TokenChooser

Tensor = torch.Tensor


@dataclass
class GenerationResult:
    """What ``generate(..., return_stats=True)`` returns."""

    sequences: Tensor  # (B, L + T): the prompts as given, then the new tokens (pad after a stop)
    prefill_seconds: float
    decode_seconds: float
    new_tokens: int  # decode steps run (T)
    lengths: list[int]  # each row's new tokens up to and including the one that stopped it
    cache_bytes: int  # this rank's KV cache (keys, values, positions, validity)


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


@torch.inference_mode()
def generate(model: nn.Module, input_ids: Tensor, *, method: str | None = None, group=None,
             ring_degree: int | None = None, attention_mask: Tensor | None = None,
             max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int | None = None, seed: int = 0,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             stop_strings: str | list[str] | None = None, tokenizer=None,
             return_stats: bool = False,
             beyond_rope_range: bool = False) -> Tensor | GenerationResult:
    """Generate up to ``max_new_tokens`` after each of the (B, L) prompts, sequence-parallel.

    Every rank of the group calls this with the same ``input_ids`` (and ``attention_mask``,
    left padding for prompts of different lengths). ``method`` (with ``group``,
    ``ring_degree``) switches the model first; without it the model must already be
    switched (easy_context.apply_sequence_parallel). Greedy by default (token for token what
    transformers' greedy ``generate`` gives in one process); ``do_sample`` with
    ``temperature``, ``top_k``, ``top_p`` and a ``seed`` that gives the same tokens on any
    number of ranks. A row stops at an EOS token (``eos_token_id``, default the model's
    generation config) or after a stop string (needs ``tokenizer``); stopped rows are filled
    with ``pad_token_id``. Returns (B, L + T) on every rank, or a GenerationResult with
    timings and this rank's cache bytes when ``return_stats``. A prompt plus its new tokens
    beyond the model's RoPE range (``max_position_embeddings`` with plain RoPE) is refused
    unless ``beyond_rope_range``: for probing where a model breaks down on purpose (the demo
    asks its model, trained at 512 tokens, for answers at 2048 before extending it).
    """
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be (batch, length) int64, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    from ..memory.maxlen import max_length_settings

    if max_length_settings(model) is not None:
        raise ValueError("generate runs the plain layers: load the model without max-length mode")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or between_decoder_and_head(model, head):
        raise ValueError(f"{type(model).__name__}'s logits are not its output head applied to "
                         "the decoder's last hidden state (a transform with parameters sits "
                         "between them, as in BERT-style heads), which generate needs: "
                         "generate in one process with model.generate")
    sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    eos = _eos_ids(model, eos_token_id)
    stops = StopCriteria(eos, stop_strings, tokenizer)
    if pad_token_id is None:
        config = getattr(model, "generation_config", None)
        pad_token_id = getattr(config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)

    settings = _settings(model, method, group, ring_degree)
    m = get_method(settings.method)
    world = 1 if m.layout == "whole" else group_size(settings.group)
    rank = group_rank(settings, world)
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

    device = next(model.parameters()).device
    b, length = input_ids.shape
    # each prompt from the start of its row; rows padded at the end to a length the method
    # can shard (pads: token 0 in an invalid slot; positions counting on)
    longest = int(lengths.max())
    multiple = required_multiple(m.name, world, settings.ring_degree)
    padded = -(-longest // multiple) * multiple
    ids = torch.zeros(b, padded, dtype=torch.long)
    for row in range(b):
        ids[row, :lengths[row]] = input_ids[row, length - lengths[row]:].cpu()
    positions = torch.arange(padded).expand(b, padded)
    valid = positions < lengths[:, None]
    local = [shard_sequence(t, m.name, rank, world, ring_degree=settings.ring_degree)
             for t in (ids, positions, valid)]
    ids_l, pos_l, valid_l = (t.to(device) for t in local)

    cache = ShardedKVCache(settings, world, rank, ShardedKVCache.share(max_new_tokens, world))
    cache.start_prefill(pos_l, valid_l)
    decoder = decoder_of(model)
    start = time.perf_counter()
    hidden = decoder(input_ids=ids_l, position_ids=pos_l, use_cache=False,
                     **{KV_CACHE_KWARG: cache}).last_hidden_state  # (B, S_local, D)
    # each prompt's last token: on one rank; summed over the group, the others add zeros
    last = (pos_l == (lengths.to(device) - 1)[:, None]) & valid_l  # (B, S_local)
    h = hidden[torch.arange(b, device=device), last.int().argmax(dim=1)]  # (B, D)
    h = h * last.any(dim=1, keepdim=True).to(h.dtype)
    pg = process_group(settings.group)
    if world > 1:
        dist.all_reduce(h, group=pg)
    logits = _next_logits(model, h)
    prefill_s = time.perf_counter() - start

    choose = TokenChooser(sampling)
    done = torch.zeros(b, dtype=torch.bool)
    new: list[Tensor] = []
    texts: list[list[int]] = [[] for _ in range(b)]
    start = time.perf_counter()
    for step in range(max_new_tokens):
        token = choose(logits)
        if world > 1:  # one source of truth for the token: group rank 0's (all agree)
            dist.broadcast(token, src=0 if pg is None else dist.get_global_rank(pg, 0),
                           group=pg)
        token = torch.where(done.to(token.device), torch.full_like(token, pad_token_id), token)
        new.append(token.cpu())
        for row in range(b):
            if not done[row]:
                texts[row].append(int(token[row]))
        done = stops.update(texts, new[-1], done)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        query = (lengths + step).to(device)  # the new token's position in each row
        cache.start_decode(step, query)
        hidden = decoder(input_ids=token[:, None], position_ids=query[:, None],
                         use_cache=False, **{KV_CACHE_KWARG: cache}).last_hidden_state[:, -1]
        cache.finish_decode()
        logits = _next_logits(model, hidden)
    decode_s = time.perf_counter() - start
    sequences = torch.cat([input_ids.cpu(), torch.stack(new, dim=1)], dim=1).to(input_ids.device)
    if not return_stats:
        return sequences
    return GenerationResult(sequences, prefill_s, decode_s, len(new),
                            [len(t) for t in texts], cache.nbytes())
