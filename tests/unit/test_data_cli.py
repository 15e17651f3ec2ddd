"""The argparse entry points: synth-data -> train-tokenizer -> prepare-data, as a user runs them."""

from __future__ import annotations

import argparse
import json

import datasets
import pytest
from transformers import AutoTokenizer

from easy_context.data.cli import (add_prepare_data_args, add_synthetic_args,
                                   add_train_tokenizer_args, run_prepare_data, run_synthetic,
                                   run_train_tokenizer)


def _parser() -> argparse.ArgumentParser:
    """The subcommand layout easy_context/cli.py mounts these under."""
    parser = argparse.ArgumentParser(prog="easy-context")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add, run in [("prepare-data", add_prepare_data_args, run_prepare_data),
                           ("synth-data", add_synthetic_args, run_synthetic),
                           ("train-tokenizer", add_train_tokenizer_args, run_train_tokenizer)]:
        p = sub.add_parser(name)
        add(p)
        p.set_defaults(func=run)
    return parser


def _run(*argv: str) -> int:
    args = _parser().parse_args(list(argv))
    return args.func(args)


def test_cli_pipeline(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    assert _run("synth-data", "--kind", "mix", "--num-docs", "40", "--length", "600",
                "--length-unit", "tokens", "--seed", "1", "--output", str(corpus)) == 0
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    assert len(records) == 40 and {r["kind"] for r in records} == {"haystack", "passkey", "kv", "vartrack"}
    assert all(len(r["text"]) <= 2400 for r in records)

    assert _run("train-tokenizer", "--input", str(corpus), "--vocab-size", "600",
                "--output", str(tmp_path / "tok")) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == 600

    out = tmp_path / "packed"
    assert _run("prepare-data", f"synth={corpus}", "--tokenizer", str(tmp_path / "tok"),
                "--output", str(out), "--seq-length", "256", "--no-add-bos", "--min-length", "10",
                "--upsample-threshold", "500", "--upsample-keep-prob", "0.5", "--num-proc", "2",
                "--streaming", "--seed", "3", "--max-documents", "30") == 0
    assert "windows x 257 tokens" in capsys.readouterr().out
    ds = datasets.load_from_disk(str(out))
    assert len(ds) > 0 and len(ds[0]["input_ids"]) == 257
    stats = json.loads((out / "stats.json").read_text())
    assert stats["bos_token_id"] is None and stats["eos_token_id"] == tok.eos_token_id
    (src,) = stats["sources"]
    assert src["name"] == "synth" and src["documents_read"] == 30
    ids = ds.with_format("numpy")[:]["input_ids"]
    assert (ids != tok.bos_token_id).all()  # --no-add-bos
    config = json.loads((out / "prepare_config.json").read_text())
    assert config["upsample"] == {"threshold": 500, "keep_prob": 0.5} and config["streaming"]


def test_cli_defaults_and_errors(tmp_path):
    args = _parser().parse_args(["prepare-data", "a.txt", "--tokenizer", "t", "--output", "o"])
    assert (args.seq_length, args.text_column, args.add_bos, args.add_eos, args.num_proc,
            args.streaming, args.trust_remote_code, args.upsample_threshold) == (
        8192, "text", True, True, 1, False, False, None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _run("prepare-data", str(tmp_path / "none.txt"), "--tokenizer", "t", "--output", str(tmp_path / "o"))
    with pytest.raises(ValueError, match="--seq-length"):
        _run("prepare-data", str(tmp_path / "none.txt"), "--tokenizer", "t", "--output", "o",
             "--seq-length", "1")
    with pytest.raises(FileNotFoundError, match="tokenizer training input"):
        _run("train-tokenizer", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "t"))
