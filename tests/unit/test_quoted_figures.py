"""Figures the documentation quotes in words are the ones their source holds: a results file
under benchmarks/results/ or the bound a test asserts. Each test reads the source (JSON, or a
test module's text parsed with ``ast``; nothing is run or imported), computes the figure as the
page writes it and checks that the page says exactly that. Tables quoted whole are checked in
tests/unit/test_docs_site.py."""

from __future__ import annotations

import ast
import json
import math
import re
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def _text(path: str) -> str:
    """The page with every run of whitespace made one space (sentences wrap anywhere)."""
    return " ".join((REPO / path).read_text().split())


def _results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _pct_range(values: list[float]) -> str:
    """min-max of fractions as the pages write them: '0.7-9.7%'."""
    return f"{100 * min(values):.1f}-{100 * max(values):.1f}%"


def _module(path: str) -> tuple[str, ast.Module]:
    source = (REPO / path).read_text()
    return source, ast.parse(source)


def _constant(tree: ast.Module, name: str) -> float:
    """A module-level ``NAME = <arithmetic on literals>``, evaluated without running the module."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                             if isinstance(t, ast.Name)] == [name]:
            return eval(compile(ast.Expression(node.value), name, "eval"), {"__builtins__": {}})
    raise AssertionError(f"no module-level {name}")


def _function(source: str, tree: ast.Module, name: str) -> str:
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return " ".join(ast.get_source_segment(source, node).split())


# ------------------------------------------------------------------ docs/benchmarks.md
def test_packed_documents_table():
    """Every cell of the packed-documents table is packed_attention.json's row, the targets
    all pass, and the two runs the page names are the file's."""
    data = _results("packed_attention.json")
    page = (REPO / "docs" / "benchmarks.md").read_text()
    start = page.index("| L | dtype | documents | work |")
    table = [l for l in page[start:].split("\n\n")[0].splitlines()][2:]
    assert len(table) == len(data["rows"]) == 3
    by = {(r["L"], r["dtype"]): r for r in data["rows"]}
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        r = by[(int(cells[0].rstrip("K")) * 1024, cells[1])]
        assert cells[2:] == [
            str(r["documents"]), f"{r['work_fraction']:.2f}",
            f"{r['unpacked']['time_s']:.1f}", f"{r['packed']['time_s']:.1f}",
            f"**{r['time_ratio']:.3f}**", f"{r['unpacked']['peak_mb']:.0f}",
            f"{r['packed']['peak_mb']:.0f}", f"**{r['peak_ratio']:.3f}**"], line
    assert all(t["status"] == "PASS" for t in data["targets"]) and len(data["targets"]) == 6
    text = _text("docs/benchmarks.md")
    assert "All six targets pass" in text
    (commit,) = {r["machine"]["git_commit"] for r in data["runs"]}
    argv = [" ".join(r["argv"]) for r in data["runs"]]
    assert argv == ["--lengths 32768,65536 --dtypes fp32 --fresh", "--lengths 32768 --dtypes bf16"]
    assert (f"in two runs one after the other at commit {commit} (`{argv[0]}`, then `{argv[1]}`"
            in text)


def _trainer_validation() -> tuple[int, str]:
    """(runs, '0.7-9.7%'): plan_validation.json's trainer runs, prediction over measured."""
    data = _results("plan_validation.json")
    rows = data["trainer_rows"]
    assert all(r["ok"] for r in rows) and data["trainer_all_within_tolerance"]
    over = [r["predicted_mb"] / r["measured_mb"] - 1 for r in rows]
    assert all(abs(o - r["error"]) < 1e-9 for o, r in zip(over, rows))
    assert min(over) > 0  # every prediction above its measurement: "above" is right
    return len(rows), _pct_range(over)


def _ulysses_row(path: str, length: int, first: str) -> str:
    """The Ulysses-against-DeepSpeed table's line for one file and length, from its rows."""
    rows = {r["method"]: r for r in _results(path)["rows"] if r["L"] == length}
    ours, one, ds = (rows[m] for m in ("ulysses_attn", "ulysses_attn@stages=1", "deepspeed_ulysses"))

    def t(r):
        sp = r["time_ms_spread"]
        return f"{r['time_ms'] / 1e3:.2f} s ({sp['min'] / 1e3:.2f}-{sp['max'] / 1e3:.2f})"
    paired = ours["time_ratio_vs_deepspeed_spread"]
    return (f"| {first} | {length // 1024}K | {t(ours)} | {t(one)} | {t(ds)} | "
            f"{paired['median']:.3f} ({paired['min']:.3f}-{paired['max']:.3f}), "
            f"{len(ours['time_ms_iters'])} rounds | "
            f"{ours['peak_mb']:.0f} / {one['peak_mb']:.0f} / {ds['peak_mb']:.0f} | "
            f"{max(ours['kernel_ms_per_rank']) / 1e3:.2f} / {max(ds['kernel_ms_per_rank']) / 1e3:.2f} s |")


def _ulysses_readme_claim(name: str, machine: str) -> str:
    """The README's Ulysses-against-DeepSpeed sentence for one file: the per-round medians at
    16K and 32K and the peak ratio at 16K (every kept round below DeepSpeed's is checked by
    test_ulysses_against_deepspeed_table over all of the file's rows)."""
    rows = {(r["method"], r["L"]): r for r in _results(name)["rows"]}
    s16, s32 = (rows[("ulysses_attn", n)]["time_ratio_vs_deepspeed_spread"] for n in (16384, 32768))
    peak = rows[("ulysses_attn", 16384)]["peak_mb"] / rows[("deepspeed_ulysses", 16384)]["peak_mb"]
    return (f"on {machine} | {s16['median']:.3f}x the time at 16K, {s32['median']:.3f}x at 32K "
            f"(per-round medians), {peak:.2f}x the peak memory per rank")


