"""Per-source length upsampling (Fu et al. 2024, "Data Engineering for Scaling Language
Models to 128K Context"), the minimum-length filter, and per-source statistics.

Fu et al. find that continued pretraining for long context works best when the mixture of
*sources* stays as in pretraining, while *within* each source long documents are
upsampled. We implement that as: inside a source, a document shorter than ``threshold``
tokens is kept with probability ``keep_prob``; every long document is repeated ``r`` times
on average, with ``r`` chosen so the source's expected token count is unchanged:

    S = tokens in short docs, L = tokens in long docs
    p * S + r * L = S + L   =>   r = 1 + (1 - p) * S / L

Integer copies: floor(r), plus one more with probability frac(r). Then each source's token
count, and so its share of the mixture, is preserved in expectation (the tests check it
within a stated tolerance), while the fraction of tokens in long documents rises.

The decision for each document is one uniform draw, taken in document order from a
generator seeded by (seed, source index): the same plan results from any batching, and
in streaming and in-memory modes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UpsampleConfig:
    """Length upsampling within each source; disabled when ``threshold`` is None."""

    threshold: int | None = None
    """Documents with fewer tokens than this are 'short' (Fu et al. use 4K-32K)."""
    keep_prob: float = 0.3
    """Probability of keeping a short document."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.keep_prob <= 1.0:
            raise ValueError(f"--upsample-keep-prob must be in [0, 1], got {self.keep_prob}")
        if self.threshold is not None and self.threshold < 1:
            raise ValueError(f"--upsample-threshold must be at least 1 token, got {self.threshold}")


def plan_copies(lengths: np.ndarray, cfg: UpsampleConfig, min_length: int = 0,
                seed: int = 0, source_index: int = 0) -> np.ndarray:
    """Number of times each document goes into the packed stream (0 = dropped).

    ``lengths`` are token counts of the documents (BOS/EOS included), in source order.
    Documents shorter than ``min_length`` are dropped before upsampling, so the share that
    is preserved is that of the filtered source.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    eligible = lengths >= min_length
    if cfg.threshold is None:
        return eligible.astype(np.int64)
    rng = np.random.default_rng([seed, source_index])
    u = rng.random(len(lengths))  # one draw per document, filtered or not: stable indexing
    short = eligible & (lengths < cfg.threshold)
    long = eligible & ~short
    s_tok, l_tok = int(lengths[short].sum()), int(lengths[long].sum())
    copies = np.zeros(len(lengths), dtype=np.int64)
    if l_tok == 0:
        # Nothing to upsample: dropping short documents would only shrink the source.
        copies[short] = 1
        return copies
    r = 1.0 + (1.0 - cfg.keep_prob) * s_tok / l_tok
    copies[short] = (u[short] < cfg.keep_prob).astype(np.int64)
    base, frac = int(np.floor(r)), r - np.floor(r)
    copies[long] = base + (u[long] < frac).astype(np.int64)
    return copies


def length_histogram(lengths: np.ndarray, weights: np.ndarray | None = None) -> dict[str, int]:
    """Document counts in power-of-two token-length bins: {'0-1': n, '2-3': n, '4-7': n, ...}."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {}
    bins = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(bins, weights=weights, minlength=int(bins.max()) + 1)
    out = {}
    for b, c in enumerate(counts):
        if c:
            lo, hi = (0, 1) if b == 0 else (2**b, 2 ** (b + 1) - 1)
            out[f"{lo}-{hi}"] = int(c)
    return out


def source_stats(name: str, path: str, lengths: np.ndarray, copies: np.ndarray) -> dict:
    """Documents, tokens and length histograms of one source, before and after sampling."""
    lengths = np.asarray(lengths, dtype=np.int64)
    copies = np.asarray(copies, dtype=np.int64)
    return {
        "name": name,
        "path": path,
        "documents_read": int(len(lengths)),
        "documents_kept": int((copies > 0).sum()),
        "documents_emitted": int(copies.sum()),
        "tokens_read": int(lengths.sum()),
        "tokens_emitted": int((lengths * copies).sum()),
        "max_copies": int(copies.max()) if len(copies) else 0,
        "length_histogram_read": length_histogram(lengths),
        "length_histogram_emitted": length_histogram(lengths, weights=copies),
    }
