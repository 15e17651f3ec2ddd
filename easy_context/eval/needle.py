"""Needle in a haystack: build prompts for any tokenizer and score them sequence-parallel.

A prompt is ``[BOS] prefix haystack-with-needles question answer``. Needles ("The special
magic Paris number is: 4821907.") go in at sentence boundaries found in the haystack *text*
(after ``.``, ``!`` or ``?`` and whitespace), never at hard-coded token ids, and the whole
prompt is tokenized as one string, so every tokenizer sees natural text. Variants:

- multi-key: ``num_distractor`` needles with other keys (cities) and numbers;
- multi-value: ``num_values`` needles for the queried key; the answer lists every value in
  the order they appear.

Scoring is teacher-forced: one forward pass over prompt + answer, where the answer span
scores a token correct when the model's argmax at the previous position is that token. The
pass is sequence-parallel, so a 1M-token prompt costs one sharded forward; each rank keeps
logits only for the answer positions it holds, and the per-token results are summed across
ranks. A cell scores 1 when every answer token is right (exact match), and the token
accuracy is kept too. Greedy generation in one process is the optional second scorer.
"""

from __future__ import annotations

import bisect
import inspect
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.synthetic import haystack_sentences
from .sharding import shard_prompt

KEYS = ("Singapore", "Paris", "London", "Tokyo", "Berlin", "New York", "Beijing", "Cairo",
        "Lima", "Oslo", "Nairobi", "Sydney")
# A sentence ends at . ! or ? (optionally closed by a quote or bracket) followed by whitespace;
# the next sentence starts where the whitespace ends.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass
class NeedleTemplate:
    """The prompt's wording; ``{key}`` and ``{value}`` are filled per sample."""

    prefix: str = "This is a very long story book: <book> "
    needle: str = "The special magic {key} number is: {value}."
    question: str = (" </book>. Based on the content of the book, Question: What is the special "
                     "magic {key} number? Answer: The special magic {key} number is:")
    question_multi_value: str = (" </book>. Based on the content of the book, Question: What are "
                                 "all the special magic {key} numbers? Answer: The special magic "
                                 "{key} numbers are:")
    answer_prefix: str = " "
    """Text between the question and the values (which are joined by ", ")."""


@dataclass
class NeedleConfig:
    """What to evaluate (the flags of ``easy-context eval-needle``)."""

    min_context_length: int = 1000
    max_context_length: int = 32000
    context_interval: int = 1000
    depth_interval: float = 0.1
    num_samples: int = 2
    rnd_number_digits: int = 7
    num_distractor: int = 0
    num_values: int = 1
    seed: int = 0
    add_bos: bool | None = None
    """Prepend BOS: None means 'when the tokenizer has one' (as prepare-data does)."""
    template: NeedleTemplate = field(default_factory=NeedleTemplate)
    distinct_digits: bool = False
    """Numbers without a repeated digit (at most 10 digits): a model that copies by finding
    the earlier occurrence of the current digit then has one candidate, not several."""

    def __post_init__(self) -> None:
        if self.min_context_length > self.max_context_length:
            raise ValueError(f"--min-context-length ({self.min_context_length}) is greater than "
                             f"--max-context-length ({self.max_context_length})")
        if self.min_context_length < 1 or self.context_interval < 1:
            raise ValueError("context lengths and --context-interval must be positive")
        if not 0 < self.depth_interval <= 1:
            raise ValueError(f"--depth-interval must be in (0, 1], got {self.depth_interval}")
        if self.num_samples < 1 or self.rnd_number_digits < 1 or self.num_values < 1:
            raise ValueError("--num-samples, --rnd-number-digits and --num-values must be >= 1")
        if self.distinct_digits and self.rnd_number_digits > 10:
            raise ValueError("--rnd-number-digits must be <= 10 with distinct digits")
        if self.num_distractor >= len(KEYS):
            raise ValueError(f"--num-distractor must be below {len(KEYS)} (one key per needle)")

    def context_lengths(self) -> list[int]:
        return list(range(self.min_context_length, self.max_context_length + 1,
                          self.context_interval))

    def depths(self) -> list[float]:
        n = round(1 / self.depth_interval)
        return sorted({round(min(i * self.depth_interval, 1.0), 4) for i in range(n + 1)} | {1.0})

    @property
    def chance(self) -> float:
        """Exact-match probability of guessing every number uniformly."""
        return (1 / number_count(self.rnd_number_digits, self.distinct_digits)) ** self.num_values


