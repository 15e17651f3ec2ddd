"""A sweep of bad values for every flag of prepare-data, synth-data and train-tokenizer.

Each must fail early with one ValueError / FileNotFoundError whose single line says what
to change (easy_context/cli.py prints it as ``easy-context <command>: error: ...``), rather
than a library's "An error occurred while generating the dataset" or a traceback.
"""

from __future__ import annotations

import json

import datasets
import pytest
from tqdm.std import tqdm

from tests.unit.data_fixtures import tokenizer_dir, write_jsonl
from tests.unit.test_data_cli import _run


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    write_jsonl(d / "good.jsonl", n=8, length=800, seed=1)
    (d / "bad_json.jsonl").write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    (d / "bad_utf8.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    (d / "array_line.jsonl").write_text('[1, 2]\n{"text": "c"}\n')
    (d / "int_text.jsonl").write_text('{"text": 5}\n{"text": 6}\n')
    (d / "bad_utf8.txt").write_bytes(b"fine line\nsecond line\ncaf\xe9 au lait\n")
    (d / "empty.txt").write_text("")
    (d / "blank.jsonl").write_text("\n\n")
    (d / "not.parquet").write_text("this is not parquet")
    datasets.Dataset.from_dict({"body": ["x" * 50] * 3}).to_parquet(str(d / "body.parquet"))
    (d / "empty_dir").mkdir()
    (d / "mixed").mkdir()
    (d / "mixed" / "a.txt").write_text("some text")
    (d / "mixed" / "b.jsonl").write_text('{"text": "x"}\n')
    (d / "a_file").write_text("I am a file")
    (d / "no_tok").mkdir()
    (d / "foreign").mkdir()
    (d / "foreign" / "notes.md").write_text("keep me")
    return d


def _prep(d, *inputs, extra=()):
    return ("prepare-data", *[str(d / i) if "=" not in i else i for i in inputs],
            "--tokenizer", tokenizer_dir(), "--output-dir", str(d / "out"), "--seq-length", "32",
            *extra)


PREPARE = [
    # (inputs, extra flags, exception, message)
    (["missing.jsonl"], [], FileNotFoundError, r"missing.jsonl does not exist; give an existing"),
    (["empty.txt"], [], ValueError, r"empty.txt is empty; remove it"),
    (["empty_dir"], [], ValueError, r"no non-empty files"),
    (["mixed"], [], ValueError, r"mixes file types .*give each type as its own input"),
    (["bad_json.jsonl"], [], ValueError, r"bad_json.jsonl, line 2: invalid JSON .*fix or delete"),
    (["bad_utf8.jsonl"], [], ValueError, r"bad_utf8.jsonl, line 2: not valid UTF-8 \(byte 0xe9"),
    (["array_line.jsonl"], [], ValueError, r"array_line.jsonl, line 1: a JSON array, not an object"),
    (["int_text.jsonl"], [], ValueError, r"int_text.jsonl.*'text' .*not .*--text-column"),
    (["bad_utf8.txt"], [], ValueError, r"bad_utf8.txt, line 3: not valid UTF-8.*re-encode"),
    (["blank.jsonl"], [], ValueError, r"blank.jsonl has no documents"),
    (["not.parquet"], [], ValueError, r"not.parquet is not a readable parquet file"),
    (["body.parquet"], [], ValueError, r"no column 'text' \(columns: \['body'\]\); pass --text-column"),
    (["good.jsonl"], ["--text-column", "body"], ValueError, r"no column 'body'.*--text-column"),
    (["good.jsonl"], ["--text-column", "id"], ValueError, r"column 'id' holds int64, not text"),
    (["good.jsonl"], ["--text-column", ""], ValueError, r"--text-column is empty"),
    (["good.jsonl", "good.jsonl"], [], ValueError, r"source names must be unique"),
    (["=x.jsonl"], [], ValueError, r"empty source name before '='"),
    (["good.jsonl"], ["--seq-length", "0"], ValueError, r"--seq-length"),
    (["good.jsonl"], ["--seq-length", "-3"], ValueError, r"--seq-length"),
    (["good.jsonl"], ["--seq-length", "1000000"], ValueError, r"fewer than one window.*lower --seq-length"),
    (["good.jsonl"], ["--min-length", "-1"], ValueError, r"--min-length must be at least 0"),
    (["good.jsonl"], ["--min-length", "100000"], ValueError, r"shorter than --min-length"),
    (["good.jsonl"], ["--upsample-threshold", "0"], ValueError, r"--upsample-threshold must be at least 1"),
    (["good.jsonl"], ["--upsample-keep-prob", "1.5"], ValueError, r"--upsample-keep-prob must be in \[0, 1\]"),
    (["good.jsonl"], ["--upsample-keep-prob", "-0.1"], ValueError, r"--upsample-keep-prob"),
    (["good.jsonl"], ["--num-proc", "0"], ValueError, r"--num-proc must be at least 1"),
    (["good.jsonl"], ["--seed", "-1"], ValueError, r"--seed must be at least 0"),
    (["good.jsonl"], ["--max-documents", "0"], ValueError, r"--max-documents must be at least 1"),
]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("inputs,extra,exc,match", PREPARE,
                         ids=[f"{'+'.join(i)}{''.join(e)}" for i, e, _, _ in PREPARE])
def test_prepare_data_bad_values(files, inputs, extra, exc, match, streaming):
    argv = _prep(files, *inputs, extra=[*extra, *(["--streaming"] if streaming else [])])
    with pytest.raises(exc, match=match) as info:
        _run(*argv)
    assert "\n" not in str(info.value)
    assert not (files / "out").exists()  # failed before writing anything
    # no progress bar left open (it would print itself again when the process exits)
    assert not [bar.desc for bar in tqdm._instances]


@pytest.mark.parametrize("tokenizer,exc,match", [
    ("./no/such/tok", FileNotFoundError, r"tokenizer folder ./no/such/tok does not exist"),
    ("{d}/a_file", ValueError, r"a_file is a file; pass the folder"),
    ("{d}/no_tok", FileNotFoundError, r"could not load tokenizer .*pass --tokenizer a local folder"),
])
def test_prepare_data_bad_tokenizer(files, tokenizer, exc, match):
    argv = list(_prep(files, "good.jsonl"))
    argv[argv.index("--tokenizer") + 1] = tokenizer.format(d=files)
    with pytest.raises(exc, match=match) as info:
        _run(*argv)
    assert "\n" not in str(info.value)


def test_prepare_data_bad_output(files):
    argv = list(_prep(files, "good.jsonl"))
    i = argv.index("--output-dir") + 1
    argv[i] = str(files / "a_file")
    with pytest.raises(ValueError, match=r"a_file is a file; pass --output-dir a folder"):
        _run(*argv)
    argv[i] = str(files / "foreign")
    with pytest.raises(ValueError, match=r"not a prepare-data output; pass a new --output-dir"):
        _run(*argv)
    assert (files / "foreign" / "notes.md").exists()


@pytest.mark.parametrize("flags,match", [
    (["--num-docs", "0"], r"--num-docs must be at least 1, got 0"),
    (["--num-docs", "-2"], r"--num-docs must be at least 1"),
    (["--length", "0"], r"--length must be at least 1, got 0"),
    (["--length", "-100"], r"--length must be at least 1"),
    (["--output", "{d}"], r"is a folder; pass a file path"),
])
def test_synth_data_bad_values(files, flags, match, tmp_path):
    out = tmp_path / "c.jsonl"
    argv = ["synth-data", "--output", str(out), *[f.format(d=files) for f in flags]]
    with pytest.raises(ValueError, match=match):
        _run(*argv)
    assert not out.exists()  # checked before the file is opened


@pytest.mark.parametrize("inputs,flags,exc,match", [
    (["missing"], [], FileNotFoundError, r"missing does not exist; pass existing files"),
    (["empty_dir"], [], ValueError, r"hold no non-empty file"),
    (["empty.txt"], [], ValueError, r"hold no non-empty file"),
    (["bad_json.jsonl"], [], ValueError, r"bad_json.jsonl, line 2: invalid JSON"),
    (["bad_utf8.jsonl"], [], ValueError, r"bad_utf8.jsonl, line 2: not valid UTF-8"),
    (["bad_utf8.txt"], [], ValueError, r"bad_utf8.txt, line 3: not valid UTF-8 \(byte 0xe9 at column 4\)"),
    (["int_text.jsonl"], [], ValueError, r"int_text.jsonl, line 1: 'text' is a JSON number"),
    (["good.jsonl"], ["--text-column", "body"], ValueError, r"no record has a 'body' field"),
    (["body.parquet"], [], ValueError, r"no column 'text' \(columns: \['body'\]\)"),
    (["not.parquet"], [], ValueError, r"not a readable parquet file"),
    (["blank.jsonl"], [], ValueError, r"hold no text"),
    (["good.jsonl"], ["--vocab-size", "100"], ValueError, r"--vocab-size must be at least 259"),
    (["good.jsonl"], ["--output-dir", "{d}/a_file"], ValueError, r"a_file is a file; pass --output-dir"),
])
def test_train_tokenizer_bad_values(files, inputs, flags, exc, match, tmp_path):
    argv = ["train-tokenizer", "--input", *[str(files / i) for i in inputs],
            "--output-dir", str(tmp_path / "tok"), *[f.format(d=files) for f in flags]]
    with pytest.raises(exc, match=match) as info:
        _run(*argv)
    assert "\n" not in str(info.value)


def test_output_dir_and_output_are_aliases(files, tmp_path):
    for flag in ("--output", "--output-dir"):
        out = tmp_path / flag.strip("-")
        assert _run("train-tokenizer", "--input", str(files / "good.jsonl"), "--vocab-size", "300",
                    flag, str(out / "tok")) == 0
        assert _run("prepare-data", str(files / "good.jsonl"), "--tokenizer", str(out / "tok"),
                    flag, str(out / "packed"), "--seq-length", "16") == 0
        assert json.loads((out / "packed" / "stats.json").read_text())["windows"] > 0
    parquet_tok = tmp_path / "ptok"
    assert _run("train-tokenizer", "--input", str(files / "body.parquet"), "--text-column", "body",
                "--vocab-size", "260", "--output-dir", str(parquet_tok)) == 0
