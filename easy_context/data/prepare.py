"""prepare-data: raw inputs -> tokenized, filtered, upsampled, packed Arrow dataset + stats.json.

Pipeline, per source in input order:
  1. read documents (:mod:`sources`), in memory-mapped or streaming mode;
  2. tokenize with explicit BOS/EOS (:mod:`tokenize`), ``num_proc`` worker processes, in order;
  3. plan how many copies of each document to emit (:mod:`upsample`): min-length filter
     and optional per-source length upsampling;
  4. emit in rounds: round k emits, in source order, every document with more than k
     copies, so the repeats of an upsampled document are a whole pass apart rather than
     adjacent (adjacent repeats would teach copying, not long-range modelling);
then all sources go through one :class:`pack.Packer`, whose windows are written as Arrow
record batches straight from numpy (never all in RAM, never as Python lists), optionally
shuffled by window, and saved with ``save_to_disk``.

Without upsampling every source is read and tokenized once, packed as it streams by. With
upsampling the lengths must be known before the first document is emitted (S and L fix the
repeat rate), so a source's tokens are spilled once to a flat file (``TokenStore``) and the
rounds are read back from it. Streaming and in-memory modes differ only in how text is read
(lazily, or from ``datasets``' memory-mapped Arrow copy); the rest is shared code, so they
give identical datasets (a test checks it).

Chat data (``chat=True``) differs only in step 2: each record is a conversation rendered
with the chat template (:mod:`chat`), and the windows get a ``labels`` column (the token
on assistant turns, -100 elsewhere) packed alongside the ids.

Temporary files (spilled tokens, unshuffled windows) go to a hidden work folder beside the
output, on the disk that must hold the output anyway.
"""

from __future__ import annotations

import dataclasses
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
from datasets.arrow_writer import ArrowWriter
from ..utils.progress import progress_bar

from .pack import Packer, save_windows
from .chat import IGNORE_INDEX, ChatColumns, ChatTokenizer, load_chat_template, to_conversation
from .sources import (SourceSpec, iter_document_batches, iter_text_batches, load_source,
                      open_source, parse_source)
from .tokenize import (DocumentTokenizer, SpecialTokens, TokenBatch, TokenizerPool, TokenStore,
                       load_tokenizer, resolve_special_tokens)
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
    """Documents per tokenization batch (at most)."""
    batch_chars: int = 1 << 20
    """Characters per tokenization batch (at most, unless one document is longer): about a
    quarter second of work, so that a corpus of few huge documents still keeps every worker busy."""
    max_shard_size: str = "500MB"
    """Arrow shard size of the saved dataset."""
    chat: bool = False
    """Records are conversations, rendered with the chat template; adds a ``labels`` column
    that trains on the assistant turns only (:mod:`chat`). Implied by ``prompt_column``."""
    messages_column: str = "messages"
    """Chat data: column holding a list of {"role", "content"} messages."""
    prompt_column: str | None = None
    """Chat data: column of single-turn prompts (with ``response_column``), instead of messages."""
    response_column: str | None = None
    """Chat data: column of the responses to ``prompt_column``."""
    chat_template: str | None = None
    """Chat data: a Jinja chat template file, for a tokenizer without one or to replace it."""
    processor: str | None = None
    """Image conversations: the local folder of a vision-language model's processor
    (AutoProcessor, no remote code), which expands each image into its placeholder tokens;
    records are conversations in ``messages_column`` with their images in ``images_column``
    (:mod:`vision`). Implies chat data; ``tokenizer`` is then the processor's."""
    images_column: str = "images"
    """Image conversations: column holding each record's images (file paths, relative to the
    input file's folder, or a datasets image column), one per image part, in order."""

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"seq_length must be at least 2 (got {self.seq_length}); pass a larger --seq-length")
        if not self.inputs:
            raise ValueError("no inputs given; pass at least one file, folder or dataset")
        for flag, value, least in (("--min-length", self.min_length, 0), ("--num-proc", self.num_proc, 1),
                                   ("--seed", self.seed, 0), ("--max-documents", self.max_documents, 1),
                                   ("batch_size", self.batch_size, 1), ("batch_chars", self.batch_chars, 1)):
            if value is not None and value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if not self.text_column:
            raise ValueError("--text-column is empty; name the column that holds the text")
        if (self.prompt_column is None) != (self.response_column is None):
            raise ValueError("--prompt-column and --response-column go together; pass both, or "
                             "neither to read --messages-column")
        self.chat = self.chat or self.prompt_column is not None or self.processor is not None
        if self.processor is not None:
            # what the text path does and this one does not (yet)
            unsupported = [flag for flag, on in (
                ("--prompt-column/--response-column", self.prompt_column is not None),
                ("--upsample-threshold", self.upsample.threshold is not None),
                ("--streaming", self.streaming), ("--num-proc above 1", self.num_proc > 1),
                ("--min-length", self.min_length > 0)) if on]
            if unsupported:
                raise ValueError(f"{unsupported[0]} does not apply to image conversations "
                                 "(--processor) yet; drop it")
            if not self.images_column:
                raise ValueError("--images-column is empty; name the column of the images")
        if self.chat_template is not None and not self.chat:
            raise ValueError("--chat-template applies to chat data; add --chat (or "
                             "--prompt-column/--response-column), or drop --chat-template")