def number_count(digits: int, distinct: bool = False) -> int:
    """How many numbers of ``digits`` digits there are (no leading zero), optionally with no
    digit repeated."""
    if not distinct:
        return 9 * 10 ** (digits - 1)
    n = 9
    for i in range(1, digits):
        n *= 10 - i
    return n


def random_number(rng: random.Random, digits: int, distinct: bool = False) -> str:
    """A number of ``digits`` digits with no leading zero (see ``number_count``)."""
    if not distinct:
        return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    first = rng.choice("123456789")
    return first + "".join(rng.sample([d for d in "0123456789" if d != first], digits - 1))


@dataclass
class Haystack:
    """Text, its tokens' character offsets, and where its sentences start."""

    text: str
    offsets: list[tuple[int, int]]
    boundaries: list[int]  # sorted character indices where a sentence starts

    @classmethod
    def from_text(cls, text: str, tokenizer: PreTrainedTokenizerBase) -> "Haystack":
        if not tokenizer.is_fast:
            raise ValueError("the needle eval needs a fast tokenizer (character offsets); "
                             f"{type(tokenizer).__name__} is a slow one")
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(text)]
        return cls(text, [tuple(o) for o in enc["offset_mapping"]], bounds)

    def __len__(self) -> int:
        return len(self.offsets)


