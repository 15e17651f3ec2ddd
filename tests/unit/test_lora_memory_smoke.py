"""benchmarks/lora_memory.py --quick: a LoRA step's measured peak against the planner's."""

import json

import pytest

from benchmarks import common

pytestmark = pytest.mark.slow  # ~1 min on 2 cores: four 2-rank pools import torch/transformers


def test_lora_memory_quick(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora_memory.json"
    proc = common.run_script(["benchmarks/lora_memory.py", "--quick", "--output", str(out)],
                             timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    for kind in ("lora", "full"):
        assert abs(row[kind]["error"]) <= 0.15, (kind, row[kind])
    # the frozen base has no gradients or AdamW states: the LoRA step holds less
    assert row["lora"]["measured_mb"] < row["full"]["measured_mb"]
