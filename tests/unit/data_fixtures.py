"""Shared helpers of the data tests: a tiny BPE tokenizer and small corpora on disk.

The tokenizer is trained once per test process (cached here rather than in a conftest
fixture, so every test_data_* file can use it without a shared conftest).
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from easy_context.data.synthetic import SyntheticConfig, generate, generate_texts
from easy_context.data.tokenizer import train_bpe_tokenizer


@lru_cache(maxsize=None)
def tokenizer_dir() -> str:
    """Folder of a 512-token byte-level BPE trained on synthetic text (~0.2 s)."""
    out = Path(tempfile.mkdtemp(prefix="ec_test_tok_"))
    train_bpe_tokenizer(generate_texts(150, 3000, seed=123), vocab_size=512, output_dir=out)
    return str(out)


def load_tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir())


def write_text_folder(folder: Path, n: int, length: int, seed: int) -> list[str]:
    """n text files 000.txt ... with varied lengths (length/4 .. length chars); returns texts."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n):
        # Varied lengths so documents fall both below and above window boundaries.
        cfg = SyntheticConfig(kind="haystack", num_docs=1, length=length // 4 + (i * 7919) % length,
                              seed=seed * 1000 + i)
        text = next(generate(cfg))["text"]
        (folder / f"{i:03d}.txt").write_text(text)
        texts.append(text)
    return texts


def write_jsonl(path: Path, n: int, length: int, seed: int, kind: str = "mix",
                column: str = "text") -> list[str]:
    """A jsonl of synthetic records whose text lengths vary between ~length/8 and length."""
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = []
    with path.open("w") as f:
        for i in range(n):
            cfg = SyntheticConfig(kind=kind, num_docs=1, length=length // 8 + (i * 104729) % length,
                                  seed=seed * 100000 + i)
            rec = next(generate(cfg))
            rec[column] = rec.pop("text")
            f.write(json.dumps(rec) + "\n")
            texts.append(rec[column])
    return texts


def expected_stream(texts: list[str], tok: PreTrainedTokenizerBase, bos: bool = True,
                    eos: bool = True) -> list[list[int]]:
    """Reference tokenization, one document at a time, written independently of the code."""
    docs = []
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        docs.append(([tok.bos_token_id] if bos else []) + ids + ([tok.eos_token_id] if eos else []))
    return docs
