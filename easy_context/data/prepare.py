"""prepare-data: raw inputs -> tokenized, filtered, upsampled, packed Arrow dataset + stats.json.

Pipeline, per source in input order:
  1. read documents (:mod:`sources`), in memory-mapped or streaming mode;
  2. tokenize with explicit BOS/EOS (:mod:`tokenize`), ``num_proc`` workers;
  3. plan how many copies of each document to emit (:mod:`upsample`): min-length filter
     and optional per-source length upsampling;
  4. emit in rounds: round k emits, in source order, every document with more than k
     copies, so the repeats of an upsampled document are a whole pass apart rather than
     adjacent (adjacent repeats would teach copying, not long-range modelling);
then all sources go through one :class:`pack.Packer`, windows are written incrementally
with ``Dataset.from_generator`` (never all in RAM), optionally shuffled by window, and saved
with ``save_to_disk``.

Streaming reads each source once per round, plus once to measure lengths when upsampling
needs them (S and L must be known before the first document is emitted); in exchange, no
Arrow copy of the raw corpus is made and memory stays bounded. The plan and the packing are
shared code, so streaming and in-memory give identical datasets (a test checks it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
from tqdm.auto import tqdm

from .pack import Packer
from .sources import SourceSpec, iter_texts, load_source, parse_source
from .tokenize import (DocumentTokenizer, TokenBatch, iter_token_batches, load_tokenizer,
                       resolve_special_tokens, token_dtype, tokenize_dataset, tokenize_stream)
from .upsample import UpsampleConfig, plan_copies, source_stats

logger = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    """Everything prepare-data needs; saved as ``prepare_config.json`` next to the output."""

    inputs: list[str]
    """Files, folders, saved datasets or dataset names, each optionally as name=path."""
    tokenizer: str
    """Tokenizer folder or name (AutoTokenizer)."""
    output: str
    """Folder for save_to_disk; stats.json and prepare_config.json are written into it."""
    seq_length: int = 8192
    """Training sequence length; windows hold seq_length + 1 tokens (shifted targets)."""
    text_column: str = "text"
    """Column holding the text in jsonl/parquet/datasets inputs."""
    add_bos: bool = True
    """Prepend the tokenizer's BOS to each document (skipped if it has none)."""
    add_eos: bool = True
    """Append the tokenizer's EOS to each document."""
    min_length: int = 0
    """Drop documents with fewer tokens than this (BOS/EOS included)."""
    upsample: UpsampleConfig = field(default_factory=UpsampleConfig)
    """Per-source length upsampling (off unless a threshold is set)."""
    num_proc: int = 1
    """Tokenizer worker processes."""
    streaming: bool = False
    """Read inputs lazily (corpora larger than RAM); same result as in-memory."""
    shuffle: bool = True
    """Shuffle the packed windows (by seed), so sources are mixed across training steps."""
    seed: int = 0
    trust_remote_code: bool = False
    """Allow custom tokenizer code from the hub (off by default: it executes remote code)."""
    max_documents: int | None = None
    """Read at most this many documents per source (for quick trials)."""
    batch_size: int = 256
    """Documents per tokenization batch."""
    max_shard_size: str = "500MB"
    """Arrow shard size of the saved dataset."""

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"seq_length must be at least 2 (got {self.seq_length}); pass a larger --seq-length")
        if not self.inputs:
            raise ValueError("no inputs given; pass at least one file, folder or dataset")
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        if self.num_proc < 1:
            raise ValueError(f"num_proc must be >= 1, got {self.num_proc}")


class _Source:
    """One source's tokenized documents, readable in rounds by a keep-mask."""

    def __init__(self, spec: SourceSpec, cfg: PrepareConfig, doc_tok: DocumentTokenizer) -> None:
        self.spec, self.cfg, self.doc_tok = spec, cfg, doc_tok
        self.ds = load_source(spec, cfg.text_column, cfg.streaming, cfg.max_documents)
        self.tokenized: datasets.Dataset | None = None
        if not cfg.streaming:
            self.tokenized = tokenize_dataset(self.ds, doc_tok, cfg.num_proc, cfg.batch_size,
                                              desc=f"tokenizing {spec.name}")

    def lengths(self) -> np.ndarray:
        if self.tokenized is not None:
            # Chunk by chunk: only the offsets are read, never the memory-mapped tokens.
            chunks = self.tokenized.data.column("input_ids").chunks
            return np.concatenate([c.value_lengths().to_numpy(zero_copy_only=False) for c in chunks]
                                  or [np.zeros(0)]).astype(np.int64)
        return np.concatenate([b.lengths for b in self.batches(None)] or [np.zeros(0, np.int64)])

    def batches(self, keep: np.ndarray | None) -> Iterator[TokenBatch]:
        if self.tokenized is not None:
            yield from iter_token_batches(self.tokenized, keep, self.cfg.batch_size)
            return

        def texts() -> Iterator[tuple[np.ndarray, list[str]]]:
            start = 0
            for texts in iter_texts(self.ds, self.cfg.batch_size):
                index = np.arange(start, start + len(texts))
                start += len(texts)
                if keep is not None:
                    rows = keep[index]
                    index, texts = index[rows], [t for t, k in zip(texts, rows) if k]
                if len(index):
                    yield index, texts

        yield from tokenize_stream(texts(), self.doc_tok, self.cfg.num_proc)