def read_haystack_dir(folder: str | Path) -> str:
    """The ``.txt`` files of ``folder``, in name order, joined by blank lines."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"haystack folder {folder} does not exist")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"haystack folder {folder} has no .txt files; put plain-text "
                                "files there, or omit --haystack-dir for a generated haystack")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def build_haystack(tokenizer: PreTrainedTokenizerBase, min_tokens: int,
                   haystack_dir: str | Path | None = None, repeat: bool = True,
                   seed: int = 0) -> Haystack:
    """A haystack of at least ``min_tokens`` tokens.

    Without a folder the text is generated (easy_context.data.synthetic, varied and filler
    sentences), as long as needed. A folder's text is repeated when it is too short, as the
    original EasyContext did; with ``repeat=False`` a short folder is an error instead
    (repetition lets a model copy from an earlier copy of the same passage).
    """
    if haystack_dir is None:
        sentences = haystack_sentences(random.Random(seed), "mixed")
        parts: list[str] = []
        chars = 4 * min_tokens
        while True:
            while sum(map(len, parts)) + len(parts) < chars:
                parts.append(next(sentences))
            hay = Haystack.from_text(" ".join(parts), tokenizer)
            if len(hay) >= min_tokens:
                return hay
            chars *= 2
    text = read_haystack_dir(haystack_dir)
    hay = Haystack.from_text(text, tokenizer)
    if len(hay) >= min_tokens:
        return hay
    if not repeat:
        raise ValueError(f"haystack {haystack_dir} has {len(hay)} tokens, but the longest context "
                         f"needs {min_tokens}; add text, lower --max-context-length, or allow "
                         "repetition (drop --no-repeat-haystack)")
    copies = -(-min_tokens // max(len(hay), 1)) + 1
    return Haystack.from_text("\n\n".join([text] * copies), tokenizer)


@dataclass
class NeedlePrompt:
    input_ids: list[int]
    answer_start: int  # index of the first answer token in input_ids
    answer_len: int
    key: str
    values: list[str]  # in the order they appear in the text
    depth: float  # where the queried needle actually went, as a fraction of the haystack


def _random_number(rng: random.Random, digits: int, taken: set[str], distinct: bool) -> str:
    while True:
        value = random_number(rng, digits, distinct)
        if value not in taken:
            taken.add(value)
            return value


@dataclass
class _SampleText:
    """What one sample puts around the haystack: the same in every cell."""

    key: str  # the queried key
    values: list[str]
    needles: list[tuple[str, bool]]  # (text, whether it holds the queried key)
    question: str
    add_bos: bool
    overhead: int  # tokens of prefix, needles, question, answer (and BOS)


def _sample_text(tokenizer: PreTrainedTokenizerBase, cfg: NeedleConfig, sample: int) -> _SampleText:
    t = cfg.template
    # The numbers depend on the sample only, so every cell asks about the same numbers.
    rng = random.Random(f"{cfg.seed}:values:{sample}")
    keys = rng.sample(KEYS, 1 + cfg.num_distractor)
    taken: set[str] = set()
    values = [_random_number(rng, cfg.rnd_number_digits, taken, cfg.distinct_digits)
              for _ in range(cfg.num_values)]
    needles = [(t.needle.format(key=keys[0], value=v), True) for v in values]
    needles += [(t.needle.format(key=k, value=_random_number(rng, cfg.rnd_number_digits, taken,
                                                                   cfg.distinct_digits)),
                 False) for k in keys[1:]]
    question = (t.question if cfg.num_values == 1 else t.question_multi_value).format(key=keys[0])
    add_bos = tokenizer.bos_token_id is not None if cfg.add_bos is None else cfg.add_bos
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token")
    answer_guess = t.answer_prefix + ", ".join(values)
    overhead = len(tokenizer(t.prefix + "".join(n + " " for n, _ in needles) + question
                             + answer_guess, add_special_tokens=False)["input_ids"]) + add_bos
    return _SampleText(keys[0], values, needles, question, add_bos, overhead)


def _check_fits(context_length: int, overhead: int) -> None:
    if context_length - overhead < 1:
        raise ValueError(f"context length {context_length} is too short for the prompt template "
                         f"and needles ({overhead} tokens); raise --min-context-length")


def check_needle_prompts(tokenizer: PreTrainedTokenizerBase, cfg: NeedleConfig) -> None:
    """The errors ``build_prompt`` would meet at the shortest context length, met without a
    model or a haystack (before any rank starts): a slow tokenizer, add_bos without a BOS
    token, a context length too short for the template, needles and answer of some sample."""
    if not tokenizer.is_fast:
        raise ValueError("the needle eval needs a fast tokenizer (character offsets); "
                         f"{type(tokenizer).__name__} is a slow one")
    for sample in range(cfg.num_samples):
        _check_fits(cfg.min_context_length, _sample_text(tokenizer, cfg, sample).overhead)


def build_prompt(hay: Haystack, tokenizer: PreTrainedTokenizerBase, cfg: NeedleConfig,
                 context_length: int, depth: float, sample: int) -> NeedlePrompt:
    """The prompt for one cell and sample, about ``context_length`` tokens long (exact for
    tokenizers whose pieces do not merge across the joins; within a few tokens otherwise)."""
    t = cfg.template
    text_of = _sample_text(tokenizer, cfg, sample)
    values, needles, question = text_of.values, text_of.needles, text_of.question
    add_bos = text_of.add_bos
    _check_fits(context_length, text_of.overhead)
    budget = context_length - text_of.overhead
    if budget > len(hay):
        raise ValueError(f"haystack has {len(hay)} tokens, context length {context_length} needs "
                         f"{budget}; build the haystack for the longest context")
    end = hay.offsets[budget - 1][1]
    # Sentence starts inside the cut haystack, and its end (where the question follows).
    bounds = hay.boundaries[:bisect.bisect_left(hay.boundaries, end)] + [end]
    # The queried needle: the first sentence start at or after the depth.
    target = 0 if depth <= 0 else hay.offsets[min(int(depth * budget), budget - 1)][0]
    i = bisect.bisect_left(bounds, target)
    first = bounds[min(i, len(bounds) - 1)]
    place = random.Random(f"{cfg.seed}:place:{context_length}:{depth}:{sample}")
    spots = [first] + [place.choice(bounds) for _ in needles[1:]]
    # Insert from the back so earlier character positions stay valid; equal spots keep order.
    text = hay.text[:end]
    for pos, (needle, _) in sorted(zip(spots, needles), key=lambda x: x[0], reverse=True):
        text = (text[:pos] + needle + " " + text[pos:]) if pos < end else (text + " " + needle)
    order = sorted(range(len(needles)), key=lambda j: (spots[j], j))
    ordered_values = [values[j] for j in order if needles[j][1]]
    prompt = t.prefix + text + question
    full = prompt + t.answer_prefix + ", ".join(ordered_values)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    # Tokens that end past the prompt carry the answer (one that straddles the join counts).
    start = next(j for j, (_, e) in enumerate(offsets) if e > len(prompt))
    if add_bos:
        ids, start = [tokenizer.bos_token_id] + ids, start + 1
    return NeedlePrompt(ids, start, len(ids) - start, text_of.key, ordered_values,
                        depth=first / max(end, 1))


def _keeps_logits(model: PreTrainedModel) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.inference_mode()
def score_teacher_forced(model: PreTrainedModel, prompt: NeedlePrompt, method: str,
                         pad_id: int, group: dist.ProcessGroup | None = None,
                         device: torch.device | str = "cpu",
                         ring_degree: int | None = None) -> dict:
    """Teacher-forced answer accuracy in one (sequence-parallel) forward pass.

    Every rank of ``group`` calls this with the same prompt. Returns {"correct", "total",
    "nll", "predicted_ids"}: correct answer tokens, answer length, summed NLL of the answer,
    and the argmax token at each answer position, all summed over the ranks.
    """
    ids = torch.tensor([prompt.input_ids])  # (1, L)
    s, n = prompt.answer_start, prompt.answer_len
    targets = torch.full_like(ids, -100)
    targets[0, s - 1:s - 1 + n] = ids[0, s:s + n]  # position t predicts token t + 1
    shard = shard_prompt(ids, targets, method, pad_id, group, device, ring_degree)
    tgt_local = shard.target_ids
    keep = tgt_local != -100  # (1, S_local) bool: this rank's answer positions
    kwargs = {"logits_to_keep": keep} if _keeps_logits(model) else {}
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                   **kwargs).logits
    if not kwargs:
        logits = logits[keep]
    logits = logits.reshape(-1, logits.shape[-1]).float()  # (answer tokens here, V)
    tgt = tgt_local[keep]
    pred = logits.argmax(-1)
    # Answer slot j of a position p is p - (s - 1); slots not held here stay -1 / 0.
    slots = shard.position_ids[keep] - (s - 1)
    predicted = torch.full((n,), -1, dtype=torch.long, device=tgt.device)
    predicted[slots] = pred
    stats = torch.stack([(pred == tgt).sum().double(),
                         F.cross_entropy(logits, tgt, reduction="sum").double()])
    shard.sum(stats)
    shard.max(predicted)
    return {"correct": int(stats[0].item()), "total": n, "nll": float(stats[1].item()),
            "predicted_ids": predicted.tolist()}


@torch.inference_mode()
def score_generate(model: PreTrainedModel, prompt: NeedlePrompt,
                   device: torch.device | str = "cpu") -> dict:
    """Greedy generation of the answer in one process (plain attention with a KV cache)."""
    ids = torch.tensor([prompt.input_ids[:prompt.answer_start]], device=device)
    answer = torch.tensor(prompt.input_ids[prompt.answer_start:], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=prompt.answer_len, min_new_tokens=prompt.answer_len,
                         pad_token_id=answer[0].item())
    gen = out[0, ids.shape[1]:]
    return {"correct": int((gen == answer[:len(gen)]).sum().item()), "total": prompt.answer_len,
            "nll": float("nan"), "predicted_ids": gen.tolist()}


def evaluate_needle(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, hay: Haystack,
                    cfg: NeedleConfig, method: str, *, group: dist.ProcessGroup | None = None,
                    device: torch.device | str = "cpu", generate: bool = False,
                    ring_degree: int | None = None, progress: bool = True) -> dict:
    """Every (context length, depth) cell: its exact-match score (mean over samples), token
    accuracy and per-sample details; plus the average score and the chance level."""
    from ..utils.progress import progress_bar

    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    lengths, depths = cfg.context_lengths(), cfg.depths()
    bar = progress_bar(total=len(lengths) * len(depths) * cfg.num_samples, desc="needle", unit="prompt",
               disable=not progress)
    cells = []
    try:  # closed on an error too (an open bar prints itself again at exit)
        for length in lengths:
            for depth in depths:
                samples = []
                for i in range(cfg.num_samples):
                    p = build_prompt(hay, tokenizer, cfg, length, depth, i)
                    r = (score_generate(model, p, device) if generate else
                         score_teacher_forced(model, p, method, pad_id, group, device, ring_degree))
                    shown = [t for t in r["predicted_ids"] if t >= 0]
                    samples.append({"key": p.key, "answer": ", ".join(p.values),
                                    "predicted": tokenizer.decode(shown),
                                    "tokens": len(p.input_ids),
                                    "depth": round(p.depth, 4), "correct_tokens": r["correct"],
                                    "answer_tokens": r["total"], "answer_nll": r["nll"],
                                    "exact": r["correct"] == r["total"]})
                    bar.update(1)
                cells.append({"context_length": length, "depth_percent": round(depth * 100, 2),
                              "score": sum(s["exact"] for s in samples) / len(samples),
                              "token_accuracy": sum(s["correct_tokens"] / s["answer_tokens"]
                                                    for s in samples) / len(samples),
                              "samples": samples})
                bar.set_postfix(length=length, score=f"{cells[-1]['score']:.2f}")
    finally:
        bar.close()
    return {"cells": cells, "average_score": sum(c["score"] for c in cells) / len(cells),
            "average_token_accuracy": sum(c["token_accuracy"] for c in cells) / len(cells),
            "chance": cfg.chance}
