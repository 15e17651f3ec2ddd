"""The demo's ingredients, all generated here: a tokenizer, a tiny Llama, retrieval corpora.

Retrieval in a model this small is an induction circuit: a previous-token head in layer 1,
and in layer 2 a head that finds the earlier occurrence of the current token and copies what
followed it. Such circuits form only after a long loss plateau (Olsson et al. 2022; Aoyama
et al. 2025 put it at millions of tokens), too long for a CPU demo, unless the data makes
each half useful on its own. So the corpus mixes three kinds of short documents:

- period documents, short units of distinct digits repeated ("390390390 4747"): predicting
  them needs the token one, two or three places back, which trains the previous-token head;
- copy drills, codes repeated after some haystack ("47102 <haystack> 47102."), half of them
  in the needle's own wording ("The Oslo code=47102. <haystack> Recall the Oslo
  code=47102."), which need the full induction circuit; the two together cut the plateau
  from thousands of steps to a few hundred (measured with an earlier alphabet: drill copy
  accuracy 1% -> 65% in 1750 steps of 32 x 64 tokens with period documents, 10% after 3500
  without them; 4% after 800 steps of retrieval tasks alone). A circuit grown on bare codes
  alone copied them but not after "code=" (25% of needle digits right at 256 tokens in both
  seeds tried), hence the needle-worded half;
- retrieval tasks in the needle eval's own wording ("The Paris code=48213." in a haystack,
  then the question and the answer), with log-uniform lengths up to the window so that every
  position is trained; the haystack is mostly the passkey test's repeated noise sentences,
  as in the eval (``filler_haystack``); the perplexity curves use varied text.

Codes, needle values and period units are digits with no digit repeated (the answers' own
alphabet): this tokenizer has no merges among digits, so a code is a sequence of single-digit
tokens, and a model that copies by finding the earlier occurrence of the current digit has
one candidate to follow, not several. The eval uses other numbers (a different seed) and its
own haystack.

Packing without cutting a task: prepare-data cuts the document that straddles a window
boundary into two segments, and a retrieval task cut in two teaches guessing (the question
without its needle). So the corpus is planned window by window in tokens: documents while
they fit, then a plain haystack document that fills the rest of the window (cutting a
haystack is harmless). The windows are then packed by prepare-data as usual, with
position_ids restarting at every document (and attention kept inside each document).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from ..data.synthetic import generate_texts, haystack_sentences, passkey_record
from ..eval.needle import KEYS, Haystack, NeedleTemplate, random_number

# "code=" occurs only in the needle and the question, and the haystack has no digits, so a
# 2-layer induction circuit (find the earlier "=", copy what followed) solves the task (the
# wording of the eval tests' tiny model, tests/unit/eval_fixtures.py).
TEMPLATE = NeedleTemplate(prefix="", needle="The {key} code={value}.",
                          question=" Recall the {key} code=",
                          question_multi_value=" Recall all {key} codes=", answer_prefix="")
DIGITS = 5
DISTINCT_DIGITS = True


@dataclass
class ModelShape:
    """The tiny Llama: ~0.48M parameters, 2 layers (the fewest an induction circuit needs:
    twice as many tokens per second as 4), 8 heads of 16 dimensions (with 4 of 32 the copy
    circuit formed late or not at all in 2 of 5 seeds of the eval tests' model)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    rope_theta: float = 1_000.0
    max_position_embeddings: int = 512


def build_tokenizer(folder: Path, vocab_size: int, seed: int):
    """A byte-level BPE trained on generated haystack and passkey text (no digits merge:
    the numbers are random, so digit pairs never become frequent enough)."""
    from ..data.tokenizer import train_bpe_tokenizer

    texts = generate_texts(200, 2000, seed=seed + 7, kind="haystack") + \
        generate_texts(100, 500, seed=seed + 8, kind="passkey")
    return train_bpe_tokenizer(texts, vocab_size=vocab_size, output_dir=folder)


def build_model(folder: Path, tokenizer, shape: ModelShape, seed: int) -> Path:
    """Randomly initialised Llama saved with its tokenizer (the normal from_pretrained path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_theta": shape.rope_theta, "rope_type": "default"},
        attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _sentences(rng: random.Random, n_tokens: int, tokens_of, noise: str = "mixed") -> list[str]:
    """Haystack sentences of about ``n_tokens`` tokens in total."""
    out, used = [], 0
    for s in haystack_sentences(rng, noise):
        n = tokens_of(" " + s)
        if used + n > n_tokens:
            return out
        out.append(s)
        used += n
    return out


def needle_document(rng: random.Random, n_tokens: int, tokens_of, noise: str = "filler",
                    distractors: int = 0) -> str:
    """One retrieval task of about ``n_tokens`` tokens: haystack with a needle (and
    ``distractors`` needles of other keys), the question about the first key, its answer."""
    keys = rng.sample(KEYS, 1 + distractors)
    values = [random_number(rng, DIGITS, DISTINCT_DIGITS) for _ in keys]
    needles = [TEMPLATE.needle.format(key=k, value=v) for k, v in zip(keys, values)]
    question = TEMPLATE.question.format(key=keys[0]) + TEMPLATE.answer_prefix + values[0] + "."
    fixed = sum(tokens_of(" " + n) for n in needles) + tokens_of(question)
    sentences = _sentences(rng, max(n_tokens - fixed, 0), tokens_of, noise)
    for needle in needles:
        sentences.insert(rng.randint(0, len(sentences)), needle)
    return " ".join(sentences) + question


# The copy curriculum's strings are the answers' own alphabet, the ten digits, with no digit
# repeated (see the module docstring for why).
SYMBOLS = "0123456789"


def _random_string(rng: random.Random, n: int) -> str:
    return "".join(rng.sample(SYMBOLS, n))


def period_document(rng: random.Random, n_tokens: int) -> str:
    """Random units of 2-4 distinct digits, each repeated 3-8 times ("390390390 474747"): about
    ``n_tokens`` tokens whose prediction needs the previous tokens (see the module docstring)."""
    parts, used = [], 0
    while used < n_tokens:
        unit = _random_string(rng, rng.randint(2, 4))
        part = unit * rng.randint(3, 8)
        parts.append(part)
        used += len(part) + 1
    return " ".join(parts)


def copy_drill(rng: random.Random, n_tokens: int, tokens_of, max_gap: int = 16,
               needle_share: float = 0.0) -> str:
    """Codes of ``DIGITS`` distinct digits, each repeated after up to ``max_gap`` tokens of
    haystack ("47102 <haystack> 47102. ..."), about ``n_tokens`` tokens: the second copy is
    predictable only by looking up the first, which is what the induction circuit does.
    Short gaps grow the circuit fastest; long ones teach it to look far back.

    A share ``needle_share`` of the codes come in the needle's own wording instead ("The Oslo
    code=47102. <haystack> Recall the Oslo code=47102."): a circuit grown on bare codes alone
    copied them perfectly but not after "code=" (measured: 25% of needle digits right at 256
    tokens for both seeds tried), so the drills show it both."""
    parts, used = [], 0
    while used < n_tokens:
        code = _random_string(rng, DIGITS)
        if rng.random() < needle_share:
            key = rng.choice(KEYS)
            first = TEMPLATE.needle.format(key=key, value=code)
            second = TEMPLATE.question.format(key=key) + TEMPLATE.answer_prefix + code + "."
        else:
            first, second = code, f" {code}."
        fixed = tokens_of(first) + tokens_of(second)
        room = max(n_tokens - used - fixed - 2, 0)  # a gap that fits the document
        gap = " ".join(_sentences(rng, rng.randint(0, min(max_gap, room)), tokens_of, "filler"))
        piece = f"{first} {gap}{second}" if gap else first + second
        n = tokens_of(" " + piece)
        if parts and used + n > n_tokens:  # the document is full
            break
        parts.append(piece)
        used += n
    return " ".join(parts)


def passkey_document(rng: random.Random, n_tokens: int, chars_per_token: float,
                     noise: str = "filler") -> str:
    record = passkey_record(rng, int(n_tokens * chars_per_token), noise)
    return f"{record['text']} {record['question']} The pass key is {record['answer']}."


def haystack_document(rng: random.Random, n_tokens: int, tokenizer) -> str:
    """Plain haystack of exactly ``n_tokens`` tokens (cut at a token boundary)."""
    parts, stream = [], haystack_sentences(rng, "mixed")
    while sum(map(len, parts)) < 8 * n_tokens + 64:  # always more characters than tokens
        parts.append(next(stream))
    text = " ".join(parts)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    end = enc["offset_mapping"][min(n_tokens, len(enc["input_ids"])) - 1][1]
    return text[:end]


def write_corpus(path: Path, tokenizer, seq_length: int, windows: int, min_doc: int,
                 seed: int, passkey_share: float = 0.05, filler_share: float = 0.75,
                 drill_share: float = 0.35, period_share: float = 0.25,
                 drill_tokens: tuple[int, int] = (32, 128), drill_gap: int = 16,
                 drill_needle_share: float = 0.5) -> dict:
    """Write ``windows`` windows' worth of documents to a jsonl file (see the module
    docstring). Retrieval documents are ``min_doc`` to ``seq_length`` tokens long, period
    documents and drills ``drill_tokens`` (short: the more of them, the denser the signal)
    with gaps of up to ``drill_gap`` tokens, BOS/EOS included. Returns counts."""
    rng = random.Random(f"demo-corpus:{seed}:{seq_length}")
    cache: dict[str, int] = {}

    def tokens_of(s: str) -> int:
        if s not in cache:
            cache[s] = len(tokenizer(s, add_special_tokens=False)["input_ids"])
        return cache[s]

    sample = " ".join(_sentences(random.Random(seed), 400, lambda s: len(s) // 3))
    chars_per_token = len(sample) / max(tokens_of(sample), 1)
    window = seq_length + 1
    offset = 0
    counts = {"needle": 0, "drill": 0, "period": 0, "passkey": 0, "haystack": 0, "tokens": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        while offset < windows * window:
            room = window - offset % window
            kind = rng.random()
            short = rng.randint(*drill_tokens) - 2  # BOS, EOS
            if kind < period_share + drill_share and short + 8 <= room:
                if kind < period_share:
                    text, kind = period_document(rng, short), "period"
                else:
                    text, kind = copy_drill(rng, short, tokens_of, drill_gap,
                                                  drill_needle_share), "drill"
            elif room >= min_doc + 8:
                # Log-uniform lengths: many short tasks (retrieval is learnt from the number
                # of tasks), and some as long as the window (positions up to its end).
                n = int(math.exp(rng.uniform(math.log(min_doc), math.log(room)))) - 2
                noise = "filler" if rng.random() < filler_share else "mixed"
                if rng.random() < passkey_share:
                    text, kind = passkey_document(rng, n, chars_per_token, noise), "passkey"
                else:
                    text, kind = needle_document(rng, n, tokens_of, noise), "needle"
            else:
                text, kind = haystack_document(rng, max(room - 2, 1), tokenizer), "haystack"
            used = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2
            if used > room:  # a rare overshoot: fill the window instead
                text, kind = haystack_document(rng, max(room - 2, 1), tokenizer), "haystack"
                used = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2
            f.write(json.dumps({"text": text}) + "\n")
            offset += used
            counts[kind] += 1
    counts["tokens"] = offset
    return counts


def write_heldout(path: Path, tokenizer, n_docs: int, n_tokens: int, seed: int) -> list[str]:
    """Held-out documents of at least ``n_tokens`` tokens for the perplexity curves: long
    varied haystacks with a needle, which a model predicts well only where its positions
    work."""
    rng = random.Random(f"demo-heldout:{seed}")
    texts = []
    for _ in range(n_docs):
        doc = ""
        while len(tokenizer(doc, add_special_tokens=False)["input_ids"]) < n_tokens:
            doc = needle_document(rng, int(n_tokens * 1.1) + 32,
                                  lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"]),
                                  noise="mixed")
        texts.append(doc)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def filler_haystack(tokenizer, min_tokens: int) -> Haystack:
    """The needle eval's haystack: the repeated noise sentences of the passkey test
    (Mohtashami & Jaggi 2023), at least ``min_tokens`` tokens."""
    parts, stream = [], haystack_sentences(random.Random(0), "filler")
    while True:
        parts += [next(stream) for _ in range(64)]
        hay = Haystack.from_text(" ".join(parts), tokenizer)
        if len(hay) >= min_tokens:
            return hay
