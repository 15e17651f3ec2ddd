"""Choosing the next token, and knowing when a row is done.

Sampling draws one uniform number per row per step from a CPU generator seeded by the
caller, and inverts the (temperature-scaled, top-k / top-p filtered) distribution with it.
Every rank draws the same numbers, and the draw does not depend on how many ranks computed
the logits: the same seed gives the same tokens on any number of ranks (up to a uniform
falling within float rounding of a boundary between two tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    min_p: float | None = None

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 1 (0 or None: no top-k), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


class TokenChooser:
    """Greedy (argmax, the first maximum as torch.argmax and transformers) or sampling."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """(B,) token ids from (B, V) float logits."""
        c = self.config
        if not c.do_sample:
            return logits.argmax(dim=-1)
        u = torch.rand(logits.size(0), generator=self.generator, dtype=torch.float64)
        x = logits.detach().to("cpu", torch.float64) / c.temperature
        x, order = x.sort(dim=-1, descending=True, stable=True)
        # transformers' warpers, in its order: temperature (above), top-k, top-p, min-p
        if c.top_k:
            x[:, c.top_k:] = float("-inf")
        p = torch.softmax(x, dim=-1)
        if c.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (at least one token), as
            # transformers' TopPLogitsWarper keeps it
            before = p.cumsum(dim=-1) - p
            p = torch.where(before < c.top_p, p, torch.zeros_like(p))
        if c.min_p is not None:
            # MinPLogitsWarper: drop tokens below min_p times the top token's probability
            # (renormalising what top-p kept scales both sides alike; the top token stays)
            p = torch.where(p < c.min_p * p[:, :1], torch.zeros_like(p), p)
        cdf = p.cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        pick = pick.clamp_(max=p.size(-1) - 1)
        # never a token with no mass (a uniform at the very top of a row)
        while True:
            zero = p.gather(1, pick[:, None]).squeeze(1) == 0
            if not zero.any():
                break
            pick = torch.where(zero, pick - 1, pick)
        return order.gather(1, pick[:, None]).squeeze(1).to(logits.device)


class LogitsProcessing:
    """What transformers' logits processors do before the token is chosen, greedy or
    sampled, in its order: RepetitionPenaltyLogitsProcessor (every token of the prompt, not
    its left padding, and every token generated so far: a negative logit times the penalty,
    a positive one divided by it), then MinNewTokensLengthLogitsProcessor (no EOS before
    ``min_new_tokens`` new tokens)."""

    def __init__(self, repetition_penalty: float, min_new_tokens: int, eos_token_ids: list[int]):
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        self.penalty = float(repetition_penalty)
        self.min_new_tokens = min_new_tokens
        self.eos = sorted(set(eos_token_ids))
        self.seen: Tensor | None = None  # (B, V) bool: tokens the penalty applies to
        self.prompts: list[Tensor] = []

    def start(self, prompts: list[Tensor]) -> None:
        """``prompts``: each row's real prompt tokens (no padding)."""
        self.prompts = prompts

    def _seen(self, vocab: int) -> Tensor:
        # made at the first step, from the logits' width (a ZeRO-3 head's weight is empty)
        if self.seen is None:
            self.seen = torch.zeros(len(self.prompts), vocab, dtype=torch.bool)
            for row, ids in enumerate(self.prompts):
                self.seen[row, ids[(ids >= 0) & (ids < vocab)]] = True
        return self.seen

    def add(self, token: Tensor) -> None:
        """(B,) this step's tokens join what the penalty sees."""
        if self.seen is not None:
            self.seen[torch.arange(token.numel()), token.cpu()] = True

    def __call__(self, logits: Tensor, step: int) -> Tensor:
        """(B, V) float logits before step ``step``'s token (0 for the first new token)."""
        if self.penalty != 1.0:
            seen = self._seen(logits.size(-1)).to(logits.device)
            penalised = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(seen, penalised, logits)
        if step < self.min_new_tokens and self.eos:
            logits = logits.clone()
            logits[:, [i for i in self.eos if i < logits.size(-1)]] = float("-inf")
        return logits


class StopCriteria:
    """EOS tokens and stop strings. A row stops after the token that ends it (the EOS token
    or the token completing a stop string is kept, as in transformers)."""

    def __init__(self, eos_token_ids: list[int], stop_strings: list[str] | None, tokenizer):
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.stop_strings = list(stop_strings or [])
        self.tokenizer = tokenizer
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer (tokenizer=...) to read the text")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not be empty strings")
        self._text_length: dict[int, int] = {}

    def update(self, new_tokens: list[list[int]], token: Tensor, done: Tensor) -> Tensor:
        """Rows that are done after this step's ``token`` (B,); ``new_tokens``: each row's
        generated ids so far, this step's included."""
        done = done | torch.isin(token.cpu(), self.eos)
        if self.stop_strings:
            for row, ids in enumerate(new_tokens):
                if done[row]:
                    continue
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
                before = self._text_length.get(row, 0)
                self._text_length[row] = len(text)
                longest = max(len(s) for s in self.stop_strings)
                # only a stop string that ends in the text this token added counts
                tail = text[max(0, before - longest + 1):]
                if any(s in tail for s in self.stop_strings):
                    done[row] = True
        return done
