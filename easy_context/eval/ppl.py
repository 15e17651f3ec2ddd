"""Perplexity against context length, sequence-parallel, token-weighted.

For each context length L, every sample is scored in windows of L tokens with the usual
strided scheme (a window starts every ``sliding_window`` tokens and scores only the tokens
the previous window did not reach; with ``truncate`` a sample is cut to L tokens: one
window). Perplexity is exp(total NLL / total scored tokens) over every window of every
sample, with the NLL sum and the token count all-reduced across the sequence-parallel ranks:

    # the original: mean over samples of exp(mean over windows of (mean over ranks of mean NLL))
    ppl = exp(sum of token NLLs / number of scored tokens)      # here

Alongside, the perplexity of the last ``last_k`` tokens of each window: the far end of the
context, where a model whose position handling breaks down fails first.

No rank builds the full (tokens x vocab) logits: each computes its shard's hidden states and
turns them into token NLLs a chunk of positions at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..integrations.hf import plain_lm_head
from ..utils.decoder import decoder_of
from .sharding import shard_prompt


@dataclass
class PplConfig:
    """Which context lengths and how to window (the flags of ``easy-context eval-ppl``)."""

    min_tokens: int = 256
    max_tokens: int = 8192
    tokens_step: int | None = None
    """Step between lengths; None: one length, ``max_tokens`` (as the original)."""
    sliding_window: int = 256
    truncate: bool = False
    last_k: int = 256
    chunk_size: int = 4096
    """Positions per block of logits when turning hidden states into NLLs."""

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"--min-tokens ({self.min_tokens}) is greater than --max-tokens "
                             f"({self.max_tokens})")
        if min(self.min_tokens, self.sliding_window, self.last_k, self.chunk_size) < 1:
            raise ValueError("--min-tokens, --sliding-window and --last-k must be positive")
        if self.tokens_step is not None and self.tokens_step < 1:
            raise ValueError(f"--tokens-step must be positive, got {self.tokens_step}")

    def lengths(self) -> list[int]:
        if self.tokens_step is None:
            return [self.max_tokens]
        return list(range(self.min_tokens, self.max_tokens + 1, self.tokens_step))


def sliding_windows(n: int, length: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored index within the window) for a sequence of n tokens.

    Each window after the first scores only tokens past the previous window's end; index 0
    of a sample is never scored (nothing predicts it).
    """
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + length, n)
        yield begin, end, max(1, prev_end - begin)
        prev_end = end
        if end == n:
            return


def _token_nll(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
               targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-position NLL (B, S) in fp32 (0 where the target is -100), from this rank's shard."""
    head = plain_lm_head(model)
    if head is None:  # scaled or soft-capped logits: they must come from the model itself
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    hidden = decoder_of(model)(input_ids=input_ids, position_ids=position_ids,
                                 use_cache=False).last_hidden_state  # (B, S, H)
    flat_h, flat_t = hidden.flatten(0, 1), targets.flatten()
    out = torch.cat([F.cross_entropy(head(h).float(), t, reduction="none")
                     for h, t in zip(flat_h.split(chunk_size), flat_t.split(chunk_size))])
    return out.view_as(targets)


@torch.inference_mode()
def window_stats(model: PreTrainedModel, window: Sequence[int] | torch.Tensor, first: int,
                 method: str, pad_id: int, *, last_k: int = 256, chunk_size: int = 4096,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 ring_degree: int | None = None) -> torch.Tensor:
    """float64 [NLL sum, scored tokens, last-k NLL sum, last-k tokens] of one window, summed
    over the ranks of ``group`` (each calls this with the same window).

    Tokens ``window[first:]`` are scored; the last k are those at index >= len(window) - k.
    """
    ids = torch.as_tensor(window, dtype=torch.long).view(1, -1)  # (1, W)
    w = ids.shape[1]
    targets = torch.full_like(ids, -100)
    targets[0, first - 1:w - 1] = ids[0, first:]  # input position t predicts token t + 1
    shard = shard_prompt(ids, targets, method, pad_id, group, device, ring_degree)
    tgt, pos = shard.target_ids, shard.position_ids
    nll = _token_nll(model, shard.input_ids, pos, tgt, chunk_size).double()
    valid = tgt != -100
    tail = valid & (pos + 1 >= w - last_k)  # predicts a token among the window's last k
    stats = torch.stack([nll[valid].sum(), valid.sum().double(), nll[tail].sum(),
                         tail.sum().double()])
    return shard.sum(stats).cpu()


def evaluate_ppl(model: PreTrainedModel, samples: Sequence[Sequence[int]], cfg: PplConfig,
                 method: str, pad_id: int, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", ring_degree: int | None = None,
                 progress: bool = True) -> list[dict]:
    """One row per context length: tokens scored, NLL sum, perplexity, and the same for the
    last ``cfg.last_k`` tokens of each window."""
    from ..utils.progress import progress_bar

    if not samples:
        raise ValueError("no samples to evaluate (check --samples and --dataset-min-tokens)")
    plan = [(length, [(s, list(sliding_windows(min(len(s), length) if cfg.truncate else len(s),
                                                length, cfg.sliding_window)))
                      for s in samples]) for length in cfg.lengths()]
    bar = progress_bar(total=sum(len(ws) for _, per in plan for _, ws in per), desc="ppl",
               unit="window", disable=not progress)
    rows = []
    try:  # closed on an error too (an open bar prints itself again at exit)
        for length, per_sample in plan:
            total = torch.zeros(4, dtype=torch.float64)
            for sample, windows in per_sample:
                for begin, end, first in windows:
                    total += window_stats(model, sample[begin:end], first, method, pad_id,
                                          last_k=min(cfg.last_k, length), chunk_size=cfg.chunk_size,
                                          group=group, device=device, ring_degree=ring_degree)
                    bar.update(1)
            nll, count, last_nll, last_count = total.tolist()
            rows.append({"context_length": length, "samples": len(samples),
                         "windows": sum(len(ws) for _, ws in per_sample), "tokens": int(count),
                         "nll_sum": nll, "ppl": math.exp(nll / max(count, 1)),
                         "last_k": min(cfg.last_k, length), "last_k_tokens": int(last_count),
                         "last_k_nll_sum": last_nll,
                         "last_k_ppl": math.exp(last_nll / max(last_count, 1))})
            bar.set_postfix(length=length, ppl=f"{rows[-1]['ppl']:.3f}")
    finally:
        bar.close()
    return rows
