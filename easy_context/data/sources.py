"""Reading raw documents from the inputs of ``prepare-data``.

An input is one of
  * a text file, or a folder of text files: one file = one document;
  * a ``.jsonl``/``.json`` or ``.parquet`` file (or a folder of them): one row = one document,
    text in ``text_column``;
  * a folder written by ``datasets.save_to_disk``: loaded with ``load_from_disk``;
  * anything else is taken as a dataset name for ``datasets.load_dataset``.

An input may be named ``name=path``; the name labels the source in stats.json (and is the
unit of per-source upsampling). Without a name, the file or folder name is used.

Every reader goes through ``datasets`` (the ``text``, ``json`` and ``parquet`` builders), in
memory-mapped or streaming mode, so both modes read exactly the same documents in the same
order — which is what makes streaming results equal the in-memory ones.

When a reader fails on a malformed file, ``datasets`` says only "An error occurred while
generating the dataset"; we then scan the files ourselves (:mod:`.checks`) and raise an
error that names the file, the line and what to fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from .checks import find_bad_input

logger = logging.getLogger(__name__)

_JSON_EXT = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_PARQUET_EXT = (".parquet",)


@dataclass(frozen=True)
class SourceSpec:
    """One input of prepare-data, resolved to a reader."""

    name: str
    """Label used in stats.json and for per-source upsampling."""
    path: str
    """File, folder, or dataset name as given."""
    kind: str
    """'text', 'json', 'parquet', 'disk' (save_to_disk folder) or 'hub' (load_dataset name)."""
    files: tuple[str, ...] = ()
    """Resolved data files for the text/json/parquet kinds, sorted."""


def _kind_of(file: str) -> str:
    if file.endswith(_JSON_EXT):
        return "json"
    if file.endswith(_PARQUET_EXT):
        return "parquet"
    return "text"


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "state.json").exists() or (folder / "dataset_dict.json").exists()


def _looks_like_path(s: str) -> bool:
    # Hub names are 'name' or 'org/name'. A leading ./ ../ / ~, a deeper path, or a file
    # extension means the user expected a local path: that deserves a FileNotFoundError, not
    # a hub lookup that fails later with a network error.
    suffixes = (".txt", ".md", ".text") + _JSON_EXT + _PARQUET_EXT
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or s.endswith(suffixes)


def parse_source(spec: str) -> SourceSpec:
    """Resolve ``[name=]path`` to a :class:`SourceSpec`, checking that files exist and are non-empty."""
    name, path = None, spec
    if "=" in spec and not Path(spec).exists():
        name, path = spec.split("=", 1)
        if not name:
            raise ValueError(f"input {spec!r}: empty source name before '='; use name=path")
    p = Path(path).expanduser()
    name = name or p.name or path
    if p.is_file():
        if p.stat().st_size == 0:
            raise ValueError(f"input file {p} is empty; remove it from the inputs or give it some text")
        return SourceSpec(name, path, _kind_of(p.name), (str(p),))
    if p.is_dir():
        if _is_saved_dataset(p):
            return SourceSpec(name, path, "disk")
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        nonempty = [f for f in files if os.path.getsize(f) > 0]
        for f in sorted(set(files) - set(nonempty)):
            logger.warning("skipping empty file %s", f)
        if not nonempty:
            raise ValueError(f"input folder {p} has no non-empty files; add text/jsonl/parquet files to it")
        kinds = {_kind_of(f) for f in nonempty}
        if len(kinds) > 1:
            raise ValueError(
                f"input folder {p} mixes file types {sorted(kinds)}; give each type as its own input"
            )
        return SourceSpec(name, path, kinds.pop(), tuple(nonempty))
    if _looks_like_path(path):
        raise FileNotFoundError(f"input {path} does not exist; give an existing file or folder")
    return SourceSpec(name, path, "hub")


@contextmanager
def _reading(source: SourceSpec, text_column: str | None) -> Iterator[None]:
    """Turn a reader's failure on a malformed file into an error naming the file and line."""
    try:
        yield
    except (datasets.exceptions.DatasetGenerationError, pa.ArrowException, UnicodeDecodeError,
            ValueError) as e:
        problem = find_bad_input(source.kind, source.files, text_column)
        if problem is None:
            raise
        raise ValueError(problem) from e


