"""Packing: every token once, in order, with exact document boundaries; BOS/EOS rules."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from easy_context.data import Packer, PrepareConfig, prepare_data, resolve_special_tokens
from tests.unit.data_fixtures import (expected_stream, load_tok, tokenizer_dir, write_jsonl,
                                      write_text_folder)


def reference_positions(docs: list[list[int]], window: int) -> tuple[list[int], list[int]]:
    """Per-token position and document id by a plain loop: restart at doc and window starts."""
    pos, did, g = [], [], 0
    for d, doc in enumerate(docs):
        p = 0
        for _ in doc:
            if g % window == 0:
                p = 0
            pos.append(p)
            did.append(d)
            p += 1
            g += 1
    return pos, did


@pytest.mark.parametrize("seq_length", [2, 7, 64])
def test_packer_matches_reference_loop(seq_length):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(3, 500, size=int(n))) for n in rng.integers(1, 150, size=60)]
    packer = Packer(seq_length)
    outs = []
    # Uneven batches: the packer's carried state must not depend on how documents arrive.
    for lo, hi in [(0, 1), (1, 17), (17, 18), (18, 60)]:
        batch = docs[lo:hi]
        outs.append(packer.add(np.concatenate(batch), [len(d) for d in batch]))
    window = seq_length + 1
    flat = [t for d in docs for t in d]
    n_full = len(flat) // window
    ids = np.concatenate([o.input_ids for o in outs])
    pos = np.concatenate([o.position_ids for o in outs])
    did = np.concatenate([o.document_ids for o in outs])
    assert ids.shape == (n_full, window)
    ref_pos, ref_did = reference_positions(docs, window)
    np.testing.assert_array_equal(ids.ravel(), flat[: n_full * window])
    np.testing.assert_array_equal(pos.ravel(), ref_pos[: n_full * window])
    np.testing.assert_array_equal(did.ravel(), ref_did[: n_full * window])
    assert packer.dropped_tokens == len(flat) - n_full * window
    assert pos.max() < window


def test_prepare_round_trip(tmp_path):
    tok = load_tok()
    texts_a = write_text_folder(tmp_path / "a", n=12, length=1500, seed=1)
    texts_b = write_jsonl(tmp_path / "b.jsonl", n=20, length=2000, seed=2)
    out = tmp_path / "out"
    stats = prepare_data(PrepareConfig(inputs=[str(tmp_path / "a"), f"bee={tmp_path / 'b.jsonl'}"],
                                       tokenizer=tokenizer_dir(), output=str(out), seq_length=100,
                                       shuffle=False, num_proc=2))
    ds = datasets.load_from_disk(str(out))
    assert set(ds.column_names) == {"input_ids", "position_ids", "document_ids"}
    cols = ds.with_format("numpy")[:]
    ids, pos, did = cols["input_ids"], cols["position_ids"], cols["document_ids"]
    assert ids.shape[1] == 101
    assert ds.features["input_ids"].feature.dtype == "int32"  # stored dtype (numpy reads int64)
    assert ds.features["position_ids"].feature.dtype == "int32"

    docs = expected_stream(texts_a + texts_b, tok)
    flat = [t for d in docs for t in d]
    n = ids.size
    # Every source token once, in order; only the tail short of a window is dropped.
    np.testing.assert_array_equal(ids.ravel(), flat[:n])
    assert len(flat) - n == stats["dropped_tail_tokens"] < 101
    ref_pos, ref_did = reference_positions(docs, 101)
    np.testing.assert_array_equal(pos.ravel(), ref_pos[:n])
    np.testing.assert_array_equal(did.ravel(), ref_did[:n])
    # Boundaries: position 0 exactly at document starts and window starts, nowhere else.
    starts = np.cumsum([0] + [len(d) for d in docs])[:-1]
    restart = np.zeros(len(flat), dtype=bool)
    restart[starts] = True
    restart[::101] = True
    np.testing.assert_array_equal(pos.ravel() == 0, restart[:n])
    # Every document starts with BOS (the tokenizer has one) and ends with EOS.
    assert (ids.ravel()[starts[starts < n]] == tok.bos_token_id).all()

    saved = json.loads((out / "stats.json").read_text())
    assert saved["tokens"] == len(flat) and saved["documents"] == len(docs)
    by_name = {s["name"]: s for s in saved["sources"]}
    assert by_name["a"]["documents_read"] == 12 and by_name["bee"]["documents_read"] == 20
    assert by_name["bee"]["tokens_read"] == sum(len(d) for d in docs[12:])
    assert sum(by_name["a"]["length_histogram_read"].values()) == 12


def _variant_tokenizer(tmp_path, name, **specials):
    base = load_tok()
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, **specials)
    tok.save_pretrained(str(tmp_path / name))
    return AutoTokenizer.from_pretrained(str(tmp_path / name))


def test_special_tokens_per_tokenizer(tmp_path):
    no_bos = _variant_tokenizer(tmp_path, "nobos", eos_token="<|eos|>")
    assert resolve_special_tokens(no_bos, add_bos=True, add_eos=True).bos_id is None
    same = _variant_tokenizer(tmp_path, "same", bos_token="<|eos|>", eos_token="<|eos|>")
    s = resolve_special_tokens(same, True, True)
    assert (s.bos_id, s.eos_id) == (None, same.eos_token_id)  # added once, not twice
    tok = load_tok()
    assert resolve_special_tokens(tok, add_bos=False, add_eos=True).bos_id is None
    assert resolve_special_tokens(tok, add_bos=True, add_eos=False).eos_id is None

    # End to end with the BOS-less tokenizer and --no-add-eos: plain concatenation.
    texts = write_text_folder(tmp_path / "a", n=4, length=800, seed=5)
    out = tmp_path / "out"
    prepare_data(PrepareConfig(inputs=[str(tmp_path / "a")], tokenizer=str(tmp_path / "nobos"),
                               output=str(out), seq_length=50, shuffle=False, add_eos=False))
    ids = datasets.load_from_disk(str(out)).with_format("numpy")[:]["input_ids"].ravel()
    flat = [t for d in expected_stream(texts, no_bos, bos=False, eos=False) for t in d]
    np.testing.assert_array_equal(ids, flat[: ids.size])
