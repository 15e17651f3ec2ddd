"""The RULER tasks, generated offline: each sample is a pure function of (seed, task, length,
index), so every rank builds the same prompts and a rerun builds the same ones again.

A task draws everything random up front (keys, values, where the needles go, the words),
then renders its prompt for any number n of haystack units (drawn on demand, each stream in
its own order, so the n-unit prompt is the same whatever n the fit tried before);
``make_sample`` picks the largest n whose prompt fits the length (haystack.fit_units). What
fits is counted on the exact ids the model gets, template and answer prefix included, plus
the answer budget:

    len(input_ids) + max_new_tokens <= length

Tasks (RULER's names and settings; ``kv`` is ours):

- ``niah_*``: needles "One of the special magic numbers for KEY is: VALUE." in a haystack:
  noise (single_1), essay (single_2, single_3 with UUID values, multikey_1 with 3
  distractor keys, multivalue: 4 values for the key, multiquery: 4 keys asked at once), or
  other needles (multikey_2; multikey_3 with UUID keys and values).
- ``vt``: a chain "VAR ABCDE = 12345." "VAR FGHIJ = VAR ABCDE." ... (4 hops) in noise;
  answer every variable that gets the value.
- ``cwe``: a numbered list where 10 words appear 30 times and the others 3 (6 and 1 below
  4096 tokens, as RULER), after one worked example; answer the 10 most common.
- ``fwe``: words with Zipf counts (alpha 2), "..." the most frequent; answer the three
  most frequent words after it.
- ``kv``: a JSON object of UUID keys -> UUID values; answer one key's value.
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .haystack import (PromptEncoder, Units, essay_sentences, fit_units, insert_at_depths,
                       noise_sentences, pseudo_words, random_number, random_uuid)


@dataclass(frozen=True)
class TaskSpec:
    """One task: its generator (``kind``) and RULER's settings for it."""

    name: str
    kind: str
    """niah, vt, cwe, fwe or kv."""
    max_new_tokens: int
    """RULER's tokens_to_generate: the answer budget counted in the length."""
    metric: str = "string_match_all"
    haystack: str = "essay"
    """niah: noise, essay or needles (other needles make the haystack)."""
    key: str = "word"
    """niah: word (two pseudo-words, "bakemo-tirusa") or uuid."""
    value: str = "number"
    """niah: number (7 digits) or uuid."""
    keys: int = 1
    """niah: needles' keys, the queried ones included."""
    values: int = 1
    """niah: values per key; all of the queried keys' are the answer."""
    queries: int = 1
    """niah: keys asked for at once."""


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("niah_single_1", "niah", 128, haystack="noise"),
    TaskSpec("niah_single_2", "niah", 128),
    TaskSpec("niah_single_3", "niah", 128, value="uuid"),
    TaskSpec("niah_multikey_1", "niah", 128, keys=4),
    TaskSpec("niah_multikey_2", "niah", 128, haystack="needles"),
    TaskSpec("niah_multikey_3", "niah", 128, haystack="needles", key="uuid", value="uuid"),
    TaskSpec("niah_multivalue", "niah", 128, values=4),
    TaskSpec("niah_multiquery", "niah", 128, keys=4, queries=4),
    TaskSpec("vt", "vt", 30),
    TaskSpec("cwe", "cwe", 120),
    TaskSpec("fwe", "fwe", 50),
    TaskSpec("kv", "kv", 128),
)}

VT_CHAINS, VT_HOPS = 1, 4  # RULER's vt: one chain of 5 variables
CWE_COMMON = 10
FWE_ALPHA, FWE_ZETA = 2.0, math.pi ** 2 / 6  # zeta(2): the Zipf weights' sum
FWE_MIN_WORDS = 100  # from 100 words on, the three answers are strictly the most frequent


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; tasks: {', '.join(TASKS)}")
    return TASKS[name]


@dataclass
class RulerSample:
    task: str
    length: int
    index: int
    prompt: str
    """The text the model continues: template applied, answer prefix last (BOS not shown)."""
    references: list[str]
    max_new_tokens: int
    metric: str
    input_ids: list[int]
    units: int
    """Haystack units the prompt holds (sentences, needles, list words, JSON pairs)."""


@dataclass
class Draft:
    """A sample's random draws, rendered for any number of haystack units."""

    render: Callable[[int], str]  # n units -> the task's text
    answer_prefix: str
    references: list[str]
    units: Units | None = None  # the haystack (limited when it is a folder's sentences)
    low: int = 1