def open_source(source: SourceSpec, columns: list[str], flag: str = "--text-column",
                streaming: bool = False, max_documents: int | None = None,
                text_column: str | None = None) -> datasets.Dataset | datasets.IterableDataset:
    """Open a source with just ``columns``, in file order; ``flag`` is the option that names them.

    Non-streaming sources are memory-mapped Arrow (``load_dataset`` converts files once into
    its cache); streaming sources are read lazily and never held in full. ``text_column``,
    when the columns hold text, lets a malformed-file diagnosis check its type too.
    """
    if source.kind == "disk":
        ds = datasets.load_from_disk(source.path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        if streaming:
            ds = ds.to_iterable_dataset()
    elif source.kind == "hub":
        try:
            ds = datasets.load_dataset(source.path, split="train", streaming=streaming)
        except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
            raise FileNotFoundError(
                f"input {source.path!r} is not a local file or folder, and loading it as a "
                f"dataset name failed ({type(e).__name__}: {e}); give an existing path"
            ) from e
    else:
        kwargs = {"sample_by": "document"} if source.kind == "text" else {}
        with _reading(source, text_column):
            ds = datasets.load_dataset(source.kind, data_files=list(source.files), split="train",
                                       streaming=streaming, **kwargs)
    found = ds.column_names
    if not found:  # a streamed source of unknown schema: look at its first row
        with _reading(source, text_column):
            first = next(iter(ds), None)
        if first is None:
            raise ValueError(f"input {source.path} has no documents; check the file")
        found = list(first)
    missing = [c for c in columns if c not in found]
    if missing:
        raise ValueError(f"input {source.path} has no column {missing[0]!r} (columns: {found}); "
                         f"pass {flag} with one of them")
    ds = ds.select_columns(columns)
    if max_documents is not None:
        ds = ds.take(max_documents) if streaming else ds.select(range(min(max_documents, len(ds))))
    return ds


def load_source(source: SourceSpec, text_column: str = "text", streaming: bool = False,
                max_documents: int | None = None) -> datasets.Dataset | datasets.IterableDataset:
    """Open a source as a dataset with a single ``text`` column, in file order."""
    if source.kind == "text":
        text_column = "text"  # the text builder names its one column 'text'
    ds = open_source(source, [text_column], "--text-column", streaming, max_documents, text_column)
    feature = (ds.features or {}).get(text_column)
    if isinstance(feature, datasets.Value) and feature.dtype not in ("string", "large_string"):
        raise ValueError(
            f"input {source.path}: column {text_column!r} holds {feature.dtype}, not text; "
            f"pass --text-column naming a text column"
        )
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def iter_texts(ds: datasets.Dataset | datasets.IterableDataset, batch_size: int = 1000
               ) -> Iterator[list[str]]:
    """Yield batches of document texts; None values (missing text) become empty strings."""
    for batch in ds.iter(batch_size=batch_size):
        yield [t or "" for t in batch["text"]]


def iter_document_batches(ds: datasets.Dataset | datasets.IterableDataset, source: SourceSpec,
                          to_document: Callable[[dict, str], tuple[Any, int]],
                          batch_size: int = 256, batch_chars: int = 1 << 20,
                          text_column: str | None = None) -> Iterator[list]:
    """Batches of documents made by ``to_document(record, where) -> (document, characters)``,
    each batch closed at ``batch_size`` documents or ``batch_chars`` characters, so that a
    few huge documents still spread over the tokenizer workers."""
    out: list = []
    chars = row = 0
    with _reading(source, text_column):
        for batch in ds.iter(batch_size=batch_size):
            for values in zip(*batch.values()):
                doc, n = to_document(dict(zip(batch, values)), f"input {source.path}, document {row}")
                out.append(doc)
                chars += n
                row += 1
                if len(out) == batch_size or chars >= batch_chars:
                    yield out
                    out, chars = [], 0
    if out:
        yield out


def iter_text_batches(ds: datasets.Dataset | datasets.IterableDataset, source: SourceSpec,
                      text_column: str = "text", batch_size: int = 256,
                      batch_chars: int = 1 << 20) -> Iterator[list[str]]:
    """Batches of the texts of a :func:`load_source` dataset.

    Missing texts (None) become empty strings; any other non-text value is an error that
    names the row (a streamed jsonl has no schema to check up front).
    """
    def to_text(record: dict, where: str) -> tuple[str, int]:
        t = record["text"]
        if t is None:
            return "", 0
        if not isinstance(t, str):
            raise ValueError(f"{where} has a {type(t).__name__} in column {text_column!r}, not "
                             f"text; pass --text-column naming a text column")
        return t, len(t)

    return iter_document_batches(ds, source, to_text, batch_size, batch_chars, text_column)