def test_ulysses_against_deepspeed_table():
    """Each line of the Ulysses / DeepSpeed table is its file's rows; the CPU and kernels it
    names are the file's record; ours is below DeepSpeed in every kept round."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    readme = _text("README.md")
    native = _results("attention_ulysses_deepspeed_epyc.json")["machine"]
    avx2 = _results("attention_ulysses_deepspeed_epyc_avx2.json")["machine"]
    xeon = _results("attention_ulysses_deepspeed_xeon.json")["machine"]
    assert avx2["cpu_description"] == native["cpu_description"]
    assert native["cpu_capability"] == "AVX512" and avx2["cpu_capability"] == "AVX2"
    assert native["cpu"] == "AMD EPYC" and "AVX-512 BF16" in native["cpu_description"]
    # the AMX Xeon of issue 29
    assert "AMX" in xeon["cpu_description"] and xeon["cpu_capability"] == "AVX512"

    def cpu(m):
        return f"{m['cpu_description']} ({m['cpu_capability']})"
    # the page's lines: each file's first line names its CPU, the next ones say "same"
    lines = [_ulysses_row("attention_ulysses_deepspeed_epyc.json", 16384, cpu(native)),
             _ulysses_row("attention_ulysses_deepspeed_epyc.json", 32768, "same"),
             _ulysses_row("attention_ulysses_deepspeed_epyc_avx2.json", 16384, "same (AVX2)"),
             _ulysses_row("attention_ulysses_deepspeed_xeon.json", 16384, cpu(xeon)),
             _ulysses_row("attention_ulysses_deepspeed_xeon.json", 32768, "same")]
    for name in ("attention_ulysses_deepspeed_epyc.json", "attention_ulysses_deepspeed_epyc_avx2.json",
                 "attention_ulysses_deepspeed_xeon.json"):
        for r in _results(name)["rows"]:
            if r["method"] == "ulysses_attn":
                assert r["time_ratio_vs_deepspeed_spread"]["max"] < 1, (name, r["L"])
    for line in lines:
        assert line in page, line
    for name, machine in (("attention_ulysses_deepspeed_epyc.json", "an AMD EPYC (AVX-512 BF16)"),
                          ("attention_ulysses_deepspeed_xeon.json", "an Intel Xeon with AMX")):
        claim = _ulysses_readme_claim(name, machine)
        assert claim in readme, claim


def test_sliding_window_table():
    """Every line of the sliding-window table is attention_sliding.json's pair of rows."""
    data = _results("attention_sliding.json")
    rows = {r["method"]: r for r in data["rows"]}
    page = (REPO / "docs" / "benchmarks.md").read_text()
    lines = [l for l in page[page.index("| method | global | sliding |"):].split("\n\n")[0]
             .splitlines()[2:]]
    assert len(lines) == len(rows) // 2 == 8, lines
    ratios = []
    for line in lines:
        m = line.strip("|").split("|")[0].strip()
        g, w = rows[m], rows[f"{m}@window=512"]
        assert line == (f"| {m} | {g['time_ms'] / 1e3:.2f} s | {w['time_ms'] / 1e3:.2f} s | "
                        f"{w['time_ratio_vs_global']:.3f} | {w['computed_fraction']:.4f} | "
                        f"{g['peak_mb']:.1f} / {w['peak_mb']:.1f} MB |"), line
        ratios.append(w["time_ratio_vs_global"])
    text = _text("docs/benchmarks.md")
    assert (f"costs {100 * min(ratios):.0f}-{100 * max(ratios):.0f}% of the time here") in text
    assert f"at commit {data['machine']['git_commit']}" in text


def test_trainer_figures():
    """The growths, peaks and step-time ratios the Trainer guide and the README give in words
    are hf_trainer.json's."""
    data = _results("hf_trainer.json")
    m = {(r["system"], r["seq_len"]): r for r in data["measured"]}
    g = data["growth_mb"]
    peak = lambda s, n: m[(s, n)]["peak_bytes"] / 2**20  # noqa: E731
    # ours over easy-context train's same setup (ours-untiled / ec-train-untiled, ...)
    ratio = lambda s, n: (m[(s, n)]["step_s"]  # noqa: E731
                          / m[(s.replace("ours", "ec-train"), n)]["step_s"])
    guide, readme = _text("docs/guides/trainer.md"), _text("README.md")
    untiled, maxlen, alst = (g[s]["32768"] for s in ("ours-untiled", "ours-maxlen",
                                                     "accelerate-ulysses"))
    assert (f"Our growth from 2K to 32K is {untiled:.0f} MB untiled and {maxlen:.0f} MB in "
            f"max-length mode, against {alst:.0f} MB") in guide
    assert (f"peak at 32K is {peak('ours-untiled', 32768):.0f} / {peak('ours-maxlen', 32768):.0f}"
            f" MB against {peak('accelerate-ulysses', 32768):.0f} MB") in guide
    assert (f"untiled {ratio('ours-untiled', 2048):.3f}x, {ratio('ours-untiled', 16384):.3f}x and "
            f"{ratio('ours-untiled', 32768):.3f}x at 2K, 16K and 32K, max-length mode "
            f"{ratio('ours-maxlen', 2048):.3f}x, {ratio('ours-maxlen', 16384):.3f}x and "
            f"{ratio('ours-maxlen', 32768):.3f}x") in guide
    alst_over = [m[("accelerate-ulysses", n)]["step_s"] / m[("ours-untiled", n)]["step_s"]
                 for n in (2048, 16384, 32768)]
    assert f"ALST takes {min(alst_over):.2f}-{max(alst_over):.2f}x our untiled step time" in guide
    assert (f"{maxlen:.0f} MB max-length, {untiled:.0f} MB untiled, against {alst:.0f} MB; step "
            f"{ratio('ours-maxlen', 32768):.3f}x / {ratio('ours-untiled', 32768):.3f}x") in readme
    assert all(t["result"] == "PASS" for t in data["targets"])


def test_trainer_2k_rounds_figures():
    """The 2K medians and spreads the Trainer guide gives in words, from the two round files."""
    def med(name):
        return {r["system"]: r for r in _results(name)["measured"]}

    def fig(rows, ours, theirs):
        a, b = rows[ours], rows[theirs]
        return (f"{a['step_s'] / b['step_s']:.3f}x", f"{a['step_s']:.2f}", f"{b['step_s']:.2f}",
                f"{a['step_s_min']:.2f}-{a['step_s_max']:.2f}",
                f"{b['step_s_min']:.2f}-{b['step_s_max']:.2f}")
    rounds, pair = med("hf_trainer_2k_repeats.json"), med("hf_trainer_2k_maxlen.json")
    u = fig(rounds, "ours-untiled", "ec-train-untiled")
    m = fig(rounds, "ours-maxlen", "ec-train-maxlen")
    p = fig(pair, "ours-maxlen", "ec-train-maxlen")
    guide = _text("docs/guides/trainer.md")
    assert (f"untiled {u[0]} ({u[1]} s against {u[2]} s; the rounds spread {u[3]} and {u[4]} s), "
            f"max-length mode {m[0]} ({m[1]} against {m[2]} s; {m[3]} and {m[4]} s), and the "
            f"pair alone {p[0]} ({p[1]} against {p[2]} s; {p[3]} and {p[4]} s)") in guide


