"""The demo's ingredients, all generated here: a tokenizer, a tiny Llama, retrieval corpora.

Documents are retrieval tasks in the needle eval's own wording (easy_context.eval.needle:
"The magic Paris number is 48213." in a haystack, then the question and the answer), plus
passkey documents (easy_context.data.synthetic). What makes a model this small learn to
retrieve within a few hundred steps: one needle per task (no distractor keys), and mostly the
passkey test's repeated noise sentences as the haystack (three tasks in four; the rest use
varied sentences), so the needle is the one thing to attend to. The needle eval uses the
repeated noise too (``filler_haystack``); the perplexity curves use varied text.
The eval uses other numbers (a different seed) and its own haystack.

Packing without cutting a task: prepare-data cuts the document that straddles a window
boundary into two segments, and a retrieval task cut in two teaches guessing (the question
without its needle). So the corpus is planned window by window in tokens: retrieval
documents while they fit, then a plain haystack document that fills the rest of the window
(cutting a haystack is harmless). The windows are then packed by prepare-data as usual,
with position_ids restarting at every document.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from ..data.synthetic import generate_texts, haystack_sentences, passkey_record
from ..eval.needle import KEYS, NeedleTemplate

# "code=" occurs only in the needle and the question, and the haystack has no digits, so a
# 2-layer induction circuit (find the earlier "=", copy what followed) solves the task (the
# wording of the eval tests' tiny model, tests/unit/eval_fixtures.py).
TEMPLATE = NeedleTemplate(prefix="", needle="The {key} code={value}.",
                          question=" Recall the {key} code=",
                          question_multi_value=" Recall all {key} codes=", answer_prefix="")
DIGITS = 5


@dataclass
class ModelShape:
    """The tiny Llama: ~0.9M parameters, 4 layers, head_dim 32."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    rope_theta: float = 10_000.0
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
    values = [str(rng.randint(10 ** (DIGITS - 1), 10 ** DIGITS - 1)) for _ in keys]
    needles = [TEMPLATE.needle.format(key=k, value=v) for k, v in zip(keys, values)]
    question = TEMPLATE.question.format(key=keys[0]) + TEMPLATE.answer_prefix + values[0] + "."
    fixed = sum(tokens_of(" " + n) for n in needles) + tokens_of(question)
    sentences = _sentences(rng, max(n_tokens - fixed, 0), tokens_of, noise)
    for needle in needles:
        sentences.insert(rng.randint(0, len(sentences)), needle)
    return " ".join(sentences) + question


def copy_drill(rng: random.Random, n_tokens: int, tokens_of) -> str:
    """"=" + a random string, haystack, "=" + the same string: copy drills make induction
    heads form within a few hundred steps (without them a model this small plateaus for
    thousands); the needle task then only has to point them at "code="."""
    code = "".join(rng.choice("0123456789abcdefghijklmnopqrstuvwxyz") for _ in range(12))
    gap = _sentences(rng, max(n_tokens - 2 * tokens_of("=" + code) - 2, 0), tokens_of, "filler")
    return f"={code}. {' '.join(gap)} ={code}"


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
                 seed: int, passkey_share: float = 0.1, filler_share: float = 0.75,
                 drill_share: float = 0.3) -> dict:
    """Write ``windows`` windows' worth of documents to a jsonl file (see the module
    docstring). Documents are ``min_doc`` to ``seq_length`` tokens long, BOS/EOS included.
    Returns counts."""
    rng = random.Random(f"demo-corpus:{seed}:{seq_length}")
    cache: dict[str, int] = {}

    def tokens_of(s: str) -> int:
        if s not in cache:
            cache[s] = len(tokenizer(s, add_special_tokens=False)["input_ids"])
        return cache[s]

    sample = " ".join(_sentences(random.Random(seed), 400, lambda s: len(s) // 3))
    chars_per_token = len(sample) / max(tokens_of(sample), 1)
    window = seq_length + 1
    offset, counts = 0, {"needle": 0, "drill": 0, "passkey": 0, "haystack": 0, "tokens": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        while offset < windows * window:
            room = window - offset % window
            if room >= min_doc + 8:
                # Log-uniform lengths: many short tasks (retrieval is learnt from the number
                # of tasks), and some as long as the window (positions up to its end).
                n = int(math.exp(rng.uniform(math.log(min_doc), math.log(room)))) - 2  # BOS, EOS
                noise = "filler" if rng.random() < filler_share else "mixed"
                kind = rng.random()
                if kind < drill_share:
                    text, kind = copy_drill(rng, n, tokens_of), "drill"
                elif kind < drill_share + passkey_share:
                    text, kind = passkey_document(rng, n, chars_per_token, noise), "passkey"
                else:
                    text, kind = needle_document(rng, n, tokens_of, noise), "needle"
                used = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2
                if used > room:  # a rare overshoot: fill the window instead
                    text, kind = haystack_document(rng, max(room - 2, 1), tokenizer), "haystack"
            else:
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


def filler_haystack(tokenizer, min_tokens: int) -> "Haystack":
    """The needle eval's haystack: the repeated noise sentences of the passkey test
    (Mohtashami & Jaggi 2023), at least ``min_tokens`` tokens."""
    from ..eval.needle import Haystack

    parts, stream = [], haystack_sentences(random.Random(0), "filler")
    while True:
        parts += [next(stream) for _ in range(64)]
        hay = Haystack.from_text(" ".join(parts), tokenizer)
        if len(hay) >= min_tokens:
            return hay
