"""Peak memory on the CPU (easy_context/memory/peak.py) and the training log line that shows
it: the process's real peak, never a negative or near-zero delta; nothing when unknown."""

from __future__ import annotations

import torch

from easy_context.train.logs import step_line
from easy_context.memory import peak as memory
from easy_context.memory.peak import PeakMemory, rss_bytes

MB = 2**20


def _touch(mb: int) -> torch.Tensor:
    x = torch.empty(mb * MB, dtype=torch.uint8)
    x.fill_(1)  # resident only once written
    return x


def test_cpu_peak_is_the_process_peak_and_the_rise():
    with PeakMemory("cpu") as pm:
        x = _touch(200)
        del x
    assert pm.process_peak_bytes >= rss_bytes()  # the peak, not what is left after the free
    assert pm.process_peak_bytes > 200 * MB  # this process holds torch, and touched 200 MB
    assert 190 * MB <= pm.peak_bytes <= pm.process_peak_bytes
    with PeakMemory("cpu") as idle:
        pass
    assert idle.peak_bytes >= 0  # the RSS counters lag; a region that allocates reads >= 0


def test_without_the_reset_the_process_peak_remains(monkeypatch, tmp_path):
    # A container that refuses the reset: clear_refs cannot be opened for writing.
    monkeypatch.setattr(memory, "_CLEAR_REFS", str(tmp_path / "no" / "clear_refs"))
    with PeakMemory("cpu") as pm:
        pass
    assert pm.peak_bytes is None  # no rise can be measured without the reset
    assert pm.process_peak_bytes >= rss_bytes() > 0


def test_unknown_peak_is_left_out_of_the_log_line(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_STATUS", str(tmp_path / "no_proc"))
    with PeakMemory("cpu") as pm:
        pass
    assert pm.process_peak_bytes is None and pm.peak_bytes is None
    metrics = {"step": 3, "loss": 2.5, "ppl": 12.18, "lr": 1e-3, "grad_norm": 0.5,
               "tokens_per_s": 1234.4, "peak_memory_mb": None}
    assert step_line(metrics) == ("step 3 | loss 2.5000 | ppl 12.18 | lr 1.00e-03 | "
                                  "grad norm 0.500 | 1234 tok/s")
    metrics["peak_memory_mb"] = 812.4
    assert step_line(metrics).endswith("| 1234 tok/s | peak mem 812 MB")
