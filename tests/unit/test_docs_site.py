"""The documentation site builds with every warning an error (``mkdocs build --strict``: a
broken link or anchor, a page left out of the navigation, an API name that does not resolve),
and its API reference holds the public names. Its code blocks run in tests/dist/test_readme.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import easy_context

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict_with_the_public_api(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(site)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr[-3000:]
    api = re.sub(r"<[^>]+>", " ", (site / "api" / "index.html").read_text())
    missing = [name for name in easy_context.__all__ if name not in api]
    assert not missing, f"public names not in the API reference: {missing}"
    for page in (REPO / "docs").rglob("*.md"):  # every page rendered
        rel = page.relative_to(REPO / "docs").with_suffix("")
        out = site / (rel.parent if rel.name == "index" else rel) / "index.html"
        assert out.is_file(), page


def test_the_planner_guide_shows_the_generated_tables():
    """docs/guides/planner.md quotes benchmarks/results/plan_table.md whole (regenerate both
    with `easy-context plan --report table --output benchmarks/results/plan_table.md`)."""
    rows = [l for l in (REPO / "benchmarks" / "results" / "plan_table.md").read_text().splitlines()
            if l.startswith("|")]
    page = [l for l in (REPO / "docs" / "guides" / "planner.md").read_text().splitlines()
            if l.startswith("|")]
    assert len(rows) > 40 and page[:len(rows)] == rows


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def _contains_run(page: list[str], rows: list[str]) -> bool:
    return any(page[i:i + len(rows)] == rows for i in range(len(page) - len(rows) + 1))


def test_the_trainer_tables_are_the_benchmark_files():
    """benchmarks/results/hf_trainer*.md are what benchmarks/hf_trainer.py makes of their JSON
    files (`--table-only --output NAME` regenerates one), and the Trainer guide quotes each
    whole, the README the main one."""
    sys.path.insert(0, str(REPO))
    from benchmarks import hf_trainer

    guide = _table_rows((REPO / "docs" / "guides" / "trainer.md").read_text())
    readme = _table_rows((REPO / "README.md").read_text())
    for name in ("hf_trainer", "hf_trainer_2k_repeats", "hf_trainer_2k_maxlen"):
        payload = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())
        stored = (REPO / "benchmarks" / "results" / f"{name}.md").read_text()
        assert hf_trainer.table(payload) == stored, f"{name}.md is not its JSON's table"
        rows = _table_rows(stored)
        assert len(rows) > 3 and _contains_run(guide, rows), f"docs/guides/trainer.md lacks {name}.md"
    assert _contains_run(readme, _table_rows(
        (REPO / "benchmarks" / "results" / "hf_trainer.md").read_text())), "README lacks hf_trainer.md"


def test_the_generation_table_is_the_benchmark_file():
    """benchmarks/results/generate.md is what benchmarks/generate.py makes of its JSON, the
    generation guide quotes it whole, and the figures the guide, the benchmarks page and the
    README give in words are that file's."""
    sys.path.insert(0, str(REPO))
    from benchmarks import generate

    payload = json.loads((REPO / "benchmarks" / "results" / "generate.json").read_text())
    stored = (REPO / "benchmarks" / "results" / "generate.md").read_text()
    assert generate.table(payload) == stored
    guide = (REPO / "docs" / "guides" / "generation.md").read_text()
    assert _contains_run(_table_rows(guide), _table_rows(stored))
    ours = {r["length"]: r for r in payload["measured"] if r["system"] == "ours-2-ranks"}
    cache, decode = f"{ours[32768]['cache_ratio']}x", f"{ours[32768]['decode_ratio']}x"
    for page in ("docs/guides/generation.md", "docs/benchmarks.md", "README.md"):
        text = (REPO / page).read_text()
        assert cache in text and decode in text, page
    assert payload["tokens_equal"] is True
    # the guide's words on decode at 16K and on prefill at both lengths
    one = {r["length"]: r for r in payload["measured"] if r["system"] == "transformers-1-process"}
    assert f"{ours[16384]['decode_ratio']:.3f}x at 16K" in guide
    text = " ".join(guide.split())
    assert (f"({ours[32768]['prefill_s']:.1f} s against {one[32768]['prefill_s']:.1f} s at 32K, "
            f"{ours[16384]['prefill_s']:.1f} s against {one[16384]['prefill_s']:.1f} s at 16K)") in text