def _emit(index: int, source: SourceSpec, ds: datasets.Dataset | datasets.IterableDataset,
          cfg: PrepareConfig, pool: TokenizerPool, work: Path, stats_out: list[dict]
          ) -> Iterator[TokenBatch]:
    """Yield the source's documents to pack, with repeats; append its stats to ``stats_out``."""
    if cfg.chat:
        cols = ChatColumns(cfg.messages_column, cfg.prompt_column, cfg.response_column)
        texts = iter_document_batches(ds, source, lambda r, where: to_conversation(r, cols, where),
                                      cfg.batch_size, cfg.batch_chars)
    else:
        texts = iter_text_batches(ds, source, cfg.text_column, cfg.batch_size, cfg.batch_chars)
    if cfg.upsample.threshold is None:
        # One pass: filter on the fly, no need to know the lengths up front.
        seen: list[np.ndarray] = []
        for batch in pool.map(texts):
            seen.append(batch.lengths)
            yield batch.select(batch.lengths >= cfg.min_length)
        lengths = np.concatenate(seen) if seen else np.zeros(0, np.int64)
        copies = (lengths >= cfg.min_length).astype(np.int64)
    else:
        store = TokenStore(work / f"source{index}.tokens", pool.doc_tok.dtype)
        for batch in pool.map(texts):
            store.append(batch)
        lengths = store.close()
        copies = plan_copies(lengths, cfg.upsample, cfg.min_length, cfg.seed, index)
        for k in range(int(copies.max()) if len(copies) else 0):
            yield from store.read(copies > k)
        store.remove()
    stats = source_stats(source.name, source.path, lengths, copies)
    if stats["documents_read"] == 0:
        raise ValueError(f"input {source.path} has no documents; check the file or --max-documents")
    if stats["documents_emitted"] == 0:
        raise ValueError(
            f"input {source.path}: all {stats['documents_read']} documents are shorter than "
            f"--min-length {cfg.min_length} tokens; lower --min-length"
        )
    stats_out.append(stats)


def _check_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file; pass --output-dir a folder path (new, or an "
                         f"earlier prepare-data output)")
    if out.exists() and any(out.iterdir()) and not (out / "prepare_config.json").exists():
        raise ValueError(f"output folder {out} exists and is not a prepare-data output; "
                         f"pass a new --output-dir (we overwrite only our own outputs)")