def _emit(source: _Source, index: int, cfg: PrepareConfig, stats_out: list[dict]
          ) -> Iterator[TokenBatch]:
    """Yield the source's documents to pack, with repeats; append its stats to ``stats_out``."""
    needs_plan = cfg.upsample.threshold is not None or not cfg.streaming
    lengths = source.lengths() if needs_plan else None
    copies = (plan_copies(lengths, cfg.upsample, cfg.min_length, cfg.seed, index)
              if lengths is not None else None)
    seen: list[np.ndarray] = []
    rounds = int(copies.max()) if copies is not None and len(copies) else 1
    for k in range(rounds):
        keep = copies > k if copies is not None else None
        for batch in source.batches(keep):
            if copies is None:  # streaming without upsampling: filter on the fly
                seen.append(batch.lengths)
                rows = batch.lengths >= cfg.min_length
                batch = TokenBatch(batch.tokens[np.repeat(rows, batch.lengths)],
                                   batch.lengths[rows], batch.index[rows])
            yield batch
    if copies is None:
        lengths = np.concatenate(seen) if seen else np.zeros(0, np.int64)
        copies = (lengths >= cfg.min_length).astype(np.int64)
    stats = source_stats(source.spec.name, source.spec.path, lengths, copies)
    if stats["documents_read"] == 0:
        raise ValueError(f"input {source.spec.path} has no documents; check the file or --max-documents")
    if stats["documents_emitted"] == 0:
        raise ValueError(
            f"input {source.spec.path}: all {stats['documents_read']} documents are shorter than "
            f"--min-length {cfg.min_length} tokens; lower --min-length"
        )
    stats_out.append(stats)


def _fingerprint(cfg: PrepareConfig) -> str:
    blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_data(cfg: PrepareConfig) -> dict:
    """Run the pipeline; return the stats written to ``<output>/stats.json``."""
    t0 = time.perf_counter()
    specs = [parse_source(s) for s in cfg.inputs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}; name inputs as name=path")
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    special = resolve_special_tokens(tokenizer, cfg.add_bos, cfg.add_eos)
    doc_tok = DocumentTokenizer(tokenizer, special)
    dtype = token_dtype(tokenizer)
    packer = Packer(cfg.seq_length, dtype)
    per_source: list[dict] = []
    out = Path(cfg.output)
    if out.exists() and any(out.iterdir()) and not (out / "prepare_config.json").exists():
        raise ValueError(f"output folder {out} exists and is not a prepare-data output; "
                         f"pass a new --output (we overwrite only our own outputs)")
    # Opening (and, in memory, tokenizing) every source first surfaces input errors such as
    # a missing column before any output is written.
    sources = []
    for spec in specs:
        logger.info("source %s: %s (%s)", spec.name, spec.path, spec.kind)
        sources.append(_Source(spec, cfg, doc_tok))

    def windows() -> Iterator[dict[str, list[int]]]:
        bar = tqdm(desc="packing", unit="tok", unit_scale=True)
        for i, source in enumerate(sources):
            for batch in _emit(source, i, cfg, per_source):
                bar.update(int(batch.lengths.sum()))
                yield from packer.add(batch.tokens, batch.lengths).rows()
        bar.close()

    W = cfg.seq_length + 1
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32" if dtype is np.int32 else "int64"), length=W),
        "position_ids": datasets.Sequence(datasets.Value("int32"), length=W),
        "document_ids": datasets.Sequence(datasets.Value("int64"), length=W),
    })
    tmp = Path(tempfile.mkdtemp(prefix="ec_prepare_"))
    try:
        # An explicit fingerprint: datasets would otherwise hash the generator's closure.
        try:
            ds = datasets.Dataset.from_generator(windows, features=features, cache_dir=str(tmp),
                                                 fingerprint=_fingerprint(cfg))
        except datasets.exceptions.DatasetGenerationError as e:
            # Our own input errors raised inside the generator: re-raise them unwrapped.
            if isinstance(e.__cause__, (ValueError, FileNotFoundError)):
                raise e.__cause__ from None
            raise
        except ValueError:
            if packer.num_windows > 0:
                raise
            # datasets refuses an empty split; say why it is empty.
            raise ValueError(
                f"the inputs hold {packer.num_tokens} tokens, fewer than one window of "
                f"{W}; lower --seq-length or add data"
            ) from None
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        if out.exists():
            shutil.rmtree(out)
        ds.save_to_disk(str(out), max_shard_size=cfg.max_shard_size)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    total = sum(s["tokens_emitted"] for s in per_source)
    for s in per_source:
        s["token_share_read"] = s["tokens_read"] / max(sum(x["tokens_read"] for x in per_source), 1)
        s["token_share_emitted"] = s["tokens_emitted"] / max(total, 1)
    stats = {
        "seq_length": cfg.seq_length,
        "window": W,
        "windows": packer.num_windows,
        "documents": packer.num_documents,
        "tokens": packer.num_tokens,
        "tokens_in_windows": packer.num_windows * W,
        "dropped_tail_tokens": packer.dropped_tokens,
        "bos_token_id": special.bos_id,
        "eos_token_id": special.eos_id,
        "seconds": round(time.perf_counter() - t0, 3),
        "sources": per_source,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    (out / "prepare_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
    logger.info("wrote %d windows of %d tokens (%d documents) to %s", packer.num_windows, W,
                packer.num_documents, out)
    return stats
