"""prepare-data end to end: determinism, streaming == in-memory, input kinds, clear errors."""

from __future__ import annotations

import itertools
import json

import datasets
import numpy as np
import pytest

from easy_context.data import PrepareConfig, UpsampleConfig, prepare_data
from tests.unit.data_fixtures import (expected_stream, load_tok, tokenizer_dir, write_jsonl,
                                      write_text_folder)


def _columns(path) -> dict[str, np.ndarray]:
    return datasets.load_from_disk(str(path)).with_format("numpy")[:]


def _assert_same(a, b) -> None:
    ca, cb = _columns(a), _columns(b)
    assert ca.keys() == cb.keys()
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)
    sa, sb = (json.loads((p / "stats.json").read_text()) for p in (a, b))
    for st in (sa, sb):
        st.pop("seconds")
        for src in st["sources"]:
            src.pop("path")  # the same data may come from different files
    assert sa == sb


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_text_folder(root / "books", n=10, length=3000, seed=11)
    write_jsonl(root / "web.jsonl", n=60, length=2000, seed=12)
    return root


def _cfg(corpus, out, **kw) -> PrepareConfig:
    base = dict(inputs=[str(corpus / "books"), f"web={corpus / 'web.jsonl'}"],
                tokenizer=tokenizer_dir(), output=str(out), seq_length=128,
                upsample=UpsampleConfig(threshold=300, keep_prob=0.5), min_length=20, seed=3)
    return PrepareConfig(**{**base, **kw})


def test_deterministic_for_a_seed(corpus, tmp_path):
    prepare_data(_cfg(corpus, tmp_path / "a"))
    prepare_data(_cfg(corpus, tmp_path / "b", num_proc=2, batch_size=7))
    _assert_same(tmp_path / "a", tmp_path / "b")
    prepare_data(_cfg(corpus, tmp_path / "c", seed=4))
    assert not np.array_equal(_columns(tmp_path / "a")["input_ids"], _columns(tmp_path / "c")["input_ids"])


def test_streaming_equals_in_memory(corpus, tmp_path):
    # Upsampling (extra length pass + repeat rounds), min-length filter, 2 workers, an odd
    # batch size: the streaming path must still reproduce the in-memory dataset exactly.
    prepare_data(_cfg(corpus, tmp_path / "mem"))
    prepare_data(_cfg(corpus, tmp_path / "stream", streaming=True, num_proc=2, batch_size=5))
    _assert_same(tmp_path / "mem", tmp_path / "stream")
    # And without upsampling (single pass, filter on the fly).
    prepare_data(_cfg(corpus, tmp_path / "mem2", upsample=UpsampleConfig(), shuffle=False))
    prepare_data(_cfg(corpus, tmp_path / "stream2", upsample=UpsampleConfig(), shuffle=False,
                      streaming=True))
    _assert_same(tmp_path / "mem2", tmp_path / "stream2")


def test_input_kinds_give_the_same_tokens(tmp_path):
    """A text column from jsonl, parquet, a save_to_disk folder: identical packed output."""
    texts = write_jsonl(tmp_path / "d.jsonl", n=15, length=1500, seed=21, column="body")
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "saved"))
    outs = []
    for i, src in enumerate(["d.jsonl", "d.parquet", "saved"]):
        out = tmp_path / f"out{i}"
        prepare_data(PrepareConfig(inputs=[f"src={tmp_path / src}"], tokenizer=tokenizer_dir(),
                                   output=str(out), seq_length=64, text_column="body",
                                   shuffle=False, max_documents=12))
        outs.append(out)
    _assert_same(outs[0], outs[1])
    _assert_same(outs[0], outs[2])
    flat = [t for d in expected_stream(texts[:12], load_tok()) for t in d]
    ids = _columns(outs[0])["input_ids"].ravel()
    np.testing.assert_array_equal(ids, flat[: ids.size])
    assert len(flat) - ids.size < 65


def test_bad_inputs_say_what_to_change(corpus, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty; remove it"):
        prepare_data(_cfg(corpus, tmp_path / "o", inputs=[str(empty)]))
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "x.txt").write_text("")
    with pytest.raises(ValueError, match="no non-empty files"):
        prepare_data(_cfg(corpus, tmp_path / "o", inputs=[str(tmp_path / "emptydir")]))
    with pytest.raises(ValueError, match=r"no column 'content'.*--text-column"):
        prepare_data(_cfg(corpus, tmp_path / "o", text_column="content",
                          inputs=[str(corpus / "web.jsonl")]))
    with pytest.raises(ValueError, match=r"no column 'content'.*--text-column"):
        prepare_data(_cfg(corpus, tmp_path / "o", text_column="content", streaming=True,
                          inputs=[str(corpus / "web.jsonl")]))
    with pytest.raises(ValueError, match="seq_length must be at least 2.*--seq-length"):
        _cfg(corpus, tmp_path / "o", seq_length=1)
    with pytest.raises(FileNotFoundError, match="tokenizer folder .* does not exist; pass --tokenizer"):
        prepare_data(_cfg(corpus, tmp_path / "o", tokenizer=str(tmp_path / "no_such_tok")))
    with pytest.raises(FileNotFoundError, match="does not exist; give an existing"):
        prepare_data(_cfg(corpus, tmp_path / "o", inputs=[str(tmp_path / "missing.jsonl")]))
    with pytest.raises(ValueError, match="shorter than --min-length .*lower --min-length"):
        prepare_data(_cfg(corpus, tmp_path / "o", min_length=10**6, upsample=UpsampleConfig()))
    with pytest.raises(ValueError, match="fewer than one window.*lower --seq-length"):
        prepare_data(_cfg(corpus, tmp_path / "o", seq_length=10**6, upsample=UpsampleConfig()))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.md").write_text("keep me")
    with pytest.raises(ValueError, match="not a prepare-data output; pass a new --output"):
        prepare_data(_cfg(corpus, foreign))
    assert (foreign / "notes.md").exists()


def test_packed_ids_equal_plain_map_and_itertools_packing(tmp_path):
    """The plain way (datasets.map over the tokenizer's own call, then itertools windows)
    gives exactly our packed ids, in both modes: the faster backend call changes nothing."""
    path = tmp_path / "c.jsonl"
    write_jsonl(path, n=40, length=3000, seed=31)
    # Text that spells a special token, non-ASCII text, an empty document.
    extra = ["a literal <|eos|> inside", "déjà vu — ünïcödé ✓ 中文", ""]
    with path.open("a") as f:
        for t in extra:
            f.write(json.dumps({"text": t}) + "\n")
    tok = load_tok()
    ds = datasets.load_dataset("json", data_files=str(path), split="train",
                               cache_dir=str(tmp_path / "cache"))

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[tok.bos_token_id] + x + [tok.eos_token_id] for x in ids]}

    ids = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)["input_ids"]
    stream = itertools.chain.from_iterable(ids)
    window = 97
    plain = []
    while len(w := list(itertools.islice(stream, window))) == window:
        plain.append(w)
    assert len(plain) > 20
    for streaming in (False, True):
        out = tmp_path / f"ours{streaming}"
        prepare_data(PrepareConfig(inputs=[str(path)], tokenizer=tokenizer_dir(), output=str(out),
                                   seq_length=window - 1, num_proc=2, shuffle=False,
                                   streaming=streaming, batch_chars=5000))
        np.testing.assert_array_equal(_columns(out)["input_ids"], np.array(plain))