def _open(spec: SourceSpec, cfg: PrepareConfig) -> datasets.Dataset | datasets.IterableDataset:
    if not cfg.chat:
        return load_source(spec, cfg.text_column, cfg.streaming, cfg.max_documents)
    if spec.kind == "text":
        raise ValueError(f"input {spec.path} is plain text; chat data needs .jsonl/.parquet or "
                         f"dataset inputs with a conversation per record")
    cols = ChatColumns(cfg.messages_column, cfg.prompt_column, cfg.response_column)
    flag = "--prompt-column/--response-column" if cfg.prompt_column else "--messages-column"
    return open_source(spec, cols.columns, flag, cfg.streaming, cfg.max_documents)


def prepare_data(cfg: PrepareConfig) -> dict:
    """Run the pipeline; return the stats written to ``<output>/stats.json``."""
    _check_output(Path(cfg.output).expanduser())
    if cfg.processor is not None:
        from .vision import prepare_vision_data

        return prepare_vision_data(cfg)
    t0 = time.perf_counter()
    out = Path(cfg.output).expanduser()
    specs = [parse_source(s) for s in cfg.inputs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}; name inputs as name=path")
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    if cfg.chat:
        # The template writes BOS and the end-of-turn tokens itself.
        special = SpecialTokens(None, None)
        doc_tok: DocumentTokenizer | ChatTokenizer = ChatTokenizer(
            tokenizer, load_chat_template(tokenizer, cfg.chat_template))
        logger.info("chat data: assistant tokens found by %s", doc_tok.method)
    else:
        special = resolve_special_tokens(tokenizer, cfg.add_bos, cfg.add_eos)
        doc_tok = DocumentTokenizer(tokenizer, special)
    packer = Packer(cfg.seq_length, doc_tok.dtype)
    per_source: list[dict] = []
    # Opening every source first surfaces input errors such as a missing column before any
    # work is done.
    opened = []
    for spec in specs:
        logger.info("source %s: %s (%s)", spec.name, spec.path, spec.kind)
        opened.append(_open(spec, cfg))

    W = cfg.seq_length + 1
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value(np.dtype(doc_tok.dtype).name), length=W),
        "position_ids": datasets.Sequence(datasets.Value("int32"), length=W),
        "document_ids": datasets.Sequence(datasets.Value("int64"), length=W),
    })
    if cfg.chat:
        features["labels"] = features["input_ids"]
    label_tokens = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with (ArrowWriter(features=features, path=str(work / "windows.arrow")) as writer,
              TokenizerPool(doc_tok, cfg.num_proc) as pool):
            # made after the pool forks its workers, so that none of them holds a copy of it;
            # closed on an error too (an open bar prints itself again when the process exits)
            with progress_bar(desc="packing", unit="tok", unit_scale=True) as bar:
                for i, (spec, ds) in enumerate(zip(specs, opened)):
                    for batch in _emit(i, spec, ds, cfg, pool, work, per_source):
                        bar.update(int(batch.lengths.sum()))
                        windows = packer.add(batch.tokens, batch.lengths, batch.labels)
                        if len(windows):
                            writer.write_table(windows.to_arrow())
                            if windows.labels is not None:
                                label_tokens += int((windows.labels != IGNORE_INDEX).sum())
            writer.finalize()
        if packer.num_windows == 0:
            raise ValueError(
                f"the inputs hold {packer.num_tokens} tokens, fewer than one window of "
                f"{W}; lower --seq-length or add data")
        save_windows(work / "windows.arrow", out, cfg.shuffle, cfg.seed, cfg.max_shard_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)

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
        **({"chat_mask_method": doc_tok.method, "label_tokens_in_windows": label_tokens}
           if cfg.chat else {}),
        "seconds": round(time.perf_counter() - t0, 3),
        "sources": per_source,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    (out / "prepare_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
    logger.info("wrote %d windows of %d tokens (%d documents) to %s", packer.num_windows, W,
                packer.num_documents, out)
    return stats