def make_sample(task: str, length: int, index: int, encoder: PromptEncoder, *, seed: int = 0,
                haystack_dir: str | Path | None = None, max_new_tokens: int | None = None,
                units: int | None = None) -> RulerSample:
    """Sample ``index`` of ``task`` at ``length`` tokens (see the module docstring); with
    ``units``, the same sample holding that many haystack units instead of the most that
    fit (to see what one more would do)."""
    spec, new, draft, tokens = _prepare(task, length, index, encoder, seed, haystack_dir,
                                        max_new_tokens)
    limit = draft.units.limit if draft.units is not None else None
    if units is None:
        _check_shortest(task, length, new, draft, tokens)
        units = fit_units(tokens, length - new, draft.low, limit)
        if units == limit:
            raise ValueError(f"{draft.units.source} has {limit} sentences, {tokens(limit)} "
                             f"tokens in task {task}'s prompt: too few to fill length {length} "
                             f"({new} of them for the answer); add .txt text there or lower "
                             "--lengths")
    text = encoder.text(draft.render(units), draft.answer_prefix)
    return RulerSample(task, length, index, text, draft.references, new, spec.metric,
                       encoder.ids(text), units)


def check_length(task: str, length: int, encoder: PromptEncoder, *, seed: int = 0,
                 haystack_dir: str | Path | None = None,
                 max_new_tokens: int | None = None) -> None:
    """Raise make_sample's error when ``length`` cannot hold even the task's shortest prompt
    (its template and answers with one haystack unit) and answer budget: one short prompt
    tokenized, no fit."""
    _check_shortest(task, length, *_prepare(task, length, 0, encoder, seed, haystack_dir,
                                             max_new_tokens)[1:])


def _prepare(task, length, index, encoder, seed, haystack_dir, max_new_tokens):
    spec = get_task(task)
    new = max_new_tokens or spec.max_new_tokens
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    draft = _DRAFTS[spec.kind](spec, rng, length, haystack_dir)

    def tokens(n: int) -> int:
        return len(encoder.ids(encoder.text(draft.render(n), draft.answer_prefix)))

    return spec, new, draft, tokens


def _check_shortest(task: str, length: int, new: int, draft: Draft,
                    tokens: Callable[[int], int]) -> None:
    if draft.units is not None and draft.units.limit is not None and \
            draft.units.limit < draft.low:
        raise ValueError(f"{draft.units.source} holds no sentence; add text to its .txt files")
    need = tokens(draft.low) + new
    if need > length:
        raise ValueError(f"task {task} needs {need} tokens at least (its template, answers and "
                         f"{draft.low} haystack unit(s), plus {new} new tokens), above the "
                         f"length {length}; use --lengths of {need} or more, or a smaller "
                         "--max-new-tokens")


# ---------------------------------------------------------------- needle in a haystack


def _niah(spec: TaskSpec, rng: random.Random, length: int, haystack_dir) -> Draft:
    words = pseudo_words(rng)

    def new_value(r: random.Random) -> str:
        return random_uuid(r) if spec.value == "uuid" else random_number(r, 7)

    keys = [random_uuid(rng) if spec.key == "uuid" else f"{next(words)}-{next(words)}"
            for _ in range(max(spec.keys, spec.queries))]
    needles = [(k, new_value(rng)) for k in keys for _ in range(spec.values)]
    asked = keys[:spec.queries]
    references = [v for k, v in needles if k in asked]
    depths = [rng.random() for _ in needles]
    kind = "uuid" if spec.value == "uuid" else "number"

    def needle(key: str, value: str) -> str:
        return f"One of the special magic {kind}s for {key} is: {value}."

    hay_rng = random.Random(rng.random())  # its own: drawn from as the fit asks for more
    if spec.haystack == "noise":
        hay = noise_sentences()
    elif spec.haystack == "essay":
        hay = essay_sentences(haystack_dir, hay_rng)
    else:  # needles with other keys and values make the haystack
        other_words = pseudo_words(hay_rng)

        def others():
            while True:
                k = (random_uuid(hay_rng) if spec.key == "uuid" else
                     f"{next(other_words)}-{next(other_words)}")
                v = new_value(hay_rng)
                if k not in keys and v not in references:
                    yield needle(k, v) + " "
        hay = Units(others())
    items = [(d, needle(k, v)) for d, (k, v) in zip(depths, needles)]
    several = len(references) > 1
    about = _join(asked)
    nouns = f"{kind}s" if several else kind
    question = (f"What are all the special magic {nouns} for {about} mentioned in the provided "
                "text?" if several else
                f"What is the special magic {kind} for {about} mentioned in the provided text?")
    intro = (f"Some special magic {kind}s are hidden within the following text. Make sure to "
             f"memorize them. I will quiz you about the {kind}s afterwards.")
    return Draft(lambda n: f"{intro}\n{insert_at_depths(hay.take(n), items)}\n{question}",
                 f"Answer: The special magic {nouns} for {about} mentioned in the provided text "
                 f"{'are' if several else 'is'}", references, hay)


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# ---------------------------------------------------------------- variable tracking


