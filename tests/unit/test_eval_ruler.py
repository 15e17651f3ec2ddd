"""eval-ruler: samples are deterministic and fit their lengths in the model's tokenizer, the
answers are where the tasks put them, scoring is RULER's, the runner resumes per sample and
refuses a folder of other settings, and bad inputs are one-line errors. The runner's
generation is a stand-in here (easy_context.generation is another module's job); the last
test runs the real one when it is there."""

import json
import random
import re
import sys
import types
from collections import Counter

import pytest
import torch

from easy_context.eval.ruler.haystack import PromptEncoder, fit_units
from easy_context.eval.ruler.run import (RulerConfig, check_lengths, check_resume, load_records,
                                         run_ruler)
from easy_context.eval.ruler.scoring import (markdown_table, postprocess, score_sample,
                                             string_match_all, string_match_part)
from easy_context.eval.ruler.tasks import _DRAFTS, TASKS, get_task, make_sample

from .eval_fixtures import char_tokenizer, random_model_dir

NIAH = [t for t in TASKS if t.startswith("niah")]
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()  # one token per character: lengths are easy to reason about


@pytest.fixture(scope="module")
def bpe():
    from easy_context.data.synthetic import generate_texts
    from easy_context.data.tokenizer import train_bpe_tokenizer

    t = train_bpe_tokenizer(generate_texts(30, 1500), vocab_size=500)
    t.chat_template = CHAT
    return t


def _sample(task, tokenizer, length=2500, index=0, template="base", **kw):
    kw.setdefault("max_new_tokens", 16)
    return make_sample(task, length, index, PromptEncoder(tokenizer, template), **kw)


def test_same_seed_same_samples_whatever_was_built_before(tok):
    for task in TASKS:
        a, b = _sample(task, tok), _sample(task, tok)
        assert (a.prompt, a.references, a.input_ids) == (b.prompt, b.references, b.input_ids)
        assert _sample(task, tok, seed=1).prompt != a.prompt, task
        assert _sample(task, tok, index=1).references != a.references, task
        # A prompt of n units is the same whichever sizes the fit tried before it.
        spec = get_task(task)
        draws = [_DRAFTS[spec.kind](spec, random.Random(7), 2500, None) for _ in range(2)]
        draws[0].render(60)
        assert draws[0].render(5) == draws[1].render(5), task


@pytest.mark.parametrize("template", ["base", "chat"])
def test_every_task_fills_its_length(tok, bpe, template):
    """tokens(prompt) + max_new_tokens <= length, and one haystack unit more would not fit:
    as close as the haystack's steps allow, in the tokenizer the model uses."""
    for tokenizer, length in ((tok, 2500), (bpe, 2000)):
        if template == "chat":
            tokenizer = bpe
        for task in TASKS:
            s = _sample(task, tokenizer, length, template=template)
            assert len(s.input_ids) + s.max_new_tokens <= length, (task, len(s.input_ids))
            over = _sample(task, tokenizer, length, template=template, units=s.units + 1)
            assert len(over.input_ids) + over.max_new_tokens > length, task
            assert s.prompt.endswith(" is") or s.prompt.endswith(" are") or \
                s.prompt.endswith(":"), task  # the answer prefix is last
            if template == "chat":
                assert s.prompt.startswith("<|user|>") and "\n<|assistant|>Answer:" in s.prompt
            elif tokenizer.bos_token_id is not None:
                assert s.input_ids[0] == tokenizer.bos_token_id
    # The budget is each task's own unless overridden.
    assert _sample("vt", tok, max_new_tokens=None).max_new_tokens == 30
    assert _sample("cwe", tok, 3000, max_new_tokens=None).max_new_tokens == 120


def test_fit_finds_the_largest_count_that_fits():
    for per_unit, fixed, budget in ((7, 50, 10_000), (1, 0, 3), (13, 400, 100_000), (3, 10, 14)):
        calls = []

        def count(n):
            calls.append(n)
            return fixed + per_unit * n + (n % 3 == 0)  # not quite linear

        n = fit_units(count, budget)
        assert count(n) <= budget < count(n + 1), (per_unit, fixed, budget, n)
        assert len(calls) < 40
    assert fit_units(lambda n: 100 + n, 50) is None
    assert fit_units(lambda n: n, 1000, limit=40) == 40  # all fit: the caller says so