def test_head_groups_tables():
    """Both head-group tables and the cost of one pass per KV head, from head_groups.json."""
    data = _results("head_groups.json")
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for r in data["measured"]:
        assert (f"| {r['method']} | {r['L'] // 1024}K | {r['kv_heads_per_pass']} | "
                f"{r['passes_per_layer']} | {r['time_s']:.2f} | {r['peak_mb']:.0f} |") in page, r
    plan: dict = {}
    for r in data["planned_gpu"]:
        plan.setdefault((r["model"], r["tokens_per_rank"]), {})[r["method"]] = \
            f"{r['kv_heads_per_pass']} of {r['kv_heads']}"
    for (model, tokens), v in plan.items():
        assert (f"| {model} | {tokens // 1024}K | {v['zigzag_ring_attn']} | {v['dist_flash_attn']}"
                f" | {v['allgather_attn']} |") in page
    by = {(r["method"], r["kv_heads_per_pass"]): r["time_s"] for r in data["measured"]}
    cost = [by[(m, 1)] / by[(m, 8)] for m in ("zigzag_ring_attn", "ring_attn")]
    assert f"{round(100 * min(cost) - 100)}-{round(100 * max(cost) - 100)}% more time" in _text(
        "docs/benchmarks.md")
    assert (f"1.0{round(100 * min(cost) - 100)}-1.0{round(100 * max(cost) - 100)}x the time"
            in " ".join((REPO / "easy_context/parallel/head_groups.py").read_text().split()))


def test_readme_documents_per_call_row():
    r = next(r for r in _results("documents_per_call.json")["rows"] if r["tokens"] == 131072)
    assert r["ranks"] == 2
    assert (f"| packed documents, per attention call, 128K tokens on 2 ranks | "
            f"{1e3 * r['before_s']:.1f} ms -> {1e6 * r['after_s']:.2f} us (the runs kept per "
            f"micro-batch) |") in _text("README.md")


def test_loss_memory_figures():
    d = _results("loss_memory.json")
    c, l = d["chunked"], d["logits"]
    assert (f"Chunked loss peak {c['peak_mb']:.0f} MB against {l['peak_mb']:.0f} MB through the "
            f"logits: **{d['memory_ratio_chunked_over_logits']:.3f}x** (target <= 0.1), the same "
            f"loss value, {c['time_s']:.1f} s against {l['time_s']:.1f} s for forward + backward; "
            f"measured with {d['chunk_size']}-row chunks at commit {d['machine']['git_commit']}"
            ) in _text("docs/benchmarks.md")
    assert d["loss_rel_diff"] == 0.0 and d["meets_target"]


def test_train_memory_table():
    d = _results("train_memory.json")
    by = {(r["mode"], r["kind"], r["n"], r["length"]): r for r in d["rows"]}

    def pk(key):
        return f"{by[key]['step_peak_mb']:.0f} MB" if by.get(key, {}).get("ok") else "-"
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for n in (8192, 16384, 32768):
        assert (f"| {n // 1024}K | {pk(('ours', 'full', 1, n))} | {pk(('ours', 'full', 2, n))} | "
                f"{pk(('plain', 'none', 1, n))} | {pk(('plain', 'hf_checkpointing', 1, n))} |"
                ) in page
    t = {x["target"]: x for x in d["targets"]}
    assert (f"At 32K: N=2 / N=1 = {t['T1']['ratio']:.2f} (target <= 0.6), ours / plain = "
            f"{t['T2']['ratio']:.3f} (target <= 0.15), activation memory 32K / 16K = "
            f"{t['T3']['ratio']:.2f} (target <= 2.1): all three pass") in _text("docs/benchmarks.md")
    assert all(x["result"] == "PASS" for x in t.values())


def test_readme_zigzag_row():
    r = next(r for r in _results("attention.json")["rows"]
             if (r["method"], r["L"], r["kv_heads"]) == ("zigzag_ring_attn", 16384, 8))
    assert (f"| zigzag ring attention, 2 ranks vs one process, 16K tokens, bf16 | "
            f"{r['time_ratio_vs_single']:.2f}x the time, {r['mem_ratio_vs_single']:.2f}x the peak "
            f"memory per rank |") in _text("README.md")


def _exchange_figures(names: tuple[str, ...]) -> tuple[list[str], list[float]]:
    """Per file and length (16K, 32K): 'ours against DeepSpeed' in ms, and their ratio."""
    figures, ratios = [], []
    for name in names:
        rows = {(r["contender"], r["L"]): r for r in _results(name)["rows"]}
        for length in (16384, 32768):
            ours, ds = rows[("ours", length)]["time_ms"], rows[("deepspeed", length)]["time_ms"]
            figures.append(f"{ours:.1f} against {ds:.1f}")
            ratios.append(ours / ds)
    return figures, ratios


def test_all_to_all_figures():
    """The exchanges alone: ours and DeepSpeed's medians at 16K and 32K from both files, and
    the ratios the page gives for them."""
    text = _text("docs/benchmarks.md")
    figures, ratios = _exchange_figures(("all_to_all.json", "all_to_all_avx2.json"))
    (o16, d16), (o32, d32) = (f.split(" against ") for f in figures[:2])
    assert (f"ours {o16} ms against DeepSpeed's {d16} ms at 16K and {o32} against {d32} ms at "
            f"32K (AVX2: {figures[2]}, {figures[3]} ms)") in text
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x now" in text
    assert _results("all_to_all_avx2.json")["machine"]["cpu_capability"] == "AVX2"
    # the same on the AMX Xeon, with the fused all_to_all_single beside them
    xeon = ("all_to_all_xeon.json", "all_to_all_xeon_avx2.json")
    assert all("AMX" in _results(name)["machine"]["cpu_description"] for name in xeon)
    assert _results(xeon[1])["machine"]["cpu_capability"] == "AVX2"
    figures, ratios = _exchange_figures(xeon)
    fused = [f"{r['time_ms']:.1f}" for r in sorted(_results(xeon[0])["rows"], key=lambda r: r["L"])
             if r["contender"] == "fused"]
    (o16, d16), (o32, d32) = (f.split(" against ") for f in figures[:2])
    text = " ".join(text.split())
    assert (f"ours {o16} against DeepSpeed's {d16} ms at 16K and {o32} against {d32} ms at 32K "
            f"(AVX2: {figures[2]}, {figures[3]} ms), {min(ratios):.2f}-{max(ratios):.2f}x; one "
            f"fused `all_to_all_single` of the same tensors (`fused`) took {fused[0]} and "
            f"{fused[1]} ms") in text