def test_the_gpu_table_is_the_h200_result_files():
    """docs/cuda.md quotes benchmarks/results/gpu_check_h200.md whole, and that table is what
    benchmarks/gpu_check_table.py makes of the H200 result files."""
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_check_table

    files = [REPO / "benchmarks" / "results" / n for n in gpu_check_table.DEFAULT]
    made = gpu_check_table.table(gpu_check_table.load(files))
    assert made == (REPO / "benchmarks" / "results" / "gpu_check_h200.md").read_text()
    assert _contains_run(_table_rows((REPO / "docs" / "cuda.md").read_text()), _table_rows(made))
    # the figures the text around it gives in words
    text = (REPO / "docs" / "cuda.md").read_text()
    first, fix, cudnn = (json.loads(f.read_text())["sections"] for f in
                         (files[0], files[2], files[3]))
    assert f"FA2, {fix['attention']['easy_context']['tflops_per_s']:.0f} TFLOP/s" in text
    assert f"picks cuDNN ({fix['attention']['torch_sdpa']['tflops_per_s']:.0f})" in text
    before, after = (s["train"]["steps"][0] for s in (first, cudnn))
    assert before["L"] == after["L"] == 131072
    assert f"from {before['forward_backward_s']:.1f} s to {after['forward_backward_s']:.1f} s" in text
    assert f"at {first['train']['max_length_mode']['measured_over_predicted']}x" in text
    worst = max(r["peak_over_planned"] for r in fix["engine"]["full_width"]["rows"] if "loss" in r)
    assert f"up to {worst:.1f}x" in text
    att = cudnn["attention"]
    assert (f"{att['easy_context']['tflops_per_s']:.0f} TFLOP/s (torch's cuDNN op behind our "
            f"kernel; torch SDPA {att['torch_sdpa']['tflops_per_s']:.0f})") in \
        (REPO / "README.md").read_text()


def test_the_attention_table_is_its_results_file():
    """Every cell of the methods table on the benchmarks page is attention.json's row, rounded
    as shown: 16K and 32K time over the single process, peak memory over it and kernel
    imbalance at 16K (eight query and KV heads)."""
    rows = json.loads((REPO / "benchmarks" / "results" / "attention.json").read_text())["rows"]
    by = {(r["method"], r["L"]): r for r in rows if r["kv_heads"] == r["heads"]}
    names = {"usp_attn (ring_degree 1)": "usp_attn",
             "usp_attn (ring_degree 2)": "usp_attn[ring_degree=2]"}
    page = (REPO / "docs" / "benchmarks.md").read_text()
    start = page.index("| method | L = 16K time x single")
    table = _table_rows(page[start:])[2:]
    table = table[:next((i for i, r in enumerate(table) if r.startswith("| target")), len(table))]
    assert len(table) == 8, table
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        method = names.get(cells[0], cells[0])
        r16, r32 = by[(method, 16384)], by[(method, 32768)]
        assert cells[1:] == [f"{r16['time_ratio_vs_single']:.2f}", f"{r32['time_ratio_vs_single']:.2f}",
                             f"{r16['mem_ratio_vs_single']:.2f}", f"{r16['kernel_imbalance']:.3f}"], line


def test_the_families_page_is_the_sweep_file():
    """docs/guides/families.md is what benchmarks/families.py makes of
    benchmarks/results/families.json (`python benchmarks/families.py --docs` regenerates it),
    and the file covers every family transformers registers."""
    sys.path.insert(0, str(REPO))
    from benchmarks import families

    payload = json.loads((REPO / "benchmarks" / "results" / "families.json").read_text())
    assert (REPO / "docs" / "guides" / "families.md").read_text() == families.support_table(payload)
    assert {r["family"] for r in payload["rows"]} == set(families.families())