def test_niah_needles_keys_and_values(tok):
    counts = {"niah_single_1": 1, "niah_single_2": 1, "niah_single_3": 1, "niah_multikey_1": 4,
              "niah_multivalue": 4, "niah_multiquery": 4}
    for task in NIAH:
        s = _sample(task, tok)
        needles = re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", s.prompt)
        asked = s.prompt.rsplit("\n", 2)[1]  # the question line
        for value in s.references:  # every answer is in a needle whose key is asked for
            (key,) = [k for _, k, v in needles if v == value]
            assert key in asked and s.prompt.count(value) == 1
        if task in counts:
            assert len(needles) == counts[task], task
        else:  # the haystack is other needles
            assert len(needles) == s.units + 1, task
        keys = {k for _, k, _ in needles}
        assert len(keys) == {"niah_multivalue": 1}.get(task, len(needles)), task
        assert len(s.references) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)
        uuids = task in ("niah_single_3", "niah_multikey_3")
        assert all(bool(UUID.match(v)) == uuids for v in s.references), task
        assert all(bool(re.fullmatch(r"\d{7}", v)) != uuids for v in s.references), task
    # noise haystack: the filler sentences and the needle, nothing else
    s = _sample("niah_single_1", tok)
    body = s.prompt.split("\n")[1]
    rest = re.sub(r"One of the special magic number for \S+ is: \d+\. ?", "",
                  body.replace("numbers for", "number for"))
    assert set(re.split(r"(?<=\.) ", rest.strip())) == {
        "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
        "There and back again."}


def test_essay_haystack_from_a_folder(tok, tmp_path):
    text = " ".join(f"Sentence number {i} of the essay goes here." for i in range(300))
    (tmp_path / "a.txt").write_text(text)
    s = _sample("niah_single_2", tok, 1500, haystack_dir=tmp_path)
    assert "Sentence number 0 of the essay goes here. Sentence number 1 " in s.prompt
    assert f"Sentence number {s.units - 1} of" in s.prompt
    assert f"number {s.units} of" not in s.prompt


def test_variable_tracking_chain(tok):
    s = _sample("vt", tok, 1500, index=3)
    value = re.search(r"assigned the value (\d{5}) in the text", s.prompt).group(1)
    first, *rest = s.references
    at = [s.prompt.index(f"VAR {first} = {value}.")]
    for a, b in zip(s.references, rest):
        at.append(s.prompt.index(f"VAR {b} = VAR {a}."))
    assert at == sorted(at) and len(s.references) == 5  # assigned before it is copied
    assert s.prompt.count("VAR ") == 2 * 5 - 1
    assert s.prompt.endswith(f"5 variables are assigned the value {value}, they are:")


def _counts(numbered: str) -> Counter:
    return Counter(re.findall(r"\d+\. (\w+)", numbered))


def test_common_words(tok):
    for length, (freq, rare) in ((2500, (6, 1)), (8000, (30, 3))):
        s = _sample("cwe", tok, length, max_new_tokens=8)
        shot, real = s.prompt.split("Answer: The top 10 words that appear most often in the "
                                    "list are: ", 1)
        counts = _counts(real.split("\n")[2])
        assert {w for w, c in counts.items() if c == freq} == set(s.references), length
        assert set(counts.values()) == {freq, rare} and len(counts) == 10 + s.units
        assert re.match(r"1\. \w+ 2\. \w+", real.split("\n")[2])
        assert len(_counts(shot.split("\n")[1])) == (20 if length < 4096 else 40)


def test_frequent_words(tok):
    s = _sample("fwe", tok, 1500)
    text = s.prompt.split("coded words. ", 1)[1].split("\n")[0]
    counts = Counter(text.split()).most_common()
    assert counts[0][0] == "..."
    assert {w for w, _ in counts[1:4]} == set(s.references)
    assert counts[3][1] > counts[4][1]  # strictly the three most frequent
    assert sum(c for _, c in counts) <= s.units


