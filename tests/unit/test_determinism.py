"""``--deterministic`` (easy_context.train.determinism): what it switches on, that it switches
it back, and that the flash-attn backward is asked for its deterministic variant.

No GPU here: the flash-attn package is replaced by a stand-in module with flash-attn 2.7's
``_flash_attn_backward`` signature that records what it is called with.
"""

from __future__ import annotations

import os
import sys
import types

import torch

from easy_context.train.config import TrainConfig
from easy_context.train.determinism import CUBLAS_WORKSPACE, deterministic_kernels


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


def _stand_in_flash_attn(calls: list):
    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size_left, window_size_right, softcap,
                             alibi_slopes, deterministic, rng_state=None):
        calls.append(deterministic)
        return softmax_lse

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax):
        raise AssertionError("not called")

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = _flash_attn_backward
    interface._flash_attn_forward = _flash_attn_forward
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    return package, interface


def test_flash_attn_backward_gets_the_deterministic_flag(monkeypatch):
    from easy_context.attention import kernels

    calls: list = []
    package, interface = _stand_in_flash_attn(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    kernel = kernels._flash_attn_kernel()
    q = torch.zeros(1, 4, 2, 8)  # (B, S, H, D)
    lse = torch.zeros(1, 2, 4)
    kernel.backward(q, q, q, q, q, lse, causal=True)
    with deterministic_kernels(True):
        kernel.backward(q, q, q, q, q, lse, causal=True)
    kernel.backward(q, q, q, q, q, lse, causal=True)
    assert calls == [False, True, False]
