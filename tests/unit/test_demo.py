"""The demo's pieces that need no training: its corpus keeps every retrieval task inside one
window, its eval haystack is long enough, and a rerun refuses another run's folder."""

import json
import re

import pytest

from easy_context.demo.build import DIGITS, build_tokenizer, filler_haystack, write_corpus


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
    window, offset, tasks, needle_form = seq_length + 1, 0, 0, 0
    for text in texts:
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2  # BOS, EOS
        numbers = re.findall(r"\d+", text)  # the haystack has no digits
        if numbers and re.fullmatch(r"[0-9 ]+", text):  # a period document: units repeated
            assert all(len(set(run)) <= 4 for run in text.split()), text
        elif numbers:  # a task: every number comes back (drill codes, needles, pass keys)
            assert all(text.count(x) >= 2 for x in numbers), text
            if "pass key" not in text:  # codes and needle values: DIGITS distinct digits
                assert all(len(x) == len(set(x)) == DIGITS for x in numbers), text
            assert re.search(r"\d\.$", text), text[-40:]  # it ends with an answer
            assert offset // window == (offset + n - 1) // window, text[-80:]  # one window
            needle_form += text.count("Recall the")
            tasks += 1
        offset += n
    assert counts["tokens"] == offset >= windows * window
    assert tasks == counts["needle"] + counts["drill"] + counts["passkey"]
    assert needle_form > counts["needle"]  # some drills are in the needle's wording


def test_copy_curriculum_symbols_are_single_tokens(tokenizer):
    """Period documents and drills repeat token sequences only if every digit is a token
    (and stays one next to other digits and the needle's "=")."""
    import random

    from easy_context.demo.build import SYMBOLS, period_document

    for text in ("=" + SYMBOLS, " " + SYMBOLS[::-1] + "."):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert sum(p.strip("Ġ=.").isdigit() for p in pieces) == 10, pieces
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
