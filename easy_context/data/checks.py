"""Find the first malformed line of an input file, to say exactly what to fix.

Readers (``datasets``' json/text/parquet builders, or our own loop in train-tokenizer) fail
on bad input with messages such as "An error occurred while generating the dataset" or a
bare ``UnicodeDecodeError`` with a byte offset. Only after such a failure do we scan the
files line by line here (so the happy path pays nothing) and report the file, the line
number and the fix.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}


def _open(file: str | Path) -> IO[bytes]:
    return gzip.open(file, "rb") if str(file).endswith(".gz") else open(file, "rb")


def _not_utf8(file: str | Path, n: int, raw: bytes, e: UnicodeDecodeError) -> str:
    return (f"{file}, line {n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
            f"{e.start + 1}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def read_utf8(file: str | Path) -> str:
    """A whole file as text; if it is not UTF-8, a ValueError naming the line."""
    raw = Path(file).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        n = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(_not_utf8(file, n, raw[line_start:], UnicodeDecodeError(
            e.encoding, e.object, e.start - line_start, e.end - line_start, e.reason))) from None


def utf8_lines(file: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line; a line that is not UTF-8 raises a ValueError naming it."""
    with _open(file) as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(_not_utf8(file, n, raw, e)) from None


def json_records(file: str | Path, text_column: str | None) -> Iterator[dict]:
    """The objects of a JSON-lines file (or of one JSON array), with errors naming the line.

    Each record must be an object whose ``text_column`` (if given) is a string or null.
    """
    with _open(file) as f:
        is_array = f.read(4096).lstrip().startswith(b"[")
    records = None
    if is_array:
        text = "".join(line for _, line in utf8_lines(file))
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            # "Extra data": the first value parsed and more follow, so these are JSON lines
            # whose first line happens to be an array; anything else is a broken array.
            if not e.msg.startswith("Extra data"):
                raise ValueError(f"{file}, line {e.lineno}: invalid JSON ({e.msg}, column "
                                 f"{e.colno}); fix the file or write it as JSON lines") from None
    if records is not None:
        numbered: Iterable[tuple[int, object]] = ((i + 1, r) for i, r in enumerate(records))
        where = "element"
    else:
        numbered = ((n, _json_line(file, n, line)) for n, line in utf8_lines(file) if line.strip())
        where = "line"
    for n, record in numbered:
        if not isinstance(record, dict):
            raise ValueError(
                f"{file}, {where} {n}: a JSON {_JSON_TYPES.get(type(record), '?')}, not an object; "
                f'each record must be an object such as {{"{text_column}": "..."}}')
        value = record.get(text_column) if text_column is not None else None
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{file}, {where} {n}: {text_column!r} is a JSON "
                f"{_JSON_TYPES.get(type(value), '?')}, not a string; pass --text-column naming a "
                f"text field (this record has {sorted(record)})")
        yield record


def _json_line(file: str | Path, n: int, line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}, line {n}: invalid JSON ({e.msg}, column {e.colno}); "
                         f"fix or delete that line") from None


def find_bad_input(kind: str, files: Iterable[str], text_column: str | None = "text") -> str | None:
    """What is wrong with the first malformed file of a source, or None if none is found."""
    records = 0
    for file in files:
        try:
            if kind == "json":
                for _ in json_records(file, text_column):
                    records += 1
            elif kind == "text":
                for _ in utf8_lines(file):
                    pass
            elif kind == "parquet":
                try:
                    pq.ParquetFile(file)
                except (pa.ArrowException, OSError) as e:
                    return (f"{file} is not a readable parquet file ({e}); replace it, or give "
                            f"text under another extension")
        except ValueError as e:
            return str(e)
    if kind == "json" and records == 0:
        return (f"input {', '.join(map(str, files))} has no documents (no JSON records); add "
                f"records or leave it out")
    return None