def test_maxlen_section_names_the_file_that_holds_predictions():
    """maxlen.json records no prediction for its ALST-comparison runs; the page says so and
    quotes plan_validation.json's trainer runs instead."""
    maxlen = _results("maxlen.json")
    assert not any("predict" in key for row in maxlen["alst"]["rows"] for key in row)
    n, fig = _trainer_validation()
    text = _text("docs/benchmarks.md")
    assert "The file records no planner prediction for these runs" in text
    assert (f"`benchmarks/results/plan_validation.json` (`trainer_rows`: in {n} of {n} runs "
            f"the prediction was {fig} above the measured peak") in text


def test_maxlen_ratio_and_fit_figures():
    """The 16K tiled/untiled pairs and the planned longest length (maxlen.json)."""
    ratio, fit = (_results("maxlen.json")[k] for k in ("ratio", "fit"))
    above = ratio["peak_above_baseline_mb"]
    steps = ratio["median_step_s"]
    pairs = ", ".join(f"{p:.2f}" for p in ratio["per_pair_time_ratios"])
    measured = max(fit["row"]["rank_peaks_bytes"]) / 2**20 - _results("maxlen.json")["rank_baseline_mb"]
    text = _text("docs/benchmarks.md")
    assert (f"peak above a rank's imports {above['ours-maxlen']:.1f} MB tiled against "
            f"{above['ours-untiled']:.1f} MB untiled ({ratio['peak_per_token_ratio']:.2f}x per "
            f"token), median step {steps['ours-maxlen']:.1f} s against {steps['ours-untiled']:.1f} s: "
            f"**{ratio['time_ratio']:.2f}x** (target <= 1.15; pairs {pairs})") in text
    assert (f"longest tiled length is {fit['tiled_longest_planned']:,} tokens") in text
    assert f"predicted {fit['tiled_predicted_mb']:.1f} MB above the imports" in text
    assert f"measured {measured:.1f} MB, inside the budget (step {fit['row']['step_s']:.0f} s)" in text
    assert measured <= fit["budget_above_baseline_mb"]


def test_demo_seeds_claims():
    """demo_seeds.json holds one run per seed and kernel set (so the page claims no repeat of
    a seed), and the generic-kernel row's figures are the file's."""
    runs = _results("demo_seeds.json")["runs"]
    keys = [(r["seed"], r.get("kernels")) for r in runs]
    assert len(keys) == len(set(keys)) == 6
    text = _text("docs/benchmarks.md")
    assert "run twice" not in text
    assert ("The file holds one run of each seed on these kernels, so it does not show whether "
            "a seed's figures repeat") in text
    (generic,) = [r for r in runs if r.get("kernels") == "default"]
    minutes, seconds = divmod(round(generic["wall_s"]), 60)
    assert (f"gave {generic['needle_4x_before']:.0%} before, {generic['needle_4x_after']:.0%} "
            f"after, {generic['digits_4x_before']:.0%} -> {generic['digits_4x_after']:.0%} of "
            f"digits, {minutes} min {seconds} s wall") in text
    assert "AMX" in generic["machine"]["cpu_description"]
    assert f"made on the AMX Xeon at commit {generic['machine']['git_commit']}" in text


def test_demo_figures_in_the_readme():
    """The README's demo figures are the native-kernel seeds of demo_seeds.json."""
    agg = _results("demo_seeds.json")["aggregate"]
    walls = [r["wall_s"] for r in _results("demo_seeds.json")["runs"] if r["kernels"] == "native"]
    b, a = agg["needle_4x_before"], agg["needle_4x_after"]
    before = f"{b['min']:.0%}-{b['max']:.0%}".replace("%-", "-")
    after = f"{a['min']:.0%}-{a['max']:.0%}".replace("%-", "-")
    readme = _text("README.md")
    assert (f"went from {before} to {after} over five seeds (median {a['median']:.0%}), in about "
            f"{round(statistics.median(walls) / 60)} minutes each") in readme
    assert f"| {before} before, {after} after (five seeds, median {a['median']:.0%}) |" in readme
    assert agg["seeds"] == [0, 1, 2, 3, 4] and all(agg["targets"].values())


