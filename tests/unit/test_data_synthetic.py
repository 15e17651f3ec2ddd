"""Synthetic corpora (haystack, passkey, kv, vartrack) and BPE tokenizer training."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from easy_context.data import SyntheticConfig, generate, train_bpe_tokenizer
from easy_context.data.synthetic import FILLER, generate_texts


@pytest.mark.parametrize("kind", ["haystack", "passkey", "kv", "vartrack", "mix"])
def test_deterministic_and_length_bounded(kind):
    cfg = SyntheticConfig(kind=kind, num_docs=8, length=3000, seed=5)
    a, b = list(generate(cfg)), list(generate(cfg))
    assert a == b
    assert [r["text"] for r in a] != [r["text"] for r in generate(SyntheticConfig(**{**cfg.__dict__, "seed": 6}))]
    for r in a:
        assert 2000 < len(r["text"]) <= 3000  # filled to the budget, never over it
        assert set(r) >= {"kind", "text", "question", "answer", "depth", "id"}
    # Record i depends only on (seed, i): a shorter run is a prefix of a longer one.
    assert list(generate(SyntheticConfig(kind=kind, num_docs=3, length=3000, seed=5))) == a[:3]


def test_length_in_approximate_tokens():
    (r,) = generate(SyntheticConfig(kind="haystack", num_docs=1, length=500, length_unit="tokens",
                                    chars_per_token=4.0))
    assert 1800 < len(r["text"]) <= 2000


def test_haystack_mixes_filler_and_varied_sentences():
    (r,) = generate(SyntheticConfig(kind="haystack", num_docs=1, length=5000, noise="mixed"))
    assert "The grass is green." in r["text"] and "The sky is blue." in r["text"]
    sentences = set(r["text"].split(". "))
    assert len(sentences) > 20  # varied, not just the five filler sentences
    (f,) = generate(SyntheticConfig(kind="haystack", num_docs=1, length=5000, noise="filler"))
    assert set(s.rstrip(".") for s in f["text"].split(". ")) <= set(s.rstrip(".") for s in FILLER.split(". "))


def test_answers_are_recoverable_from_text():
    for r in generate(SyntheticConfig(kind="passkey", num_docs=5, length=4000, seed=1)):
        assert re.fullmatch(r"\d{5}", r["answer"])
        assert f"The pass key is {r['answer']}." in r["text"] and 0 <= r["depth"] <= 1
    for r in generate(SyntheticConfig(kind="kv", num_docs=5, length=4000, seed=1)):
        key = re.search(r'key "([0-9a-f-]+)"', r["question"]).group(1)
        assert f'"{key}": "{r["answer"]}"' in r["text"]
    for r in generate(SyntheticConfig(kind="vartrack", num_docs=5, length=4000, seed=1)):
        # Resolve the assignments in text order, as a model would have to.
        values: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR (X\d+) = (\w+)\.", r["text"]):
            values[name] = values[rhs] if rhs in values else rhs
        target = re.search(r"value (\d+)", r["question"]).group(1)
        assert sorted(n for n, v in values.items() if v == target) == sorted(r["answer"].split())
        assert len(r["answer"].split()) == 5  # 4 hops = 5 variables


def test_bad_synthetic_config():
    with pytest.raises(ValueError, match="unknown synthetic kind"):
        SyntheticConfig(kind="needles")
    with pytest.raises(ValueError, match="--length must be at least 1"):
        SyntheticConfig(length=0)  # refused at construction, before any file is opened


def test_train_bpe_tokenizer_round_trip(tmp_path):
    texts = generate_texts(60, 2000, seed=9)
    train_bpe_tokenizer(iter(texts), vocab_size=400, output_dir=tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert len(tok) == 400
    # Byte level: anything round-trips, including text never seen in training.
    for s in [texts[0][:300], "Ünïcödé ✓ 12345\n\ttabs"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s
    # Trained merges compress the training distribution well beyond bytes.
    assert len(tok(texts[0], add_special_tokens=False)["input_ids"]) < len(texts[0].encode()) / 2
    # No post-processor: the tokenizer itself adds no BOS/EOS.
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="--vocab-size must be at least 259"):
        train_bpe_tokenizer(texts, vocab_size=100)
