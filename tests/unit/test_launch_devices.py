"""The process group's backend and the GPU count, chosen and checked before any rank starts
(contract tests: no GPU here, so CUDA is a stand-in)."""

from __future__ import annotations

import pytest
import torch

from easy_context import launch


def test_cuda_ranks_get_a_backend_for_host_tensors_too():
    assert launch.backend_for("cuda") == "cuda:nccl,cpu:gloo"
    assert launch.backend_for("cpu") == "gloo"


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(two_gpus, monkeypatch):
    started = []
    monkeypatch.setattr(launch.mp, "start_processes", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=r"--nproc-per-node 3 asks for more ranks than this "
                                         r"machine has GPUs \(2\): use --nproc-per-node 2"):
        launch.launch(print, 3)
    assert started == []
    launch.check_local_devices(2)  # one rank per GPU is fine


def test_a_cuda_rank_creates_the_two_backend_group(two_gpus, monkeypatch):
    made = []
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, **kw: made.append(backend))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.init_distributed() == torch.device("cuda", 1)
    assert made == ["cuda:nccl,cpu:gloo"]
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun started more ranks than GPUs
    with pytest.raises(ValueError, match="LOCAL_RANK 2 has no GPU: this machine shows 2"):
        launch.init_distributed()
    assert made == ["cuda:nccl,cpu:gloo"]


def test_deepspeed_is_told_the_device_backend_of_the_two_backend_group(monkeypatch):
    """DeepSpeed records the backend's name and compares it with "nccl": on CUDA it gets
    "nccl", not the group's "cuda:nccl,cpu:gloo"."""
    deepspeed = pytest.importorskip("deepspeed")
    from easy_context.train.engines import deepspeed as engine

    told = []
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # it sets them: put back what was there
        monkeypatch.setenv(key, "0" if key != "WORLD_SIZE" else "1")
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(engine.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(engine.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend, **kw: told.append(dist_backend))
    for group_backend, want in (("cuda:nccl,cpu:gloo", "nccl"), ("gloo", "gloo")):
        monkeypatch.setattr(engine.dist, "get_backend", lambda group=None, b=group_backend: b)
        engine._start_deepspeed_comm()
        assert told[-1] == want