def test_demo_table_and_figures():
    """The demo table's native rows and the figures around it, from demo_seeds.json."""
    data = _results("demo_seeds.json")
    nat = [r for r in data["runs"] if r["kernels"] == "native"]
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for r in nat:
        m, sec = divmod(round(r["wall_s"]), 60)
        line = (f"| {r['seed']} | {r['needle_4x_before']:.0%} | {r['needle_4x_after']:.0%} | "
                f"{r['needle_first_before']:.0%} -> {r['needle_first_after']:.0%} | "
                f"{r['digits_4x_before']:.0%} -> {r['digits_4x_after']:.0%} | "
                f"{r['ppl_4x_before']:.3f} -> {r['ppl_4x_after']:.3f} | {m} min {sec} s |")
        assert line in page, line
    agg, text = data["aggregate"], _text("docs/benchmarks.md")
    a, b = agg["needle_4x_after"], agg["needle_4x_before"]
    assert (f"median {a['median']:.0%}, worst {a['worst']:.0%} (targets 80% and 60%: met); "
            f"before it {b['min']:.0%}-{b['max']:.0%}".replace("%-", "-")) in text
    limit = [r["seed"] for r in nat if r["needle_4x_before"] == 0.2]  # the target's bound
    if limit:
        seeds = " and ".join(map(str, limit))
        assert f"(target <= 20%: met, seed{'s' if len(limit) > 1 else ''} {seeds} at the limit)" in text
    idle = sorted(r["idle_estimate_s"] for r in nat)
    lo, hi = (divmod(round(x), 60) for x in (idle[0], idle[-1]))
    assert f"is {lo[0]} min {lo[1]} s to {hi[0]} min {hi[1]} s (target <= 10 min: met)" in text
    build = [r["phases"]["build"]["wall_s"] for r in nat]
    assert f"corpora ({int(min(build))}-{math.ceil(max(build))} s)" in text
    k1024 = [r["needle_by_length_before"]["1024"] for r in nat]
    far = [v for r in nat for k, v in r["needle_by_length_before"].items() if int(k) >= 1280]
    after = [v for r in nat for v in r["needle_by_length_after"].values()]
    assert (f"finds {min(k1024):.0%}-{max(k1024):.0%} of the needles at 1024 tokens and "
            f"{min(far):.0%}-{max(far):.0%} from 1280 on; after it, {min(after):.0%}-{max(after):.0%} "
            "at every length in each seed").replace("%-", "-") in text
    # the five seeds: one call, which records HEAD as each seed ends (a commit of documentation
    # during the call splits them; test_results_fresh checks the code under MEASURES)
    by_commit = {}
    for r in sorted(nat, key=lambda r: r["seed"]):
        by_commit.setdefault(r["machine"]["git_commit"], []).append(r["seed"])
    named = [f"{c} (seed {s[0]})" if len(s) == 1 else f"{c} (seeds {s[0]}-{s[-1]})"
             for c, s in by_commit.items()]
    if len(named) == 1:
        assert f"measured at commit {next(iter(by_commit))}" in text
    else:
        assert f"measured at commits {' and '.join(named)}" in text
    assert all(r["machine"]["git_commit"] for r in data["runs"])


# ------------------------------------------------------------ planner guide and README
def test_planner_guide_and_readme_quote_the_trainer_validation():
    n, fig = _trainer_validation()
    planner = _text("docs/guides/planner.md")
    assert f"in {n} of {n} runs the prediction was {fig} above the measured peak" in planner
    measured = (REPO / "README.md").read_text().split("## Measured", 1)[1].split("\n## ", 1)[0]
    (row,) = [l for l in measured.splitlines() if l.startswith("| planner:")]
    assert f"predictions {fig} above the measured peaks of {n} `easy-context train` runs" in row
    assert "`benchmarks/results/plan_validation.json`" in row


def test_planner_guide_step_validation():
    """The 13 step configurations of plan_validation.json (``rows``): worst |error| as a whole
    percent, rounded up (a bound)."""
    data = _results("plan_validation.json")
    worst = max(abs(r["error"]) for r in data["rows"])
    assert abs(worst - data["max_abs_error"]) < 1e-12
    assert (f"within {math.ceil(100 * worst)}% of measured CPU training steps for a tiny Llama "
            f"in {len(data['rows'])} configurations (`rows` of "
            "`benchmarks/results/plan_validation.json`)") in _text("docs/guides/planner.md")


def test_planner_guide_lora_validation():
    """lora_memory.json: the LoRA steps' worst |error| rounded up to 0.1% (a bound), and the
    range of predictions below measured."""
    data = _results("lora_memory.json")
    errors = [r["lora"]["error"] for r in data["rows"]]
    assert all(e < 0 for e in errors)  # every prediction below its measurement
    worst = max(abs(e) for e in errors)
    bound = math.ceil(1000 * worst) / 10
    assert (f"LoRA steps of a tiny Llama on CPU peaked within {bound}% of these predictions "
            f"({len(errors)} configurations, each prediction {_pct_range([-e for e in errors])} "
            "below the measured peak; `benchmarks/results/lora_memory.json`)") \
        in _text("docs/guides/planner.md")


# ------------------------------------------------------- bounds the tests assert, quoted
def test_training_guide_quotes_the_sharded_loading_bound():
    """tests/dist/test_sharded_loading.py: on 2 ranks, FSDP setup's peak per rank at most half
    the model plus its largest tensor plus 16 MB; the model size and that bound as the
    training guide gives them."""
    source, tree = _module("tests/dist/test_sharded_loading.py")
    m, largest = _constant(tree, "M_MB"), _constant(tree, "L_MB")
    body = _function(source, tree, "test_fsdp_rank_memory_is_half_the_model")
    assert "assert peak <= 0.5 * M_MB + L_MB + 16, r" in body
    assert "DistPool(2," in source
    bound = 0.5 * m + largest + 16
    assert bound < m
    assert (f"For a {m:.0f} MB (fp32) model on 2 ranks, `tests/dist/test_sharded_loading.py` "
            f"asserts that FSDP setup raises no rank's peak by more than half the model plus its "
            f"largest tensor plus 16 MB ({bound:.0f} MB), less than the whole model.") \
        in _text("docs/guides/training.md")


def test_max_length_guide_quotes_the_asserted_tolerances():
    """tests/dist/test_maxlen.py's TOL on loss and gradients, test_train_maxlen.py's loss
    tolerances, and no measured figure that no file holds."""
    source, tree = _module("tests/dist/test_maxlen.py")
    tol = _constant(tree, "TOL")
    assert "le <= TOL and ge <= TOL" in _function(source, tree, "_assert")
    assert all(f"({pool}, " in source for pool in ("dist1", "dist2", "dist4"))
    train_source, train_tree = _module("tests/dist/test_train_maxlen.py")
    same = _function(train_source, train_tree, "_same")
    assert "abs(got[0] - want[0]) <= 1e-6 * abs(want[0])" in same
    assert "abs(g - w) <= 1e-4 * abs(w)" in same
    assert "abs(norms[0][0] - norms[1][0]) <= 1e-5 * norms[1][0]" in same
    text = _text("docs/guides/max-length.md")
    assert "measured ~" not in text
    assert (f"tests/dist/test_maxlen.py asserts, in fp32, the loss within {tol:.0e} relative "
            f"and each parameter's gradient within {tol:.0e} of its largest |gradient|") \
        .replace("e-05", "e-5") in text
    assert ("first-step loss is within 1e-6 relative of the untiled trainer's, later steps "
            "within 1e-4, and its first-step gradient norm within 1e-5") in text


