"""Train a small byte-level BPE tokenizer and save it as a Hugging Face tokenizer folder.

Used for offline work (no model hub): tests and demos train a tokenizer on synthetic text
in a second or two, save it, and then load it through the ordinary
``AutoTokenizer.from_pretrained(folder)`` path, exactly as a real tokenizer would be.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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
    if vocab_size < 256 + 3:
        raise ValueError(f"vocab_size must be at least 259 (256 bytes + 3 specials), got {vocab_size}")
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
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token
    )
    logger.info("trained byte-level BPE with %d tokens", len(hf_tok))
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(output_dir))
        logger.info("saved tokenizer to %s", output_dir)
    return hf_tok


def iter_text_files(paths: Iterable[str | Path], text_column: str = "text") -> Iterable[str]:
    """Yield texts from files, recursing into folders (sorted, for determinism).

    A ``.jsonl`` file gives the ``text_column`` of each line (so the output of
    ``synth-data`` trains a tokenizer directly); any other file is one text.
    """
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"tokenizer training input {p} does not exist; pass existing files")
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            if f.suffix == ".jsonl":
                with f.open(encoding="utf-8") as fh:
                    for line in fh:
                        if line.strip():
                            yield json.loads(line)[text_column]
            else:
                yield f.read_text(encoding="utf-8", errors="replace")
