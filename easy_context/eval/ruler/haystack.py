"""What RULER prompts are made of, and fitting a prompt to a token length.

- Haystacks are lists of sentences, each carrying its trailing whitespace, so the first n
  sentences joined with ``""`` are a prefix of the text: "noise" (RULER's repeated "The grass
  is green. ..."), and "essay" (a local folder's .txt files, or easy_context.data.synthetic's
  generated sentences when there is no folder; RULER uses Paul Graham's essays).
- Words are pronounceable pseudo-words of three consonant-vowel syllables ("bakemo"), drawn
  from a seeded generator: RULER takes English words from the wonderwords package; these
  need no download. All have 6 letters, so no word is a substring of another and a
  substring match never credits the wrong word.
- ``PromptEncoder`` turns a task's text into the token ids the model sees (BOS or the chat
  template, then the answer prefix); ``fit_units`` finds how many haystack units fill a
  token budget.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...data.synthetic import FILLER, haystack_sentences

if TYPE_CHECKING:  # the command's --help stays fast
    from transformers import PreTrainedTokenizerBase

TEMPLATES = ("base", "chat")
_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
# A sentence ends at . ! or ? (optionally closed by a quote or bracket) and the whitespace
# after it; the whitespace stays with the sentence it closes.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def pseudo_words(rng: random.Random) -> Iterator[str]:
    """Endless distinct 6-letter pseudo-words ("bakemo", "tirusa"); 75^3 = 421875 exist."""
    seen: set[str] = set()
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if word not in seen:
            seen.add(word)
            yield word


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


@dataclass
class Units:
    """Haystack units (sentences, list words, JSON pairs) produced on demand from ``stream``
    (a finite iterator or an endless generator), so a prompt of n units is built from the
    first n whatever order the fit asks for them in; ``limit`` is how many exist (None:
    endless), ``source`` names them in errors."""

    stream: Iterator[Any]
    limit: int | None = None
    source: str = "generated text"
    _seen: list[Any] = field(default_factory=list)

    def take(self, n: int) -> list[Any]:
        while len(self._seen) < n:
            self._seen.append(next(self.stream))
        return self._seen[:n]


def noise_sentences() -> Units:
    """RULER's noise haystack, one of its five sentences at a time (finer steps than the
    whole paragraph, so prompts land closer to their length)."""
    parts = [s if s.endswith(".") else s + "." for s in FILLER.split(". ")]
    return Units(parts[i % len(parts)] + " " for i in itertools.count())


def essay_sentences(haystack_dir: str | Path | None, rng: random.Random) -> Units:
    """A folder's text from its start, or generated varied sentences. ``rng`` must be the
    haystack's own: it is drawn from as the fit asks for more sentences."""
    if haystack_dir is None:
        return Units(s + " " for s in haystack_sentences(rng, "varied"))
    parts = folder_sentences(str(Path(haystack_dir).resolve()))
    return Units(iter(parts), len(parts), f"haystack folder {haystack_dir}")


@functools.lru_cache(maxsize=4)
def folder_sentences(folder: str) -> tuple[str, ...]:
    """The sentences of a folder's .txt files (read once per run, not once per sample)."""
    from ..needle import read_haystack_dir

    text = read_haystack_dir(folder).strip() + "\n"
    starts = [0] + [m.end() for m in _SENTENCE_END.finditer(text)]
    ends = starts[1:] + [len(text)]
    return tuple(text[a:b] for a, b in zip(starts, ends) if text[a:b].strip())


def insert_at_depths(sentences: list[str], items: list[tuple[float, str]]) -> str:
    """The sentences with each ``(depth, text)`` item placed before the sentence at that
    fraction of the list (depth 1.0: after the last); items keep their order by depth, and
    items of equal depth their given order (a variable is assigned before it is used)."""
    slots: dict[int, list[str]] = {}
    for depth, text in sorted(items, key=lambda item: item[0]):
        slots.setdefault(round(depth * len(sentences)), []).append(text + " ")
    parts = []
    for i in range(len(sentences) + 1):
        parts += slots.get(i, [])
        if i < len(sentences):
            parts.append(sentences[i])
    return "".join(parts).strip()


@dataclass
class PromptEncoder:
    """Prompt text -> the token ids the model gets.

    ``base``: BOS (when the tokenizer has one) + task text + newline + answer prefix.
    ``chat``: the task text as the user's turn through ``tokenizer.apply_chat_template``
    (with the generation prompt), then the answer prefix, as the start of the model's turn.
    Either way the ids are exactly what the length is counted on.
    """

    tokenizer: PreTrainedTokenizerBase
    template: str = "base"

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown --template {self.template!r}; use one of {TEMPLATES}")
        if self.template == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{type(self.tokenizer).__name__} has no chat template "
                             "(tokenizer_config.json chat_template); use --template base")

    def text(self, content: str, answer_prefix: str) -> str:
        if self.template == "base":
            return f"{content}\n{answer_prefix}"
        turn = self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  tokenize=False, add_generation_prompt=True)
        return turn + answer_prefix

    def ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.tokenizer.bos_token_id
        # The chat template writes its own special tokens (BOS among them) as text.
        return [bos] + ids if self.template == "base" and bos is not None else ids


def fit_units(count: Callable[[int], int], budget: int, low: int = 1,
              limit: int | None = None) -> int | None:
    """The largest n in [low, limit] with ``count(n) <= budget`` (None when not even ``low``
    fits; ``limit`` when it does). ``count`` (tokens of the prompt holding n haystack units)
    must grow with n.

    RULER bisects between bounds estimated from the tokens per unit; this interpolates from
    the tokens per unit seen so far, so a 128K-token prompt takes a handful of tokenizations
    rather than ~15, and bisects whenever the bracket does not halve.
    """
    lo, c_lo = low, count(low)
    if c_lo > budget:
        return None
    hi, c_hi = None, None  # the smallest n known not to fit
    per_unit = c_lo / max(lo, 1)  # an overestimate at first: the fixed text counts too
    width = None
    while (hi is None or hi > lo + 1) and lo != limit:
        if hi is None:
            guess = lo + max(1, int((budget - c_lo) / max(per_unit, 1e-9)))
            top = limit if limit is not None else guess
        else:
            rate = (c_hi - c_lo) / (hi - lo)
            guess = lo + int((budget - c_lo) / max(rate, 1e-9))
            if width is not None and hi - lo > width // 2:
                guess = (lo + hi) // 2  # interpolation stalled: bisect
            width, top = hi - lo, hi - 1
        n = min(max(guess, lo + 1), top)
        c = count(n)
        if c <= budget:
            per_unit = (c - c_lo) / (n - lo) if c > c_lo else per_unit
            lo, c_lo = n, c
        else:
            hi, c_hi = n, c
    return lo