def test_needle_test_margin_figures():
    """The trained needle test's recorded margin: the page and the test's docstring quote the
    runs' ranges and the commit, and the floors the test asserts sit below the worst run."""
    data = _results("needle_test_margin.json")
    rows = data["rows"]
    digits = [r["token_accuracy"] for r in rows]
    exact = [r["exact"] for r in rows]
    assert min(digits) == data["worst_token_accuracy"] and min(exact) == data["worst_exact"]
    ranges = (f"digits right {min(digits):.2f}-{max(digits):.2f}, "
              f"exact {min(exact):.2f}-{max(exact):.2f}")
    page = _text("docs/benchmarks.md")
    assert f"was trained {len(rows)} times" in page
    assert f"on the AMX Xeon at commit {data['machine']['git_commit']}" in page
    assert "AMX" in data["machine"]["cpu_description"]
    assert (f"Answer digits right {min(digits):.2f}-{max(digits):.2f}, exact match "
            f"{min(exact):.2f}-{max(exact):.2f}") in page
    generic = sorted(r["seed"] for r in rows if r["ATEN_CPU_CAPABILITY"] == "default")
    assert f"seeds {' and '.join(map(str, generic))} with `ATEN_CPU_CAPABILITY=default`" in page
    source, tree = _module("tests/unit/test_eval_needle.py")
    test = _function(source, tree, "test_trained_tiny_model_beats_chance")
    assert f"the worst of the {len(rows)} runs" in test and ranges in test
    # the floors as the test asserts them, below the worst recorded run, and as the page quotes them
    floors = [float(re.search(rf'scores\["{key}"\] >= ([0-9.]+)', test).group(1))
              for key in ("token_accuracy", "exact")]
    assert min(digits) > floors[0] and min(exact) > floors[1]
    assert f"the test asserts >= {floors[0]} and >= {floors[1]}" in page


def _maxlen_alst_lines() -> list[str]:
    """The page's ALST table, rendered from maxlen.json's `alst` part: peak / step per length
    and system, then the peak growth rows (bold where a max-length setting is at or below
    ALST's)."""
    part = _results("maxlen.json")["alst"]
    systems = ("alst", "ours-untiled", "ours-maxlen", "ours-maxlen-frugal")
    cell = {(r["system"], r["seq_len"]): r for r in part["rows"] if r["ok"]}
    lengths = sorted({L for _, L in cell})
    lines = ["| " + " | ".join(
        [f"{L // 1024}K"] + [f"{max(cell[(s, L)]['rank_peaks_bytes']) / 2**20:.0f} MB / "
                             f"{cell[(s, L)]['step_s']:.1f} s" for s in systems]) + " |"
        for L in lengths]

    def growth_row(label, values):
        out = []
        for s in systems:
            text = f"{values[s]:.1f} MB"
            out.append(f"**{text}**" if s.startswith("ours-maxlen") and values[s] <= values["alst"]
                       else text)
        return f"| {label} | " + " | ".join(out) + " |"
    first, mid, last = lengths
    lines.append(growth_row(f"growth {first // 1024}K -> {mid // 1024}K",
                            {s: part["growth_mb"][s][str(mid)] for s in systems}))
    lines.append(growth_row(f"growth {first // 1024}K -> {last // 1024}K",
                            {s: part["growth_mb"][s][str(last)] for s in systems}))
    lines.append(growth_row(f"growth {mid // 1024}K -> {last // 1024}K",
                            part["growth_between_longest_mb"]))
    return lines


def _maxlen_shape_lines(name: str) -> list[str]:
    """The page's table for another shape (maxlen.json `shapes`): peak / step per length and
    system, then the growth rows (bold where a max-length setting is at or below ALST's;
    the same figures as the part's growth_mb when the run finished)."""
    part = _results("maxlen.json")["shapes"][name]
    systems = [s for s in ("alst", "ours-maxlen", "ours-maxlen-frugal")
               if any(r["system"] == s for r in part["rows"])]
    cell = {(r["system"], r["seq_len"]): r for r in part["rows"] if r["ok"]}
    lengths = sorted({L for _, L in cell})
    lines = ["| " + " | ".join(
        [f"{L // 1024}K"] + [f"{max(cell[(s, L)]['rank_peaks_bytes']) / 2**20:.0f} MB / "
                             f"{cell[(s, L)]['step_s']:.0f} s" if (s, L) in cell else "-"
                             for s in systems]) + " |" for L in lengths]
    peak = {k: max(r["rank_peaks_bytes"]) / 2**20 for k, r in cell.items()}
    for L in lengths[1:]:  # from the rows themselves: a run stopped part-way has no growth_mb
        g = {s: peak[(s, L)] - peak[(s, lengths[0])] if (s, L) in peak and
             (s, lengths[0]) in peak else None for s in systems}
        out = []
        for s in systems:
            if g[s] is None:
                out.append("-")
                continue
            text = f"{g[s]:.1f} MB"
            better = s != "alst" and g["alst"] is not None and g[s] <= g["alst"]
            out.append(f"**{text}**" if better else text)
        lines.append(f"| growth {lengths[0] // 1024}K -> {L // 1024}K | " + " | ".join(out) + " |")
    return lines


@pytest.mark.parametrize("name", ["gemma3-tiny", "deepseek3-tiny"])
def test_maxlen_shape_tables(name):
    """The benchmarks page's tables for the Gemma 3 and DeepSeek-V3 shapes are maxlen.json's
    `shapes` rows, with the load averages the runs recorded."""
    shapes = _results("maxlen.json").get("shapes", {})
    if name not in shapes:
        pytest.skip(f"maxlen.json has no {name} rows")
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for line in _maxlen_shape_lines(name):
        assert line in page, line
    loads = [r["load_average_after"][0] for r in shapes[name]["rows"]]
    assert f"`{name}`: 1-minute load average {min(loads):.1f}-{max(loads):.1f}" in page
    # the prose below the tables: our peak below ALST's at every length, our growth above
    peak = {(r["system"], r["seq_len"]): max(r["rank_peaks_bytes"]) for r in shapes[name]["rows"]
            if r["ok"]}
    lengths = sorted({L for _, L in peak})
    g = shapes[name]["growth_between_longest_mb"]
    systems = [s for s in ("alst", "ours-maxlen", "ours-maxlen-frugal") if s in g]
    assert ("| growth 16K -> 32K | " + " | ".join(f"{g[s]:.1f} MB" for s in systems)
            + " |") in page
    # "max-length mode's peak is below ALST's at every length, and from 16K to 32K it grows
    # less"; its growth from 2K is at or below ALST's on Gemma 3 (16K and 32K), on
    # DeepSeek-V3 at 32K only
    assert "On both shapes max-length mode's peak is below ALST's at every length" in page
    assert all(peak[("ours-maxlen", L)] < peak[("alst", L)] for L in lengths)
    assert g["ours-maxlen"] < g["alst"]
    growth = shapes[name]["growth_mb"]
    at_or_below = [L for L in growth["alst"] if growth["ours-maxlen"][L] <= growth["alst"][L]]
    assert at_or_below == (["16384", "32768"] if name == "gemma3-tiny" else ["32768"]), \
        at_or_below


