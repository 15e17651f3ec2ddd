"""A source's tokenized documents spilled to one flat file, for upsampling.

Upsampling must know every document's length before it emits the first one (the repeat
rate r depends on the token totals S and L), and then emits the source in several rounds.
Rather than tokenize the source again for each round, its tokens are written once, back to
back, to a raw file in prepare-data's work folder (4 bytes per token, about a quarter of
the text's size) and read back through a memory map: memory stays bounded by one batch,
whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .tokenize import TokenBatch


class TokenStore:
    """Append :class:`TokenBatch` es, then read documents back by a keep-mask."""

    def __init__(self, path: str | Path, dtype: type) -> None:
        self.path, self.dtype = Path(path), dtype
        self._file = self.path.open("wb")
        self._lengths: list[np.ndarray] = []

    def append(self, batch: TokenBatch) -> None:
        batch.tokens.astype(self.dtype, copy=False).tofile(self._file)
        self._lengths.append(batch.lengths)

    def close(self) -> np.ndarray:
        """Finish writing; return the (D,) lengths of all documents."""
        self._file.close()
        self.lengths = (np.concatenate(self._lengths) if self._lengths
                        else np.zeros(0, dtype=np.int64))
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        return self.lengths

    def read(self, keep: np.ndarray, max_tokens: int = 1 << 22) -> Iterator[TokenBatch]:
        """The documents where ``keep`` is true, in order, in batches of about ``max_tokens``."""
        # An empty file cannot be memory-mapped (documents may all be empty without BOS/EOS).
        tokens = (np.memmap(self.path, dtype=self.dtype, mode="r") if self.offsets[-1]
                  else np.zeros(0, dtype=self.dtype))
        n, start = len(self.lengths), 0
        while start < n:
            # Whole documents up to max_tokens (at least one, however long).
            stop = max(int(np.searchsorted(self.offsets, self.offsets[start] + max_tokens,
                                           side="right")) - 1, start + 1)
            stop = min(stop, n)
            rows = keep[start:stop]
            if rows.any():
                lengths = self.lengths[start:stop]
                span = np.asarray(tokens[self.offsets[start]:self.offsets[stop]])
                yield TokenBatch(span[np.repeat(rows, lengths)], lengths[rows])
            start = stop
        del tokens
