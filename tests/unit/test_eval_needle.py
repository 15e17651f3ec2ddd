"""eval-needle: prompts for any tokenizer, the CLI and heatmap, generation vs teacher forcing,
RoPE overrides, and clear errors for bad inputs."""

import functools
import json
import re

import pytest
import torch

import easy_context.eval.needle as needle
from easy_context.eval.needle import (
    Haystack,
    NeedleConfig,
    build_haystack,
    build_prompt,
    evaluate_needle,
    read_haystack_dir,
)

from .eval_fixtures import (TEMPLATE, char_tokenizer, eval_config, random_model_dir,
                            trained_model_scores)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def hay(tok):
    return build_haystack(tok, 400)


def _text(tok, p):
    return tok.decode(p.input_ids[:p.answer_start]), tok.decode(p.input_ids[p.answer_start:])


def test_prompt_length_answer_and_sentence_boundaries(tok, hay):
    cfg = eval_config()
    for length in (128, 192, 300):
        for depth in cfg.depths():
            p = build_prompt(hay, tok, cfg, length, depth, sample=1)
            assert len(p.input_ids) == length  # one token per character: exact
            assert p.input_ids[0] == tok.bos_token_id  # the tokenizer has a BOS
            prompt, answer = _text(tok, p)
            assert answer == p.values[0] and len(p.values[0]) == 3
            needle = TEMPLATE.needle.format(key=p.key, value=p.values[0])
            at = prompt.index(needle)
            before = prompt[:at].removeprefix("<|bos|>")
            # At the start, after a sentence end, or at the end of the cut haystack.
            at_end = prompt[at + len(needle):] == TEMPLATE.question.format(key=p.key)
            assert before == "" or re.search(r"[.!?]\s+$", before) or at_end, before[-20:]
    # Deeper needles sit later in the text.
    ds = [build_prompt(hay, tok, cfg, 300, d, 0).depth for d in cfg.depths()]
    assert ds == sorted(ds) and ds[0] == 0.0 and ds[-1] > 0.8


def test_bos_follows_the_tokenizer(tok, hay):
    p = build_prompt(hay, tok, eval_config(add_bos=False), 160, 0.5, 0)
    assert tok.bos_token_id not in p.input_ids and len(p.input_ids) == 160
    no_bos = char_tokenizer()
    no_bos.bos_token = None
    p = build_prompt(Haystack.from_text(hay.text, no_bos), no_bos, eval_config(), 160, 0.5, 0)
    assert tok.bos_token_id not in p.input_ids


def test_multi_key_and_multi_value(tok, hay):
    p = build_prompt(hay, tok, eval_config(num_distractor=3), 300, 0.5, 0)
    prompt, answer = _text(tok, p)
    assert prompt.count("code=") == 4 + 1 and answer == p.values[0]
    p = build_prompt(hay, tok, eval_config(num_values=3), 300, 0.3, 0)
    prompt, answer = _text(tok, p)
    assert prompt.endswith(TEMPLATE.question_multi_value.format(key=p.key))
    # The answer lists the values in the order they appear in the text.
    assert answer == ", ".join(p.values)
    positions = [prompt.index(f"code={v}.") for v in p.values]
    assert positions == sorted(positions) and len(set(p.values)) == 3


def test_real_bpe_tokenizer_answer_span(hay):
    from easy_context.data.synthetic import generate_texts
    from easy_context.data.tokenizer import train_bpe_tokenizer

    bpe = train_bpe_tokenizer(generate_texts(30, 1500), vocab_size=500)
    h = Haystack.from_text(hay.text, bpe)
    cfg = eval_config(rnd_number_digits=7)
    p = build_prompt(h, bpe, cfg, 120, 0.5, 0)
    assert abs(len(p.input_ids) - 120) <= 3
    assert bpe.decode(p.input_ids[p.answer_start:]).strip() == p.values[0]


