"""eval-ppl: windows, token-weighted NLL equal to a direct cross-entropy, the CSV, plot-ppl."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from easy_context.eval.ppl import PplConfig, evaluate_ppl, sliding_windows, window_stats

from .eval_fixtures import random_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_dir(tmp_path_factory.getbasetemp() / "ppl_model")


@pytest.fixture(scope="module")
def model(model_dir):
    from easy_context.models import load_model_and_tokenizer

    return load_model_and_tokenizer(str(model_dir))[0]


def _direct_nll(model, ids, first=1):
    """Sum and count of token NLLs from the full logits, scoring ids[first:]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    nll = F.cross_entropy(logits[first - 1:-1], torch.tensor(ids[first:]), reduction="none")
    return nll.double().sum().item(), nll.numel(), nll.double()


def test_sliding_windows_score_every_token_once():
    def scored(n, length, stride):
        out = []
        for begin, end, first in sliding_windows(n, length, stride):
            assert end - begin <= length and first >= 1
            out += list(range(begin + first, end))
        return out

    for n, length, stride in [(10, 4, 2), (10, 4, 3), (7, 10, 3), (100, 32, 8)]:
        assert scored(n, length, stride) == list(range(1, n)), (n, length, stride)
    # Windows that do not overlap cannot predict their own first token.
    assert scored(10, 4, 4) == [1, 2, 3, 5, 6, 7, 9]


def test_window_nll_equals_direct_cross_entropy(model):
    ids = torch.randint(3, 259, (67,), generator=torch.Generator().manual_seed(0)).tolist()
    stats = window_stats(model, ids, 1, "zigzag_ring_attn", pad_id=2, last_k=16, chunk_size=10)
    total, count, per_token = _direct_nll(model, ids)
    assert stats[1].item() == count == 66
    assert stats[0].item() == pytest.approx(total, rel=1e-6)
    assert stats[3].item() == 16
    assert stats[2].item() == pytest.approx(per_token[-16:].sum().item(), rel=1e-6)
    # Scoring from the middle of the window (a later sliding window) scores ids[40:] only.
    later = window_stats(model, ids, 40, "ring_attn", pad_id=2, last_k=16)
    assert later[1].item() == 27
    assert later[0].item() == pytest.approx(per_token[39:].sum().item(), rel=1e-6)


def test_ppl_is_token_weighted_over_samples(model):
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (80, 50)]
    rows = evaluate_ppl(model, samples, PplConfig(min_tokens=32, max_tokens=64, tokens_step=32,
                                                  truncate=True, last_k=8), "zigzag_ring_attn",
                        pad_id=2, progress=False)
    assert [r["context_length"] for r in rows] == [32, 64]
    for row in rows:
        length = row["context_length"]
        sums = [_direct_nll(model, s[:length]) for s in samples]
        total, count = sum(s for s, _, _ in sums), sum(c for _, c, _ in sums)
        assert row["tokens"] == count
        assert row["nll_sum"] == pytest.approx(total, rel=1e-6)
        assert row["ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)
        last = sum(t[-8:].sum().item() for _, _, t in sums)
        assert row["last_k_tokens"] == 16
        assert row["last_k_ppl"] == pytest.approx(math.exp(last / 16), rel=1e-6)


def test_bad_config():
    with pytest.raises(ValueError, match="--min-tokens .* greater than --max-tokens"):
        PplConfig(min_tokens=512, max_tokens=256, tokens_step=64)


def test_cli_writes_csv_and_plot(model_dir, tmp_path):
    from matplotlib.image import imread

    from easy_context.cli import main

    data = tmp_path / "docs.jsonl"
    texts = ["The grass is green. " * 8, "The sky is blue and wide. " * 7, "short"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "ppl.csv"
    argv = ["eval-ppl", "--model", str(model_dir), "--model", str(model_dir), "--dataset",
            str(data), "--dataset-min-tokens", "100", "--min-tokens", "64", "--max-tokens", "128",
            "--tokens-step", "64", "--sliding-window", "32", "--last-k", "16",
            "--output-file", str(out)]
    assert main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 4 and {r["context_length"] for r in rows} == {"64", "128"}
    assert all(r["samples"] == "2" for r in rows)  # "short" is filtered out
    png = tmp_path / "ppl.png"
    assert main(["plot-ppl", str(out), "--output", str(png)]) == 0
    assert png.stat().st_size > 5000
    height, width = imread(png).shape[:2]
    assert (width, height) == (800, 500)

def test_cli_reports_a_missing_model_on_one_line(tmp_path, capsys):
    from easy_context.cli import main

    assert main(["eval-ppl", "--model", str(tmp_path / "missing"), "--dataset", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err == f"easy-context eval-ppl: error: model folder {tmp_path / 'missing'} does not exist\n"
