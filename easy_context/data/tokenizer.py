"""Train a small byte-level BPE tokenizer and save it as a Hugging Face tokenizer folder.

Used for offline work (no model hub): tests and demos train a tokenizer on synthetic text
in a second or two, save it, and then load it through the ordinary
``AutoTokenizer.from_pretrained(folder)`` path, exactly as a real tokenizer would be.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .checks import json_records, read_utf8

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    output_dir: str | Path | None = None,
    min_frequency: int = 2,
    bos_token: str = BOS_TOKEN,
    eos_token: str = EOS_TOKEN,
    pad_token: str = PAD_TOKEN,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; save to ``output_dir`` when given.

    Byte-level means every string is encodable (the 256 byte symbols are always in the
    vocabulary), so a tokenizer trained on synthetic English still round-trips any input.
    The special tokens get ids 0, 1, 2 (bos, eos, pad). No post-processor is attached: the
    tokenizer never adds BOS/EOS by itself, and prepare-data adds them explicitly.
    """
    check_vocab_size(vocab_size)
    chars = 0

    def counted(texts: Iterable[str]) -> Iterator[str]:
        nonlocal chars
        for t in texts:
            chars += len(t)
            yield t

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[bos_token, eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(counted(texts), trainer=trainer)
    if chars == 0:
        raise ValueError("the tokenizer training inputs hold no text; give files with some text")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token
    )
    logger.info("trained byte-level BPE with %d tokens", len(hf_tok))
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(output_dir))
        logger.info("saved tokenizer to %s", output_dir)
    return hf_tok


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < 256 + 3:
        raise ValueError(f"--vocab-size must be at least 259 (256 byte symbols + 3 special "
                         f"tokens), got {vocab_size}")


def list_text_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files to train on: each path, or the files under each folder (sorted, hidden
    files left out); a missing path or no non-empty file is an error."""
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"tokenizer training input {p} does not exist; pass existing "
                                    f"files or folders to --input")
        files += (sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
                  if p.is_dir() else [p])
    if not any(f.stat().st_size for f in files):
        raise ValueError(f"tokenizer training inputs {[str(p) for p in paths]} hold no non-empty "
                         f"file; give files with some text")
    return files


def _parquet_texts(f: Path, text_column: str) -> list[str]:
    try:
        names = pq.read_schema(f).names
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{f} is not a readable parquet file ({e}); replace it or leave it out") from e
    if text_column not in names:
        raise ValueError(f"{f} has no column {text_column!r} (columns: {names}); pass "
                         f"--text-column with one of them")
    return [t for t in pq.read_table(f, columns=[text_column])[text_column].to_pylist() if t]


def iter_text_files(paths: Iterable[str | Path], text_column: str = "text") -> Iterator[str]:
    """Yield texts from files, recursing into folders (sorted, for determinism).

    A ``.jsonl``/``.json`` file gives the ``text_column`` of each record (so the output of
    ``synth-data`` trains a tokenizer directly), a ``.parquet`` file that column of each
    row; any other file is one text. Files must be UTF-8; errors name the file and line.
    """
    for f in list_text_files(paths):
        if f.name.endswith((".jsonl", ".json")):
            records = found = 0
            for record in json_records(f, text_column):
                records += 1
                if record.get(text_column):
                    found += 1
                    yield record[text_column]
            if records and not found:
                raise ValueError(f"{f}: no record has a {text_column!r} field with text; pass "
                                 f"--text-column naming the text field")
        elif f.suffix == ".parquet":
            yield from _parquet_texts(f, text_column)
        else:
            yield read_utf8(f)