def test_json_key_value(tok):
    s = _sample("kv", tok, 1500, index=2)
    data = json.loads(s.prompt.split("JSON data:\n", 1)[1].split("\n\nKey:", 1)[0])
    key = re.search(r'Key: "([^"]+)"', s.prompt).group(1)
    assert data[key] == s.references[0] and len(data) == s.units + 1
    assert all(UUID.match(k) and UUID.match(v) for k, v in data.items())


def test_scoring_is_rulers():
    assert postprocess("\x00 The answer\tis 42\n ") == "The answer\nis 42"
    preds = ["1234 and 5678", "nothing", "ABC xy"]
    refs = [["1234", "5678"], ["1"], ["abc", "xyz"]]
    # all: (2/2 + 0/1 + 1/2) / 3; part: (1 + 0 + 1) / 3
    assert string_match_all(preds, refs) == pytest.approx(50.0)
    assert string_match_part(preds, refs) == pytest.approx(200 / 3)
    assert score_sample(" Tirusa, BAKEMO.", ["bakemo", "tirusa", "zuzuzu"],
                        "string_match_all") == pytest.approx(2 / 3)
    # the prediction is post-processed before matching: a tab is a newline to RULER
    assert score_sample("new\tyork", ["new\nyork"], "string_match_part") == 1.0
    assert score_sample("new\tyork", ["new york"], "string_match_part") == 0.0
    with pytest.raises(ValueError, match="unknown metric 'f1'; metrics: string_match_all"):
        score_sample("x", ["x"], "f1")
    rows = [{"task": t, "length": n, "score": s} for t, n, s in
            (("a", 4096, 100.0), ("a", 8192, 50.0), ("b", 4096, 0.0), ("b", 8192, 25.0))]
    assert markdown_table(rows) == ("| task | 4096 | 8192 | average |\n|---|---|---|---|\n"
                                    "| a | 100.00 | 50.00 | 75.00 |\n| b | 0.00 | 25.00 | 12.50 |\n"
                                    "| average | 50.00 | 37.50 | 43.75 |\n")


class StandIn:
    """generate's contract: (B, L) in, (B, L + T) out, padded after EOS. It answers from a
    table of prompts (every reference, or the first only), then EOS, then junk that must be
    cut off; it counts its calls."""

    def __init__(self, tokenizer, cfg, first_only=()):
        enc = PromptEncoder(tokenizer, cfg.template)
        self.tok, self.calls, self.table = tokenizer, [], {}
        for t in cfg.tasks:
            for n in cfg.lengths:
                for i in range(cfg.num_samples + 1):
                    s = cfg.sample(t, n, i, enc)
                    refs = s.references[:1] if t in first_only else s.references
                    self.table[tuple(s.input_ids)] = " " + ", ".join(refs) + "."

    def __call__(self, model, input_ids, *, max_new_tokens, eos_token_id, pad_token_id, **kw):
        assert kw["method"] is None and kw["do_sample"] is False and input_ids.shape[0] == 1
        self.calls.append(input_ids.shape[1])
        new = self.tok(self.table[tuple(input_ids[0].tolist())],
                       add_special_tokens=False)["input_ids"] + [eos_token_id]
        new += self.tok("zzz9999999", add_special_tokens=False)["input_ids"]
        new = (new + [pad_token_id] * max_new_tokens)[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


class _Model(torch.nn.Module):
    config = types.SimpleNamespace(pad_token_id=2, eos_token_id=1)


def _cfg(**kw):
    base = dict(tasks=["niah_single_1", "niah_multivalue"], lengths=[800, 1100], num_samples=2,
                max_new_tokens=40, settings={"model": "m"})
    return RulerConfig(**{**base, **kw})


def test_runner_scores_writes_tables_and_resumes(tok, tmp_path):
    cfg = _cfg()
    fake = StandIn(tok, _cfg(num_samples=3), first_only={"niah_multivalue"})
    rows = run_ruler(_Model(), tok, cfg, tmp_path, generate_fn=fake, progress=False)
    assert len(fake.calls) == 8 and max(fake.calls) <= 1100 - 40
    assert [(r["task"], r["length"], r["score"]) for r in rows] == [
        ("niah_single_1", 800, 100.0), ("niah_single_1", 1100, 100.0),
        ("niah_multivalue", 800, 25.0), ("niah_multivalue", 1100, 25.0)]
    records = load_records(tmp_path / "samples.jsonl")
    assert len(records) == 8 and all("zzz" not in r["prediction"] for r in records)
    assert records[0]["prediction"] == " " + records[0]["references"][0] + "."  # raw: as decoded
    assert "| average | 62.50 | 62.50 | 62.50 |" in (tmp_path / "scores.md").read_text()
    header = (tmp_path / "scores.csv").read_text().splitlines()[0]
    assert header == "task,length,score,samples,metric"
    assert (tmp_path / "scores.png").stat().st_size > 5000
    assert json.loads((tmp_path / "config.json").read_text())["seed"] == 0

    # Done: nothing is generated again.
    run_ruler(_Model(), tok, cfg, tmp_path, generate_fn=fake, progress=False)
    assert len(fake.calls) == 8
    # A run killed while writing: 3 lines lost, a 4th cut short. The rest is kept.
    path = tmp_path / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4]) + lines[4][:25])
    rows = run_ruler(_Model(), tok, cfg, tmp_path, generate_fn=fake, progress=False)
    assert len(fake.calls) == 8 + 4 and len(load_records(path)) == 8
    assert rows[0]["score"] == 100.0 and rows[-1]["score"] == 25.0
    # More samples per cell: only the new ones run.
    rows = run_ruler(_Model(), tok, _cfg(num_samples=3), tmp_path, generate_fn=fake,
                     progress=False)
    assert len(fake.calls) == 12 + 4 and all(r["samples"] == 3 for r in rows)


