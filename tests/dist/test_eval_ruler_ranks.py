"""``easy-context eval-ruler`` as a user runs it, on 2 spawned ranks: the answers equal the
same evaluation in this process (plain attention), and a run stopped part-way (samples.jsonl cut inside a line)
continues where it stopped (the ranks' part of the command, on the session's 2-rank pool),
redoing only the samples that were not written whole, with the same answers (rank 0 tells
the other rank which samples are done)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _argv(model: Path | str, out: Path | str, ranks: int) -> list[str]:
    return ["eval-ruler", "--model", str(model), "--tasks", "niah_single_1", "vt",
            "--lengths", "500", "--num-samples", "2", "--max-new-tokens", "6",
            "--nproc-per-node", str(ranks), "--output-dir", str(out)]


def _ruler(model: Path, out: Path, ranks: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "easy_context.cli", *_argv(model, out, ranks)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def ruler_ranks_part(model: str, out: str) -> None:
    """What ``easy-context eval-ruler`` runs on each spawned rank (after its checks in the
    launching process), here on a rank of the session's pool."""
    from easy_context.cli import build_parser
    from easy_context.eval.cli import _check_common, _ruler_rank, ruler_config

    args = build_parser(only="eval-ruler").parse_args(_argv(model, out, 2))
    _check_common(args, [args.model], tokenizer=True)  # sets args.method, as the CLI does
    _ruler_rank(args, ruler_config(args), Path(out))


def _records(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return {(r["task"], r["length"], r["index"]): r["prediction"] for r in rows}


def _one_process(model: Path, out: Path) -> None:
    """The same evaluation in this process, plain attention: the reference."""
    from easy_context.eval.ruler import RulerConfig, run_ruler
    from easy_context.models import load_model_and_tokenizer

    m, tok = load_model_and_tokenizer(str(model))
    cfg = RulerConfig(tasks=["niah_single_1", "vt"], lengths=[500], num_samples=2,
                      max_new_tokens=6)
    run_ruler(m, tok, cfg, out, method="local", progress=False)


def test_two_ranks_equal_one_and_resume(tmp_path, trained_needle_model, dist2):
    """On the trained needle fixture, whose answers depend on the context (it copies what
    followed an earlier match): an untrained model repeats the prompt's last character
    whatever came before, and could not tell a broken attention or cache from a sound one."""
    model = trained_needle_model
    one, two = tmp_path / "one", tmp_path / "two"
    _one_process(model, one)
    run = _ruler(model, two, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _records(two) == _records(one) and len(_records(one)) == 4
    assert len(set(_records(one).values())) > 1, _records(one)  # not one answer for all
    # stopped after one sample and half of the second: the rerun does the other three (the
    # ranks' part of the command, in the session's 2-rank pool: a second launch of the
    # command cost ~8 s and runs the same code; the launcher's checks ran above)
    lines = (two / "samples.jsonl").read_text().splitlines(keepends=True)
    (two / "samples.jsonl").write_text("".join(lines[:1]) + lines[1][:25])
    dist2.run(ruler_ranks_part, str(model), str(two))
    assert _records(two) == _records(one)
    assert len((two / "samples.jsonl").read_text().splitlines()) == 4  # the cut line dropped
    assert (two / "scores.csv").read_text() == (one / "scores.csv").read_text()
    assert json.loads((two / "config.json").read_text())["settings"]["model"] == str(model)