def test_maxlen_alst_table_and_readme_row():
    """The max-length / ALST table on the benchmarks page and the README's growth figures are
    maxlen.json's `alst` rows, every run of which succeeded."""
    part = _results("maxlen.json")["alst"]
    assert all(r["ok"] for r in part["rows"])
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for line in _maxlen_alst_lines():
        assert line in page, line
    g = part["growth_mb"]
    assert (f"| max-length mode vs DeepSpeed ALST, peak growth from 2K to 32K tokens | "
            f"{g['ours-maxlen']['32768']:.1f} MB (frugal setting {g['ours-maxlen-frugal']['32768']:.1f} MB) "
            f"against {g['alst']['32768']:.1f} MB | `benchmarks/results/maxlen.json` |") in _text("README.md")
    # the figures the prose around the table repeats
    text = _text("docs/benchmarks.md")
    peak = {(r["system"], r["seq_len"]): max(r["rank_peaks_bytes"]) / 2**20 for r in part["rows"]}
    step = {(r["system"], r["seq_len"]): r["step_s"] for r in part["rows"]}
    assert (f"{step[('ours-maxlen', 32768)]:.1f} against {step[('alst', 32768)]:.1f} s at 32K") in text
    assert all(step[(s, L)] < step[("alst", L)] for s in ("ours-untiled", "ours-maxlen", "ours-maxlen-frugal")
               for L in (16384, 32768))  # "each of our runs is faster at 16K and 32K"
    assert all(peak[(s, L)] < peak[("alst", L)] for s in ("ours-maxlen", "ours-maxlen-frugal")
               for L in (2048, 16384, 32768))  # "both max-length settings' peaks are lower"
    f16, f32, m16, m32, a16, a32 = (g[s][L] for s in ("ours-maxlen-frugal", "ours-maxlen", "alst")
                                    for L in ("16384", "32768"))
    assert (f"({f16:.1f} against {a16:.1f} MB to 16K, a thin margin; {f32:.1f} against {a32:.1f} MB "
            f"to 32K); max-length mode's is below at 32K ({m32:.1f} against {a32:.1f} MB) but not at "
            f"16K ({m16:.1f} against {a16:.1f})") in text
    assert f16 <= a16 and f32 <= a32 and m32 <= a32 and m16 > a16
    floor = peak[("alst", 2048)] - peak[("ours-maxlen", 2048)]
    assert f"a floor at 2K {floor:.0f} MB above max-length mode's" in text
    fit = _results("maxlen.json")["fit"]
    assert f"({fit['tiled_longest_planned'] / fit['untiled_length']:.1f}x as long;" in text


def test_prepare_data_figures():
    """The Data paragraph and the README's prepare-data row are prepare_data.json's medians."""
    data = _results("prepare_data.json")
    res = data["results"]
    assert data["same_packed_ids"] and data["machine"]["git_commit"]
    assert "AMX" in data["machine"]["cpu_description"]  # "on the AMX Xeon"
    tokens = res["ours"]["tokens"]
    assert all(r["tokens"] == tokens for v in res.values() for r in v["runs"])

    def rate(v):
        return f"{res[v]['median_tokens_per_s'] / 1e6:.2f}M tokens/s"
    per_repeat = data["ratio_per_repeat"]["ours"]
    page = _text("docs/benchmarks.md")
    assert (f"Tokenizing and packing a generated {data['corpus']['characters'] / 1e6:.0f}M-character "
            f"corpus ({tokens / 1e6:.1f}M tokens, {data['vocab_size'] // 1024}K-token BPE, windows of "
            f"{data['seq_length'] + 1}) with {data['num_proc']} workers") in page
    assert (f"{rate('ours')} against {rate('baseline')} for `datasets.map` plus itertools packing"
            ) in page
    assert (f"{data['ratio_ours_over_baseline']:.1f}x between medians of {data['repeats']} runs "
            f"each, {min(per_repeat):.1f}x-{max(per_repeat):.1f}x within each repeat; `--streaming` "
            f"{rate('ours_streaming')} ({data['ratio_ours_streaming_over_baseline']:.1f}x)") in page
    assert f"at commit {data['machine']['git_commit']}" in page
    assert (f"| prepare-data, tokenize and pack {tokens / 1e6:.1f}M tokens | "
            f"{data['ratio_ours_over_baseline']:.1f}x `datasets.map` with itertools packing |"
            ) in _text("README.md")


def test_planner_guide_trainer_growth():
    """The planner guide's range for the predicted growth between lengths (``trainer_growth``)
    and the commit of the trainer runs."""
    data = _results("plan_validation.json")
    growth = data["trainer_growth"]
    errors = [g["error"] for g in growth]
    measured = [g["measured_growth_mb"] for g in growth]
    text = _text("docs/guides/planner.md")
    assert (f"-{-100 * min(errors):.0f}% to +{100 * max(errors):.0f}% over its {len(growth)} steps "
            f"of {min(measured):.1f}-{max(measured):.1f} MB") in text
    assert (f"all {len(data['trainer_rows'])} runs in one") in text
    assert f"at commit {data['trainer_machine']['git_commit']} on the same Xeon" in text
    assert "AMX" in data["trainer_machine"]["cpu_description"]


