"""``easy-context demo --quick``: the CI version of the README's main job. It runs the real
pipeline (tokenizer, model, corpora, 2-rank recipe stages, needle and ppl evals, report) with
a few steps per stage, in a subprocess (the demo sets its own thread count and spawns ranks),
and must produce every artifact of the report. A rerun finds every phase done."""

import json
import subprocess
import sys

import pytest

from easy_context.demo.report import ARTIFACTS


@pytest.mark.slow  # ~1 min on an idle 2-core machine, ~3-4 min on a heavily loaded one
def test_quick_demo_writes_every_artifact_and_resumes(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "easy_context.cli", "demo", "--quick", "--output", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    for name in ARTIFACTS:
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in (n for n in ARTIFACTS if n.endswith(".png")):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    assert "Quick run" in report
    for section in ("## Targets", "## Needle accuracy", "## Perplexity", "## Training stages",
                    "## Time"):
        assert section in report
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == [
        "copy_512_theta_10k", "short_512_theta_10k", "extend_1024_theta_40k",
        "extend_2048_theta_160k"]
    assert set(summary["evals"]) == {"before", "after"}
    before = json.loads((out / "eval" / "needle_before.json").read_text())["config"]
    # "before" is the last stage at the first length and theta: after the copy curriculum
    assert "short_512_theta_10k" in before["model_dir"]
    assert before["rope_parameters"]["rope_theta"] == 10000
    needle = json.loads((out / "eval" / "needle_after.json").read_text())
    assert max(c["context_length"] for c in needle["cells"]) == 2048
    assert needle["config"]["rope_parameters"]["rope_theta"] == 160000

    # Rerun: every stage is skipped (its outputs untouched) and the evals are reused.
    stage_files = sorted((out / "output").rglob("*"))
    mtimes = {p: p.stat().st_mtime_ns for p in stage_files if p.is_file()}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "done, skipped" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert "phase eval" not in again.stderr  # the saved evals are reused