def test_changed_settings_are_refused(tok, tmp_path):
    fake = StandIn(tok, _cfg(lengths=[800]))
    run_ruler(_Model(), tok, _cfg(lengths=[800]), tmp_path, generate_fn=fake, progress=False)
    for change, said in (({"seed": 1}, "seed: 0 there, 1 now"),
                         ({"max_new_tokens": 30}, "max_new_tokens: 40 there, 30 now"),
                         ({"settings": {"model": "other"}}, "settings: {'model': 'm'} there")):
        with pytest.raises(ValueError, match=re.escape(f"holds samples of another run ({said}")):
            run_ruler(_Model(), tok, _cfg(lengths=[800], **change), tmp_path, generate_fn=fake)
    check_resume(tmp_path, _cfg(lengths=[800], tasks=["vt"]))  # other tasks: the same samples
    assert len(fake.calls) == 4


def test_bad_inputs_are_one_line_errors(tok, tmp_path):
    names = ", ".join(TASKS)
    with pytest.raises(ValueError, match=f"unknown RULER task 'nope'; tasks: {re.escape(names)}$"):
        RulerConfig(tasks=["vt", "nope"])
    with pytest.raises(ValueError, match=r"task vt needs (\d+) tokens at least .* above the "
                                         r"length 200; use --lengths of \1 or more"):
        _sample("vt", tok, 200)
    # cwe's counts grow at 4096 (RULER's 30 and 3 from 6 and 1): checked at every length
    check_lengths(tok, RulerConfig(tasks=["cwe"], lengths=[3000], max_new_tokens=16))
    with pytest.raises(ValueError, match=r"task cwe needs \d+ tokens at least .* length 4096"):
        check_lengths(tok, RulerConfig(tasks=["cwe"], lengths=[3000, 4096], max_new_tokens=16))
    (tmp_path / "a.txt").write_text("A short essay. It has three sentences. That is all.")
    with pytest.raises(ValueError, match=r"haystack folder .* has 3 sentences, \d+ tokens in task "
                                         r"niah_single_2's prompt: too few to fill length 2000"):
        _sample("niah_single_2", tok, 2000, haystack_dir=tmp_path)
    with pytest.raises(ValueError, match="has no chat template .*; use --template base"):
        PromptEncoder(tok, "chat")
    for bad, said in (({"lengths": [0]}, "--lengths must be positive"),
                      ({"num_samples": 0}, "--num-samples must be >= 1"),
                      ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
                      ({"tasks": []}, "--tasks is empty"),
                      ({"template": "raw"}, "--template must be one of")):
        with pytest.raises(ValueError, match=re.escape(said)):
            RulerConfig(**bad)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_dir(tmp_path_factory.getbasetemp() / "ppl_model")