def test_cuda_page_names_the_gpu_files_commits_and_staleness():
    """The H200 files are older than code they measure (no GPU to re-run them): the CUDA page
    names each file's commit and, while STALE.json lists any of them, points there."""
    text = _text("docs/cuda.md")
    stale = _results("STALE.json")
    by_commit = {}
    for f in sorted(RESULTS.glob("gpu_check_h200_*.json")):
        by_commit.setdefault(_results(f.name)["machine"]["git_commit"], []).append(f.stem)
        if f.name in stale:
            assert "STALE.json" in text
    for commit, stems in by_commit.items():
        assert f"{commit} ({', '.join(stems)})" in text, (commit, stems)


def test_loss_chunks_table():
    """docs/benchmarks.md's loss-chunks table and its ratio sentence are the results file's."""
    d = _results("loss_chunks.json")
    page = _text("docs/benchmarks.md")
    for r in d["rows"]:
        t = r["time_ratio_to_rows_130_product"]
        assert (f"| {r['contender']} | {r['chunks']} | {r['time_s']['median']:.2f} | "
                f"{t['median']:.3f}x ({t['min']:.3f}-{t['max']:.3f}) |") in page
    rows = {r["contender"]: r for r in d["rows"]}
    ratio = rows["rows-2048-gemm"]["time_ratio_to_rows_130_product"]["median"]
    assert f"2,048-row chunks take {ratio:.2f}x the time of 130-row ones here" in page
    worst = max(r["max_rel_error_to_rows_130_product"] for r in d["rows"])
    assert f"agree within {worst:.1e} relative" in page and worst < 1e-5
    assert f"rounds at commit {d['machine']['git_commit']}" in page


def test_hybrid_table():
    """docs/benchmarks.md's hybrid-model table and growth sentence are the results file's."""
    d = _results("hybrid.json")
    page = _text("docs/benchmarks.md")
    for method in ("zigzag_ring_attn", "ulysses_attn"):
        for length in ("16384", "32768"):
            r, ref = d["runs"][method][length], d["runs"]["local"][length]
            assert (f"| {method} | {int(length):,} | {r['step_s']:.1f} ({ref['step_s']:.1f}) | "
                    f"{r['step_ratio_to_one_process']:.2f}x | "
                    f"{max(r['peak_rise_mb_per_rank']):.0f} ({ref['peak_rise_bytes'] / 2**20:.0f}) | "
                    f"{100 * r['exchange_share']:.2f}% ({100 * r['exchange_share_with_wait']:.1f}%) | "
                    f"{r['loss_rel_error']:.1e} / {r['grad_max_rel_error']:.1e} |") in page
    g = d["growth"]
    assert (f"**{g['zigzag_ring_attn']['growth_ratio']:.3f}x** and "
            f"**{g['ulysses_attn']['growth_ratio']:.3f}x** (target <= 0.55x") in page
    assert f"at commit {d['machine']['git_commit']} (`benchmarks/results/hybrid.json`" in page
    passed = all(t["result"] == "PASS" for t in d["targets"])
    assert ("Every target passes" in page) == passed
    assert f"The run took {d['total_s']:.0f} s" in page


def test_vlm_video_figures():
    """docs/guides/vision-language.md's long-video table and ratios are vlm_video.json's."""
    data = _results("vlm_video.json")
    (one,), sp = data["runs"][0]["ranks"], data["runs"][1]["ranks"]
    page = (REPO / "docs" / "guides" / "vision-language.md").read_text()
    start = page.index("| | step peak above the start (MB) |")
    rows = page[start:].split("\n\n")[0].splitlines()[2:]
    want = [one, *sp]
    assert len(rows) == len(want) == 3
    for line, r in zip(rows, want):
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        assert cells == [f"{r['step_peak_mb']:.0f}", f"{r['step_cpu_s']:.1f}",
                         f"{r['step_s']:.1f}", str(r["frames_encoded"]), f"{r['loss']:.6f}"], line
    text = _text("docs/guides/vision-language.md")
    summary = data["summary"]
    assert (f"peaks at {summary['peak_ratio_sp2_over_one']:.2f}x the one process's memory and "
            f"does {summary['step_cpu_s_ratio_sp2_over_one']:.2f}x its work (CPU time), in "
            f"{summary['step_s_ratio_sp2_over_one']:.2f}x its wall time") in text
    assert summary["loss_rel_diff"] == 0.0 and "the same to the last digit" in text
    assert f"{data['tokens']:,} tokens" in text and f"video of {one['video_steps']}" in text


def test_sliding_layer_table():
    """The 1K-window table is sliding.json's rows, the bytes its traffic, and the target's
    verdict is the file's."""
    data = _results("sliding.json")
    rows = {r["method"]: r for r in data["rows"]}
    page = (REPO / "docs" / "benchmarks.md").read_text()
    lines = page[page.index("| method | global | sliding (window 1K) |"):].split("\n\n")[0] \
        .splitlines()[2:]
    assert len(lines) == len(rows) // 2 == 3, lines
    for line in lines:
        m = line.strip("|").split("|")[0].strip()
        g, w = rows[m], rows[f"{m}@window=1024"]
        sent = "-"
        if m in data["traffic"]:
            t = data["traffic"][m]["window"]
            sent = (f"{(t['global_forward_bytes'] + t['global_backward_bytes']) / 2**20:.1f} / "
                    f"{(t['forward_bytes'] + t['backward_bytes']) / 2**20:.2f} MiB")
        assert line == (f"| {m} | {g['time_ms'] / 1e3:.2f} s | {w['time_ms'] / 1e3:.2f} s | "
                        f"{w['time_ratio_vs_global']:.3f} | {w['computed_fraction']:.4f} | "
                        f"{sent} |"), line
    target = data["sliding_target"]
    text = _text("docs/benchmarks.md")
    zig = [rows[m]["time_ms_iters"] for m in ("zigzag_ring_attn@window=1024", "zigzag_ring_attn")]
    rounds = " and ".join(f"{w / g:.3f}x" for w, g in zip(*zig))
    assert f"zigzag's sliding layer took {rounds} of its global one" in text
    cpu = data["cpu_ratio_vs_global"]
    assert (f"is {cpu['zigzag_ring_attn']['process_cpu']:.3f} for zigzag and "
            f"{cpu['ring_attn']['process_cpu']:.3f} for the ring") in text
    assert f"{target['value']:.3f}x against the 0.35x target ({target['status']})" in text
    assert f"at commit {data['machine']['git_commit']} (`benchmarks/results/sliding.json`)" in text
