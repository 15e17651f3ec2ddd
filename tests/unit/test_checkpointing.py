"""Offloaded activation checkpointing pins its host copies exactly when the activations live on
an accelerator, decided at each call from the activations themselves.

The trainer turns checkpointing on before the model moves to its GPU, so a decision taken
then (from the parameters' device) was always "CPU, don't pin": copies were pageable and
synchronous. No GPU here: a fake CUDA tensor (FakeTensorMode: metadata only) stands in for
the activations, and recorders stand in for ``save_on_cpu`` and the checkpoint itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from easy_context.memory import checkpointing
from easy_context.memory.checkpointing import apply_activation_checkpointing, pin_offloaded
from tests.train_fixtures import TINY


@contextlib.contextmanager
def _recording_save_on_cpu(monkeypatch, delegate: bool):
    """Records the pin_memory of every save_on_cpu; ``delegate``: and really offloads."""
    calls: list[bool] = []
    real = torch.autograd.graph.save_on_cpu

    def save_on_cpu(pin_memory=False, **kw):
        calls.append(pin_memory)
        return real(pin_memory=pin_memory, **kw) if delegate else contextlib.nullcontext()

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", save_on_cpu)
    yield calls


def test_pin_follows_the_activations_device():
    assert not pin_offloaded(torch.ones(2))
    assert not pin_offloaded("not a tensor", torch.ones(2, device="meta"))
    with FakeTensorMode():
        on_gpu = torch.empty(2, 3, device="cuda")
    assert pin_offloaded(on_gpu, torch.ones(1))
    assert not pin_offloaded()


def test_offloaded_checkpoint_decides_at_call_time(monkeypatch):
    """The same checkpoint function pins for GPU activations and not for CPU ones."""
    ran = []
    monkeypatch.setattr(checkpointing, "checkpoint",
                        lambda fn, *args, use_reentrant: ran.append(use_reentrant) or fn(*args))
    with _recording_save_on_cpu(monkeypatch, delegate=False) as pins:
        checkpointing._offloaded_checkpoint(lambda x: x * 2, torch.ones(3))
        with FakeTensorMode():
            checkpointing._offloaded_checkpoint(lambda x: x * 2, torch.empty(3, device="cuda"))
    assert pins == [False, True]
    assert ran == [True, True]  # reentrant: the layer inputs go through save_on_cpu


def test_offload_on_cpu_trains_like_full(monkeypatch):
    """Real CPU run: offload is applied to a model on the CPU, saves unpinned copies, and
    gives the gradients of plain full checkpointing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **TINY)
    grads = {}
    for kind in ("full", "offload"):
        torch.manual_seed(0)
        model = apply_activation_checkpointing(AutoModelForCausalLM.from_config(config), kind)
        model.train()
        ids = torch.arange(16).unsqueeze(0) % TINY["vocab_size"]
        with _recording_save_on_cpu(monkeypatch, delegate=True) as pins:
            model(input_ids=ids, labels=ids).loss.backward()
        if kind == "offload":
            assert pins == [False] * TINY["num_hidden_layers"]
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["full"], grads["offload"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
