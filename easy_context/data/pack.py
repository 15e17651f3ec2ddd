"""Pack tokenized documents into fixed windows, keeping the document boundaries.

Documents are laid back to back and cut into windows of ``window = seq_length + 1``
tokens (the extra token is the last target after the one-token shift). Each window carries

  * ``input_ids``    (window,) token ids;
  * ``position_ids`` (window,) position inside the current segment: 0 at every document
    start AND at the start of every window (a document cut by a window boundary continues
    as a fresh segment, so positions never exceed seq_length and RoPE sees only trained
    positions); a consumer recovers the segments as the runs starting at each 0;
  * ``document_ids`` (window,) index of the document in the packed stream, the same on
    both sides of a window boundary, for document masking and for checking a packing;
  * ``labels``       (window,) chat data only: the token where the model learns to produce
    it (assistant turns), -100 elsewhere; aligned with input_ids (the trainer shifts).

The tail that does not fill a window is dropped and counted (``Packer.dropped_tokens``).

Vectorised over whole batches of documents: for the token at global offset g in document
d, position = g - max(start of d, start of g's window).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass
class PackedBatch:
    """Full windows, as 2-D arrays of shape (num_windows, window)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    labels: np.ndarray | None = None
    """Chat data only: input_ids where the model learns to produce the token, else -100."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def to_arrow(self) -> pa.Table:
        """The windows as fixed-size-list columns, zero-copy from numpy.

        Going through Python lists (one per window) cost more than the packing itself.
        """
        window = self.input_ids.shape[1]
        columns = {"input_ids": self.input_ids, "position_ids": self.position_ids,
                   "document_ids": self.document_ids}
        if self.labels is not None:
            columns["labels"] = self.labels
        return pa.table({name: pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), window)
                         for name, arr in columns.items()})


class Packer:
    """Stateful packer: feed batches of documents, get back the windows they complete."""

    def __init__(self, seq_length: int, token_dtype: type = np.int32) -> None:
        if seq_length < 2:
            raise ValueError(f"seq_length must be at least 2 (got {seq_length}); pass a larger --seq-length")
        self.window = seq_length + 1
        self.token_dtype = token_dtype
        self.num_documents = 0  # documents fed so far = next document id
        self.num_tokens = 0  # tokens fed so far = global offset of the next token
        self.num_windows = 0
        # Tokens fed but not yet in a full window (< window of them), with per-token metadata.
        self._tokens = np.zeros(0, dtype=token_dtype)
        self._doc_start = np.zeros(0, dtype=np.int64)
        self._doc_id = np.zeros(0, dtype=np.int64)
        self._labels: np.ndarray | None = None  # chat data: set by the first add with labels

    def add(self, tokens: np.ndarray, lengths: np.ndarray,
            labels: np.ndarray | None = None) -> PackedBatch:
        """Append documents (flat ``tokens``, split by ``lengths``, with optional per-token
        ``labels``); return completed windows."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n, d = int(lengths.sum()), len(lengths)
        starts = self.num_tokens + np.cumsum(lengths) - lengths
        doc_ids = np.arange(self.num_documents, self.num_documents + d, dtype=np.int64)
        self._tokens = np.concatenate([self._tokens, np.asarray(tokens, dtype=self.token_dtype)])
        self._doc_start = np.concatenate([self._doc_start, np.repeat(starts, lengths)])
        self._doc_id = np.concatenate([self._doc_id, np.repeat(doc_ids, lengths)])
        if labels is not None:
            held = self._labels if self._labels is not None else np.zeros(0, self.token_dtype)
            self._labels = np.concatenate([held, np.asarray(labels, dtype=self.token_dtype)])
        self.num_tokens += n
        self.num_documents += d

        k = len(self._tokens) // self.window
        cut = k * self.window
        first = self.num_tokens - len(self._tokens)  # global offset of the buffer's first token
        g = np.arange(first, first + cut, dtype=np.int64)
        window_start = (g // self.window) * self.window
        positions = g - np.maximum(self._doc_start[:cut], window_start)
        out = PackedBatch(
            self._tokens[:cut].reshape(k, self.window),
            positions.astype(np.int32).reshape(k, self.window),
            self._doc_id[:cut].reshape(k, self.window),
            None if self._labels is None else self._labels[:cut].reshape(k, self.window),
        )
        self._tokens, self._doc_start, self._doc_id = (
            self._tokens[cut:], self._doc_start[cut:], self._doc_id[cut:])
        if self._labels is not None:
            self._labels = self._labels[cut:]
        self.num_windows += k
        return out

    @property
    def dropped_tokens(self) -> int:
        """Tokens left over that do not fill a window (dropped when packing ends)."""
        return len(self._tokens)


def save_windows(arrow_file, out, shuffle: bool, seed: int, max_shard_size) -> None:
    """The packed windows' Arrow file (``arrow_file``) saved as the dataset at ``out`` (which
    it replaces), shuffled when ``shuffle``: the permutation depends only on the seed and
    the number of windows. prepare-data's text and image-conversation pipelines both end so."""
    import shutil
    from pathlib import Path

    import datasets

    ds = datasets.Dataset.from_file(str(arrow_file))
    if shuffle:
        ds = ds.shuffle(seed=seed, keep_in_memory=True)
    if Path(out).exists():
        shutil.rmtree(out)
    ds.save_to_disk(str(out), max_shard_size=max_shard_size)