def _vt(spec: TaskSpec, rng: random.Random, length: int, haystack_dir) -> Draft:
    names: list[str] = []
    while len(names) < VT_CHAINS * (VT_HOPS + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names and "VAR" not in name:
            names.append(name)
    values: list[str] = []
    while len(values) < VT_CHAINS:
        value = random_number(rng, 5)
        if value not in values:
            values.append(value)
    items = []
    for c, value in enumerate(values):
        chain = names[c * (VT_HOPS + 1):(c + 1) * (VT_HOPS + 1)]
        statements = [f"VAR {chain[0]} = {value}."] + [
            f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        # sorted depths keep a chain in order: a variable is assigned before it is copied
        items += zip(sorted(rng.random() for _ in statements), statements)
    asked = names[:VT_HOPS + 1]
    hay = noise_sentences()
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = (f"Question: Find all variables that are assigned the value {values[0]} in the "
                "text above.")
    return Draft(lambda n: f"{intro}\n\n{insert_at_depths(hay.take(n), items)}\n{question}",
                 "Answer: According to the chain(s) of variable assignment in the text above, "
                 f"{len(asked)} variables are assigned the value {values[0]}, they are:",
                 asked, hay)


# ---------------------------------------------------------------- common words


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(spec: TaskSpec, rng: random.Random, length: int, haystack_dir) -> Draft:
    # RULER's frequencies: the 10 common words 30 times and the others 3 times from 4096
    # tokens on, 6 and 1 below (30 x 10 items would not fit); its one worked example has
    # 40 words (10 x 10, 30 x 3), or 20 (10 x 3, 10 x 1) below 4096.
    long = length >= 4096
    freq_common, freq_rare = (30, 3) if long else (6, 1)
    words = pseudo_words(rng)
    example = [next(words) for _ in range(40 if long else 20)]
    example_items = example[:CWE_COMMON] * (10 if long else 3) + \
        example[CWE_COMMON:] * (3 if long else 1)
    rng.shuffle(example_items)
    common = [next(words) for _ in range(CWE_COMMON)]
    rare = Units(words)
    shuffle_seed = rng.random()
    intro = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.")
    question = f"Question: What are the {CWE_COMMON} most common words in the list above?"
    prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
    shot = f"{intro}\n{_numbered(example_items)}\n{question}\n{prefix} " + \
        _numbered(example[:CWE_COMMON])

    def render(n: int) -> str:
        items = common * freq_common + rare.take(n) * freq_rare
        random.Random(f"{shuffle_seed}:{n}").shuffle(items)
        return f"{shot}\n{intro}\n{_numbered(items)}\n{question}"

    return Draft(render, prefix, common)


# ---------------------------------------------------------------- frequent words


def fwe_counts(n: int) -> list[int]:
    """How often the words of rank 1, 2, ... appear among ``n`` words: floor(n k^-a / zeta(a)),
    RULER's Zipf counts (rank 1 is the noise word "...")."""
    counts = []
    while (c := int(n * (len(counts) + 1) ** -FWE_ALPHA / FWE_ZETA)) > 0:
        counts.append(c)
    return counts


def _fwe(spec: TaskSpec, rng: random.Random, length: int, haystack_dir) -> Draft:
    ranked = Units(pseudo_words(rng))
    answers = ranked.take(4)[1:]
    shuffle_seed = rng.random()

    def render(n: int) -> str:
        counts = fwe_counts(n)
        vocab = ["..."] + ranked.take(len(counts))[1:]
        items = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"{shuffle_seed}:{n}").shuffle(items)
        return ("Read the following coded text and track the frequency of each coded word. "
                f"Find the three most frequently appearing coded words. {' '.join(items)}\n"
                "Question: Do not provide any explanation. Please ignore the dots '...'. What "
                "are the three most frequently appearing words in the coded text above?")

    return Draft(render, "Answer: According to the coded text above, the three most "
                 "frequently appearing words are:", answers, low=FWE_MIN_WORDS)


# ---------------------------------------------------------------- JSON key-value


def _kv(spec: TaskSpec, rng: random.Random, length: int, haystack_dir) -> Draft:
    key, value = random_uuid(rng), random_uuid(rng)
    depth = rng.random()
    pair_rng = random.Random(rng.random())

    def others():
        while True:
            pair = random_uuid(pair_rng), random_uuid(pair_rng)
            if pair[0] != key:
                yield pair

    pairs_of = Units(others())

    def render(n: int) -> str:
        pairs = pairs_of.take(n)
        pairs.insert(round(depth * n), (key, value))
        data = json.dumps(dict(pairs), indent=1)
        return ("Extract the value corresponding to the specified key in the JSON object "
                f"below.\n\nJSON data:\n{data}\n\nKey: \"{key}\"\nQuestion: What is the value "
                "associated with the specified key in the JSON object above?")

    return Draft(render, f"Answer: The value associated with the key \"{key}\" in the JSON "
                 "object is:", [value])


_DRAFTS = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe, "kv": _kv}