def test_cli_checks_before_launching(model_dir, tmp_path, capsys, monkeypatch):
    from easy_context.cli import main
    from easy_context.eval import cli

    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("launched despite a bad input"))
    base = ["eval-ruler", "--model", str(model_dir), "--output-dir", str(tmp_path / "out"),
            "--lengths", "1000"]  # a later --lengths replaces it
    cases = [(["--tasks", "vt", "nope"], "unknown RULER task 'nope'; tasks: niah_single_1, "),
             (["--lengths", "300"], "task niah_single_1 needs "),
             (["--template", "chat"], "has no chat template"),
             (["--haystack-dir", str(tmp_path / "none")], "does not exist"),
             (["--num-samples", "0"], "--num-samples must be >= 1"),
             (["--lengths", "1000", "2000"], "exceed the model's RoPE range "
                                             "(max_position_embeddings=1024)")]
    for extra, said in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("easy-context eval-ruler: error: ") and said in err, err
        assert err.count("\n") == 1
    # a folder written with another seed
    out = tmp_path / "other"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"seed": 5}))
    assert main(["eval-ruler", "--model", str(model_dir), "--output-dir", str(out),
                 "--lengths", "2000"]) == 2
    assert "holds samples of another run (seed: 5 there, 0 now" in capsys.readouterr().err


def test_cli_runs_and_resumes_with_a_stand_in_generate(model_dir, tmp_path, capsys,
                                                       monkeypatch):
    """The whole command on the tiny model, its generate standing in (the model is switched
    to the sequence-parallel method first, as eval-needle does)."""
    from easy_context.cli import main

    seen = []

    def generate(model, input_ids, *, max_new_tokens, **kw):
        seen.append(model.config._attn_implementation)
        return torch.cat([input_ids, torch.full((1, max_new_tokens), 3)], dim=1)

    monkeypatch.setitem(sys.modules, "easy_context.generation",
                        types.SimpleNamespace(generate=generate))
    argv = ["eval-ruler", "--model", str(model_dir), "--tasks", "niah_single_1", "kv",
            "--lengths", "700", "1000", "--num-samples", "1", "--max-new-tokens", "8",
            "--parallel-mode", "ring_attn", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| average | 0.00 | 0.00 | 0.00 |" in out and "wrote " in out
    assert seen == ["ring_attn"] * 4
    assert main(argv) == 0 and len(seen) == 4  # all done: nothing runs again
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "samples.jsonl", "scores.csv",
                                                   "scores.md", "scores.png"}


def test_real_generate_on_the_tiny_model(trained_needle_model, tmp_path):
    """The runner's answers are what transformers' greedy decoding of the plain model gives,
    cut at EOS, on one process. The trained needle fixture: its answers depend on the
    context (an untrained model repeats the prompt's last character whatever came before)."""
    from easy_context.integrations.hf import apply_sequence_parallel
    from easy_context.models import load_model_and_tokenizer

    model, tk = load_model_and_tokenizer(str(trained_needle_model))
    plain, _ = load_model_and_tokenizer(str(trained_needle_model))
    apply_sequence_parallel(model, "zigzag_ring_attn")
    cfg = RulerConfig(tasks=["niah_single_1", "vt"], lengths=[700], num_samples=1,
                      max_new_tokens=8)
    run_ruler(model, tk, cfg, tmp_path, progress=False)
    enc = PromptEncoder(tk)
    for r in load_records(tmp_path / "samples.jsonl"):
        ids = torch.tensor([cfg.sample(r["task"], 700, 0, enc).input_ids])
        ref = plain.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=8, eos_token_id=tk.eos_token_id,
                             pad_token_id=tk.pad_token_id)[0, ids.shape[1]:].tolist()
        ref = ref[:ref.index(tk.eos_token_id)] if tk.eos_token_id in ref else ref
        assert r["prediction"] == tk.decode(ref, skip_special_tokens=True)
        assert r["new_tokens"] == len(ref)
    predictions = [r["prediction"] for r in load_records(tmp_path / "samples.jsonl")]
    assert len(set(predictions)) == len(predictions), predictions  # each task its own
