"""The tokenizer driver: BOS/EOS placement, order and bounded read-ahead of the pool, spill store."""

from __future__ import annotations

import numpy as np

from easy_context.data.tokenize import (DocumentTokenizer, SpecialTokens, TokenBatch,
                                        TokenizerPool, TokenStore, resolve_special_tokens)
from tests.unit.data_fixtures import expected_stream, load_tok


def test_document_tokenizer_matches_the_tokenizer_call():
    tok = load_tok()
    texts = ["The quiet river.", "", "a literal <|bos|> token", "ünïcödé ✓"]
    for bos, eos in [(True, True), (False, True), (True, False), (False, False)]:
        special = resolve_special_tokens(tok, bos, eos)
        batch = DocumentTokenizer(tok, special)(texts)
        ref = expected_stream(texts, tok, bos, eos)
        np.testing.assert_array_equal(batch.lengths, [len(d) for d in ref])
        np.testing.assert_array_equal(batch.tokens, [t for d in ref for t in d])
        assert batch.tokens.dtype == np.int32


def test_pool_keeps_order_and_reads_ahead_boundedly():
    tok = load_tok()
    doc_tok = DocumentTokenizer(tok, SpecialTokens(None, tok.eos_token_id))
    batches = [[f"document {i} of batch {b}" for i in range(b % 3 + 1)] for b in range(40)]
    produced = []

    def source():
        for b in batches:
            produced.append(b)
            yield b

    with TokenizerPool(doc_tok, num_proc=2) as pool:
        results = pool.map(source())
        first = next(results)
        # A plain Pool.imap would have drained the whole input by now.
        assert len(produced) <= 2 * 2 + 1
        rest = list(results)
    for b, got in zip(batches, [first] + rest):
        ref = doc_tok(b)
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        np.testing.assert_array_equal(got.lengths, ref.lengths)


def test_store_reads_back_kept_documents_in_order(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=int(n)).astype(np.int32) for n in rng.integers(0, 50, 200)]
    store = TokenStore(tmp_path / "t.bin", np.int32)
    for lo in range(0, 200, 33):
        chunk = docs[lo:lo + 33]
        store.append(TokenBatch(np.concatenate(chunk), np.array([len(d) for d in chunk])))
    np.testing.assert_array_equal(store.close(), [len(d) for d in docs])
    keep = rng.random(200) < 0.4
    # A tiny max_tokens forces many read batches, including single over-long documents.
    got = list(store.read(keep, max_tokens=20))
    assert len(got) > 10
    np.testing.assert_array_equal(np.concatenate([b.lengths for b in got]),
                                  [len(d) for d, k in zip(docs, keep) if k])
    np.testing.assert_array_equal(np.concatenate([b.tokens for b in got]),
                                  np.concatenate([d for d, k in zip(docs, keep) if k]))
