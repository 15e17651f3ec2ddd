"""Tokenization for prepare-data: explicit BOS/EOS, parallel workers, flat numpy batches.

We tokenize with ``add_special_tokens=False`` and add BOS/EOS ourselves, because tokenizers
disagree on what they add (Llama adds BOS, GPT-2 adds nothing, some add both), and a
packed corpus needs one separator convention regardless of the tokenizer.

Speed: a fast tokenizer is called through its Rust backend's ``encode_batch_fast`` (no
character offsets are computed) and the ids go straight into numpy. That is what
``tokenizer(texts)`` does minus the offsets and the per-document Python dicts, so the ids
are the same (a test compares them with the plain ``datasets.map`` way) at about 1.5x the
speed on one core. :class:`TokenizerPool` spreads batches over ``num_proc`` forked
processes and hands them back in input order; both prepare-data modes use it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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
    if p.is_file():
        raise ValueError(f"--tokenizer {name_or_path} is a file; pass the folder that holds it "
                         f"({p.parent}) or a model name")
    try:
        return AutoTokenizer.from_pretrained(str(p) if p.exists() else name_or_path,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' messages span several lines
        raise FileNotFoundError(
            f"could not load tokenizer {name_or_path!r} ({type(e).__name__}: {reason}); pass "
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
    labels: np.ndarray | None = None
    """(N,) chat data only: the token where the model learns to produce it, else -100."""

    def select(self, rows: np.ndarray) -> TokenBatch:
        """The documents where ``rows`` (bool, (D,)) is true."""
        keep = np.repeat(rows, self.lengths)
        return TokenBatch(self.tokens[keep], self.lengths[rows],
                          None if self.labels is None else self.labels[keep])


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> type:
    """int32 halves the corpus on disk and in memory; int64 only for giant vocabularies."""
    return np.int32 if len(tokenizer) < 2**31 else np.int64


class DocumentTokenizer:
    """Picklable callable: texts -> :class:`TokenBatch` with BOS/EOS. Shared by all drivers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, special: SpecialTokens) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self.dtype = token_dtype(tokenizer)
        self.backend = tokenizer.backend_tokenizer if tokenizer.is_fast else None
        if self.backend is not None:
            # transformers sets these on the backend before every call (to "none" for a plain
            # call); we call the backend directly, so we must not inherit a setting that a
            # tokenizer.json saved or an earlier padded call left behind.
            self.backend.no_truncation()
            self.backend.no_padding()
            self.backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids without BOS/EOS, flat, and the per-document lengths."""
        if self.backend is None:  # a slow (Python) tokenizer: the ordinary call
            ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                                 verbose=False)["input_ids"]
        else:
            ids = [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype,
                           count=int(lengths.sum()))
        return flat, lengths

    def __call__(self, texts: list[str]) -> TokenBatch:
        body, lengths = self.encode(texts)
        bos, eos = self.special.bos_id, self.special.eos_id
        if bos is None and eos is None:
            return TokenBatch(body, lengths)
        lengths = lengths + self.special.count
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=self.dtype)
        is_body = np.ones(len(tokens), dtype=bool)
        if bos is not None:
            tokens[ends - lengths] = bos
            is_body[ends - lengths] = False
        if eos is not None:
            tokens[ends - 1] = eos
            is_body[ends - 1] = False
        tokens[is_body] = body
        return TokenBatch(tokens, lengths)


# --- parallel driver ---------------------------------------------------------------------

_WORKER: Callable[[list], TokenBatch] | None = None


def _init_worker(doc_tok: Callable[[list], TokenBatch]) -> None:
    global _WORKER
    _WORKER = doc_tok


def _work(texts: list) -> TokenBatch:
    assert _WORKER is not None
    return _WORKER(texts)


class TokenizerPool:
    """``num_proc`` tokenizer processes; ``map`` yields results in input order.

    ``doc_tok`` is a :class:`DocumentTokenizer` or a ``chat.ChatTokenizer`` (both map a batch
    of documents to a :class:`TokenBatch` and carry the token ``dtype``).

    At most ``2 * num_proc`` batches are in flight: enough to keep every worker busy while
    the caller packs, and bounded, so a streamed corpus is never read far ahead (a plain
    ``Pool.imap`` reads its whole input as fast as it can).
    """

    def __init__(self, doc_tok: Callable[[list], TokenBatch], num_proc: int = 1) -> None:
        self.doc_tok, self.num_proc = doc_tok, num_proc
        self._pool = None

    def __enter__(self) -> TokenizerPool:
        if self.num_proc > 1:
            # fork shares the already-loaded tokenizer with the workers; spawn would re-import
            # transformers in each of them (seconds) and is only used where fork does not exist.
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            # One Rust thread per process: the processes are the parallelism.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            self._pool = ctx.Pool(self.num_proc, initializer=_init_worker, initargs=(self.doc_tok,))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def map(self, text_batches: Iterable[list]) -> Iterator[TokenBatch]:
        if self._pool is None:
            yield from map(self.doc_tok, text_batches)
            return
        pending: deque = deque()
        for texts in text_batches:
            pending.append(self._pool.apply_async(_work, (texts,)))
            if len(pending) >= 2 * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- spilled tokens, for upsampling ------------------------------------------------------
#
# Upsampling must know every document's length before it emits the first one (the repeat
# rate r depends on the token totals S and L), and then emits the source in several rounds.
# Rather than tokenize the source again for each round, its tokens are written once, back
# to back, to a raw file in prepare-data's work folder (4 bytes per token, about a quarter
# of the text's size) and read back through a memory map: memory stays bounded by one
# batch, whatever the corpus size.


class TokenStore:
    """Append :class:`TokenBatch` es, then read documents back by a keep-mask."""

    def __init__(self, path: str | Path, dtype: type) -> None:
        self.path, self.dtype = Path(path), dtype
        self._files = {"tokens": self.path.open("wb")}
        self._lengths: list[np.ndarray] = []

    def append(self, batch: TokenBatch) -> None:
        if batch.labels is not None and "labels" not in self._files:
            self._files["labels"] = self.path.with_suffix(".labels").open("wb")
        batch.tokens.astype(self.dtype, copy=False).tofile(self._files["tokens"])
        if batch.labels is not None:
            batch.labels.astype(self.dtype, copy=False).tofile(self._files["labels"])
        self._lengths.append(batch.lengths)

    def close(self) -> np.ndarray:
        """Finish writing; return the (D,) lengths of all documents."""
        for f in self._files.values():
            f.close()
        self.lengths = (np.concatenate(self._lengths) if self._lengths
                        else np.zeros(0, dtype=np.int64))
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        return self.lengths

    def _map(self, name: str) -> np.ndarray:
        # An empty file cannot be memory-mapped (documents may all be empty without BOS/EOS).
        if not self.offsets[-1]:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self._files[name].name, dtype=self.dtype, mode="r")

    def read(self, keep: np.ndarray, max_tokens: int = 1 << 22) -> Iterator[TokenBatch]:
        """The documents where ``keep`` is true, in order, in batches of about ``max_tokens``."""
        arrays = {name: self._map(name) for name in self._files}
        n, start = len(self.lengths), 0
        while start < n:
            # Whole documents up to max_tokens (at least one, however long).
            stop = max(int(np.searchsorted(self.offsets, self.offsets[start] + max_tokens,
                                           side="right")) - 1, start + 1)
            stop = min(stop, n)
            rows = keep[start:stop]
            if rows.any():
                span = slice(self.offsets[start], self.offsets[stop])
                batch = TokenBatch(np.asarray(arrays["tokens"][span]), self.lengths[start:stop],
                                   np.asarray(arrays["labels"][span]) if "labels" in arrays else None)
                yield batch.select(rows)
            start = stop

    def remove(self) -> None:
        for f in self._files.values():
            Path(f.name).unlink()