def test_cli_writes_results_and_heatmap(tmp_path_factory, tmp_path, monkeypatch):
    from matplotlib.image import imread

    from easy_context.cli import main

    model_dir = random_model_dir(tmp_path_factory.getbasetemp() / "ppl_model")
    out = tmp_path / "needle"
    # The CLI uses the default wording; the tiny models use the short one.
    monkeypatch.setattr(needle, "NeedleConfig", functools.partial(NeedleConfig, template=TEMPLATE))
    assert main(["eval-needle", "--model", str(model_dir), "--min-context-length", "128",
                 "--max-context-length", "192", "--context-interval", "64",
                 "--depth-interval", "0.25", "--num-samples", "2", "--rnd-number-digits", "3",
                 "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["cells"]) == 2 * 5 and results["config"]["variant"] == "single"
    assert 0.0 <= results["average_score"] <= 1.0 and results["chance"] == pytest.approx(1 / 900)
    png = out / "heatmap.png"
    assert png.stat().st_size > 5000 and min(imread(png).shape[:2]) >= 400


@pytest.mark.slow  # its training runs in the background from the session's start (conftest)
def test_trained_tiny_model_beats_chance(trained_needle_model):
    """The tiny model (600 copy-curriculum steps, 200 retrieval steps, 1-2 minutes) retrieves:
    answer digits right and exact matches far above guessing (1 in 10 digits; 1 in 648
    numbers). The floors sit below the worst of the 12 runs recorded by
    benchmarks/needle_test_margin.py (results/needle_test_margin.json: seeds 0-4 on 1 and 2
    threads on an AMX Xeon, seeds 0 and 4 with ATEN_CPU_CAPABILITY=default; digits right
    0.80-0.98, exact 0.57-0.93), so a machine whose kernels train it differently still passes."""
    scores = trained_model_scores(trained_needle_model)
    assert scores["token_accuracy"] >= 0.5, scores
    assert scores["exact"] >= 0.3 and scores["exact"] > 100 * scores["chance_exact"], scores


def test_generation_agrees_with_teacher_forcing(trained_needle_model):
    """On the trained model, so that answers are right and wrong both: greedy decoding starts
    from the teacher-forced argmax, and is right exactly when every teacher-forced argmax is
    (an untrained model compared wrong with wrong only)."""
    from easy_context.models import load_model_and_tokenizer

    model, tk = load_model_and_tokenizer(str(trained_needle_model))
    cfg = eval_config(num_samples=2)
    hay = build_haystack(tk, 300)
    forced = evaluate_needle(model, tk, hay, cfg, "ring_attn", progress=False)
    generated = evaluate_needle(model, tk, hay, cfg, "ring_attn", generate=True, progress=False)
    pairs = [(sf, sg) for cf, cg in zip(forced["cells"], generated["cells"])
             for sf, sg in zip(cf["samples"], cg["samples"])]
    for sf, sg in pairs:
        assert sg["predicted"][:1] == sf["predicted"][:1]
        assert sg["exact"] == sf["exact"]
    assert any(sf["exact"] for sf, _ in pairs), "no right answer: the comparison shows nothing"


def test_rope_overrides_reach_the_model(tmp_path_factory):
    from easy_context.models import load_model_and_tokenizer, parse_rope_scaling

    path = str(random_model_dir(tmp_path_factory.getbasetemp() / "ppl_model"))
    base = load_model_and_tokenizer(path)[0]
    model = load_model_and_tokenizer(path, rope_theta=1e6, rope_scaling="linear:4")[0]
    assert model.config.rope_parameters["rope_theta"] == 1e6
    assert model.config.rope_parameters["rope_type"] == "linear"
    inv, inv0 = model.model.rotary_emb.inv_freq, base.model.rotary_emb.inv_freq
    assert not torch.allclose(inv, inv0)
    assert parse_rope_scaling('{"type": "yarn", "factor": 8}') == {"rope_type": "yarn",
                                                                  "factor": 8.0}
    with pytest.raises(ValueError, match="TYPE:FACTOR"):
        parse_rope_scaling("linear")


def test_bad_inputs(tmp_path, tok, hay, capsys):
    from easy_context.cli import main

    assert main(["eval-needle", "--model", str(tmp_path / "nope"), "--max-context-length", "128",
                 "--min-context-length", "128"]) == 2
    assert capsys.readouterr().err == (f"easy-context eval-needle: error: model folder "
                                       f"{tmp_path / 'nope'} does not exist\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a haystack")
    with pytest.raises(FileNotFoundError, match="no .txt files"):
        read_haystack_dir(tmp_path / "empty")
    with pytest.raises(ValueError, match="greater than --max-context-length"):
        NeedleConfig(min_context_length=512, max_context_length=256)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("One sentence. Two sentences here. " * 3)
    with pytest.raises(ValueError, match="haystack .* has \\d+ tokens, but the longest context"):
        build_haystack(tok, 1000, tmp_path / "short", repeat=False)
    repeated = build_haystack(tok, 1000, tmp_path / "short")  # default: repeat, as the original
    assert len(repeated) >= 1000
    with pytest.raises(ValueError, match="too short for the prompt template"):
        build_prompt(hay, tok, eval_config(), 20, 0.5, 0)
