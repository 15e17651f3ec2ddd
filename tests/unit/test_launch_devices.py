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


def test_offloaded_fsdp_shards_are_made_in_host_memory_and_buffers_on_the_device():
    """With --offload on a GPU the meta model's shards get host memory (FSDP2's
    CPUOffloadPolicy keeps them there; made on the GPU they failed the first step on an H200)
    and the rotary tables go to the compute device. "meta" stands in for the GPU here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from easy_context.train.engines.fsdp import materialise
    from easy_context.train.weights import params_on_meta

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    for offload, params_on in ((True, "cpu"), (False, "meta")):
        with params_on_meta():
            model = LlamaForCausalLM(config)
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        assert buffers, "the model has rotary buffers to keep"
        materialise(model, model, buffers, torch.device("meta"), offload)
        assert {p.device.type for p in model.parameters()} == {params_on}
        assert {b.device.type for b in model.buffers()} == {"meta"}
        assert set(dict(model.named_buffers())) == set(buffers)
    # on one device (the CPU) the buffers keep their values
    with params_on_meta():
        model = LlamaForCausalLM(config)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    materialise(model, model, buffers, torch.device("cpu"), True)
    for name, value in buffers.items():
        torch.testing.assert_close(model.get_buffer(name), value, rtol=0, atol=0)
