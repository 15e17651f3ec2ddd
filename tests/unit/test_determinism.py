"""``--deterministic`` (easy_context.train.determinism): what it switches on, that it switches
it back, and that the flash-attn backward is asked for its deterministic variant.

No GPU here: each flash-attn adapter runs on the stand-in module of its release
(tests/unit/kernel_standins.py), which records the deterministic flag its backward gets.
"""

from __future__ import annotations

import os

import pytest
import torch

from easy_context.attention import flash_attn_adapters as fa
from easy_context.train.config import TrainConfig
from easy_context.train.determinism import CUBLAS_WORKSPACE, deterministic_kernels

from . import kernel_standins as standins


def test_switches_on_and_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # raise, don't warn
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_off_changes_nothing_and_a_users_cublas_setting_stays(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_flag_exists_and_defaults_off():
    assert TrainConfig().deterministic is False


@pytest.mark.parametrize("make", [lambda: fa.adapter_2_6(standins.flash_attn_2_6()),
                                  lambda: fa.adapter_2_7(standins.flash_attn_2_7()),
                                  lambda: fa.adapter_4(standins.flash_attn_4())],
                         ids=["2.6", "2.7", "4"])
def test_flash_attn_backward_gets_the_deterministic_flag(make):
    kernel = make()
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)  # (B, S, H, D)
    lse = torch.zeros(1, 2, 4)
    standins.DETERMINISTIC.clear()
    kernel.backward(q, q, q, q, q, lse, causal=True)
    with deterministic_kernels(True):
        kernel.backward(q, q, q, q, q, lse, causal=True)
    kernel.backward(q, q, q, q, q, lse, causal=True)
    assert standins.DETERMINISTIC == [False, True, False]
