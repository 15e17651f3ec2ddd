"""The demo's pieces that need no training: its corpus keeps every retrieval task inside one
window, its eval haystack is long enough, and a rerun refuses another run's folder."""

import json
import re

import pytest

from easy_context.demo.build import build_tokenizer, filler_haystack, write_corpus


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=320, seed=0)


def test_corpus_never_cuts_a_retrieval_task(tokenizer, tmp_path):
    seq_length, windows = 256, 12
    counts = write_corpus(tmp_path / "c.jsonl", tokenizer, seq_length, windows, min_doc=32, seed=1)
    texts = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    kinds = ("needle", "drill", "period", "passkey", "haystack")
    assert sum(counts[k] for k in kinds) == len(texts)
    assert counts["needle"] > windows and counts["drill"] > 0 and counts["period"] > 0
    window, offset, tasks = seq_length + 1, 0, 0
    for text in texts:
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2  # BOS, EOS
        drill = re.match(r"([0-9A-Z]{8,20}) ", text) and "." in text  # periods have no "."
        if drill:  # every string of a drill comes back
            codes = re.findall(r"(?:^|\. )([0-9A-Z]{8,20}) ", text)
            assert codes and all(text.count(c) >= 2 for c in codes), text
        if "code=" in text or drill or "pass key" in text:  # a task
            answer = re.search(r"[= ](\w+)\.?$", text).group(1)
            assert text.count(answer) >= 2  # the needle holds the answer
            assert offset // window == (offset + n - 1) // window, text[-80:]  # one window
            tasks += 1
        offset += n
    assert counts["tokens"] == offset >= windows * window
    assert tasks == counts["needle"] + counts["drill"] + counts["passkey"]


def test_copy_curriculum_symbols_are_single_tokens(tokenizer):
    """Period documents and drills repeat token sequences only if every symbol is a token."""
    import random

    from easy_context.demo.build import SYMBOLS, period_document

    for ch in SYMBOLS:
        assert len(tokenizer(ch, add_special_tokens=False)["input_ids"]) == 1, ch
    text = period_document(random.Random(0), 60)
    unit_runs = text.split(" ")
    assert all(len(run) >= 6 for run in unit_runs) and len(text) >= 50


def test_filler_haystack_has_the_tokens_asked_for(tokenizer):
    hay = filler_haystack(tokenizer, 700)
    assert len(hay) >= 700 and hay.text.startswith("The grass is green.")
    assert len(hay.boundaries) > 50


def test_a_rerun_must_be_the_same_run(tmp_path):
    from easy_context.demo.run import run_demo_pipeline

    (tmp_path / "demo_run.json").write_text(json.dumps(
        {"quick": True, "nproc_per_node": 2, "seed": 0}))
    with pytest.raises(ValueError, match="pass another --output"):
        run_demo_pipeline(tmp_path, quick=False)
