"""Tokenization for prepare-data: explicit BOS/EOS, parallel workers, flat numpy batches.

We tokenize with ``add_special_tokens=False`` and add BOS/EOS ourselves, because tokenizers
disagree on what they add (Llama adds BOS, GPT-2 adds nothing, some add both), and a
packed corpus needs one separator convention regardless of the tokenizer.

Two drivers produce the same tokens:
  * :func:`tokenize_dataset` — ``datasets.map`` with ``num_proc`` workers over a
    memory-mapped dataset (the in-memory path; map shows its own progress bar);
  * :func:`tokenize_stream` — a process pool over batches of streamed texts (for corpora
    that should not be converted to Arrow first); ``imap`` keeps the order.
Both hand out batches as ``TokenBatch`` (flat ids + per-document lengths), which packing
consumes without building Python lists per token.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder or a hub name, with a clear error when it is missing."""
    p = Path(name_or_path).expanduser()
    if name_or_path.startswith((".", "/", "~")) and not p.exists():
        raise FileNotFoundError(
            f"tokenizer folder {name_or_path} does not exist; pass --tokenizer a folder with "
            f"tokenizer.json (e.g. from `easy-context train-tokenizer`) or a model name"
        )
    try:
        return AutoTokenizer.from_pretrained(str(p) if p.exists() else name_or_path,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"could not load tokenizer {name_or_path!r} ({type(e).__name__}: {e}); pass "
            f"--tokenizer a local folder with tokenizer.json, or a model name reachable offline"
        ) from e


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids added around each document; None means 'add nothing there'."""

    bos_id: int | None
    eos_id: int | None

    @property
    def count(self) -> int:
        return (self.bos_id is not None) + (self.eos_id is not None)


def resolve_special_tokens(tokenizer: PreTrainedTokenizerBase, add_bos: bool = True,
                           add_eos: bool = True) -> SpecialTokens:
    """Decide which ids to add, per flags and per tokenizer.

    A tokenizer without a BOS (e.g. Qwen) gets none even when asked. When BOS and EOS are the
    same token (GPT-2's <|endoftext|>), adding both would put it twice between documents, so
    it is added once, as EOS: it then both ends one document and separates it from the next.
    """
    bos = tokenizer.bos_token_id if add_bos else None
    eos = tokenizer.eos_token_id if add_eos else None
    if add_bos and bos is None:
        logger.info("tokenizer has no BOS token; documents get no BOS")
    if add_eos and eos is None:
        logger.warning("tokenizer has no EOS token; documents are packed without a separator")
    if bos is not None and bos == eos:
        logger.info("BOS and EOS are the same token (id %d); adding it once, as EOS", bos)
        bos = None
    return SpecialTokens(bos, eos)


@dataclass
class TokenBatch:
    """Tokens of consecutive documents of one source, flattened."""

    tokens: np.ndarray
    """(N,) all ids of the batch's documents, BOS/EOS included, back to back."""
    lengths: np.ndarray
    """(D,) tokens per document, BOS/EOS included; sums to N."""
    index: np.ndarray
    """(D,) each document's index in its source (its row number)."""


class DocumentTokenizer:
    """Picklable callable: texts -> token lists with BOS/EOS. Shared by both drivers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, special: SpecialTokens) -> None:
        self.tokenizer = tokenizer
        self.special = special

    def __call__(self, texts: list[str]) -> list[list[int]]:
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                             verbose=False)["input_ids"]
        bos = [self.special.bos_id] if self.special.bos_id is not None else []
        eos = [self.special.eos_id] if self.special.eos_id is not None else []
        return [bos + x + eos for x in ids]

    def flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens as (flat ids, lengths): cheap to send between processes."""
        ids = self(texts)
        dtype = token_dtype(self.tokenizer)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.concatenate([np.asarray(x, dtype=dtype) for x in ids]) if ids else np.zeros(0, dtype)
        return flat, lengths


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> type:
    """int32 halves the corpus on disk and in memory; int64 only for giant vocabularies."""
    return np.int32 if len(tokenizer) < 2**31 else np.int64


def tokenize_dataset(ds: datasets.Dataset, doc_tok: DocumentTokenizer, num_proc: int = 1,
                     batch_size: int = 256, desc: str = "tokenizing") -> datasets.Dataset:
    """Add ``input_ids`` (with BOS/EOS) to a ``text`` dataset with ``datasets.map``."""
    dtype = "int32" if token_dtype(doc_tok.tokenizer) is np.int32 else "int64"
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype))})

    def fn(batch: dict[str, list]) -> dict[str, list]:
        return {"input_ids": doc_tok([t or "" for t in batch["text"]])}

    return ds.map(fn, batched=True, batch_size=batch_size, remove_columns=ds.column_names,
                  features=features, num_proc=num_proc if num_proc > 1 else None, desc=desc)


def iter_token_batches(tokenized: datasets.Dataset, keep: np.ndarray | None = None,
                       batch_size: int = 1024) -> Iterator[TokenBatch]:
    """Read a tokenized dataset back as flat batches, zero-copy from Arrow.

    ``keep`` (bool per row) selects documents; skipped rows are never materialised.
    """
    table = tokenized.with_format("arrow")
    for start in range(0, len(tokenized), batch_size):
        stop = min(start + batch_size, len(tokenized))
        col = table[start:stop]["input_ids"]
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        # Offsets are relative to the underlying buffer; flatten() already applies the slice.
        offsets = arr.offsets.to_numpy()
        lengths = np.diff(offsets).astype(np.int64)
        tokens = arr.flatten().to_numpy()
        index = np.arange(start, stop)
        if keep is not None:
            rows = keep[start:stop]
            if not rows.any():
                continue
            tokens, lengths, index = tokens[np.repeat(rows, lengths)], lengths[rows], index[rows]
        yield TokenBatch(tokens, lengths, index)


# --- streaming driver ------------------------------------------------------------------

_WORKER: DocumentTokenizer | None = None


def _init_worker(doc_tok: DocumentTokenizer) -> None:
    global _WORKER
    _WORKER = doc_tok


def _work(item: tuple[np.ndarray, list[str]]) -> TokenBatch:
    assert _WORKER is not None
    index, texts = item
    flat, lengths = _WORKER.flat(texts)
    return TokenBatch(flat, lengths, index)


def tokenize_stream(text_batches: Iterable[tuple[np.ndarray, list[str]]],
                    doc_tok: DocumentTokenizer, num_proc: int = 1) -> Iterator[TokenBatch]:
    """Tokenize ``(doc_index, texts)`` batches in ``num_proc`` processes, preserving order."""
    if num_proc <= 1:
        for index, texts in text_batches:
            flat, lengths = doc_tok.flat(texts)
            yield TokenBatch(flat, lengths, index)
        return
    # fork shares the already-loaded tokenizer with the workers; spawn would re-import
    # transformers in each of them (seconds) and is only used where fork does not exist.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=(doc_tok,)) as pool:
        # imap keeps the input order, so the output is identical to num_proc=1.
        yield from pool.imap(_work, text_batches, chunksize=1)
