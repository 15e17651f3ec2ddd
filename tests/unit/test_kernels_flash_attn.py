"""The flash-attn adapters, one per API generation, against stand-in modules on the CPU.

Each stand-in (tests/unit/kernel_standins.py) has that release's op names, signatures,
registration (2.7/2.8: torch.library custom ops, here for the CPU device) and return layout,
and computes with the reference kernel; the adapter must reach the right items (2.6's lse is
item 5 of 8, not item 1) and fill the right buffers. Selection by installed version is
tested by faking the installed packages. Tolerance: as the reference (bf16 3e-2, fp16 5e-3
of max |ref|).
"""

import inspect
import sys

import pytest
import torch

from easy_context.attention import flash_attn_adapters as fa

from . import kernel_standins as standins
from .test_kernels import check_kernel

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("name,make", [
    ("2.6", lambda: fa.adapter_2_6(standins.flash_attn_2_6())),
    ("2.7", lambda: fa.adapter_2_7(standins.flash_attn_2_7())),
    ("4 (4 items)", lambda: fa.adapter_4(standins.flash_attn_4(four_tuple=True))),
    ("4 (2 items)", lambda: fa.adapter_4(standins.flash_attn_4(four_tuple=False)))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_adapter_meets_the_contract(name, make, dtype, causal):
    standins.CALLS.clear()
    errs = check_kernel(make(), dtype, causal)
    assert len(standins.CALLS) == 2, standins.CALLS  # one forward, one backward op
    assert max(errs.values()) <= TOL[dtype], errs


def test_custom_ops_hide_their_signature():
    """Why the old wrapper failed on 2.7+: inspect.signature of a custom op names nothing."""
    params = inspect.signature(standins.flash_attn_2_7()._flash_attn_forward).parameters
    assert [p.kind for p in params.values()] == [inspect.Parameter.VAR_POSITIONAL,
                                                 inspect.Parameter.VAR_KEYWORD]


def test_2_6_forward_item_1_is_q_not_lse():
    q = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
    res = standins.flash_attn_2_6()._flash_attn_forward(q, q, q, 0.0, 0.3, False, (-1, -1),
                                                        0.0, None, False)
    assert res[1] is q and res[5].shape == (1, 2, 5)
    out, lse = fa.adapter_2_6(standins.flash_attn_2_6()).forward(q, q, q, False, 0.3)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize("version,gen", [("2.6.3", "2.6"), ("2.6.0.post1", "2.6"),
                                         ("2.7.0.post2", "2.7"), ("2.7.4.post1", "2.7"),
                                         ("2.8.3", "2.7"), ("2.5.9.post1", None), ("1.0.9", None),
                                         ("3.0.0b1", None), ("garbage", None)])
def test_generation_by_version(version, gen):
    assert fa.generation(version) == gen


@pytest.fixture
def installed(monkeypatch):
    """install(fa2_version, fa4: bool): fake the installed packages for the adapters."""
    def install(fa2_version=None, fa4=False):
        versions = {"flash-attn": fa2_version, "flash-attn-4": "4.0.0b36" if fa4 else None}
        monkeypatch.setattr(fa, "_version", versions.get)
        if fa2_version is not None:
            mod = (standins.flash_attn_2_6() if fa2_version.startswith("2.6")
                   else standins.flash_attn_2_7())
            monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
        if fa4:
            monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", standins.flash_attn_4())
        fa.installed_flash_attn_kernels.cache_clear()
        fa.fa4_version.cache_clear()
        return fa.installed_flash_attn_kernels()

    yield install
    fa.installed_flash_attn_kernels.cache_clear()
    fa.fa4_version.cache_clear()


@pytest.mark.parametrize("version,ops", [("2.6.3", "fa26"), ("2.7.4.post1", "fa27"),
                                         ("2.8.3", "fa27")])
def test_installed_version_picks_its_adapter(installed, version, ops):
    kernels = installed(version)
    assert [k.name for k in kernels] == ["flash_attn"]
    standins.CALLS.clear()
    q = torch.randn(1, 6, 2, 16, dtype=torch.bfloat16)
    out, lse = kernels[0].forward(q, q, q, True, 0.25)
    kernels[0].backward(q, q, q, q, out, lse, True, 0.25)
    assert standins.CALLS == [f"{ops}_fwd", f"{ops}_bwd"]


def test_nothing_installed_or_too_old(installed):
    assert installed(None) == ()
    assert installed("2.5.8") == ()


def test_flash_attn_4_first_on_hopper_flash_attn_2_on_ampere(installed):
    kernels = installed("2.8.3", fa4=True)
    assert [k.name for k in kernels] == ["flash_attn_4", "flash_attn"]
    q = torch.empty(1, 8, 4, 128, dtype=torch.bfloat16)
    assert fa.usable("flash_attn_4", q, (9, 0)) and not fa.usable("flash_attn_4", q, (8, 0))
    assert fa.usable("flash_attn", q, (8, 0)) and not fa.usable("flash_attn", q, (7, 5))


@pytest.mark.parametrize("name,d,capability,ok", [
    ("flash_attn", 256, (8, 0), True), ("flash_attn", 264, (8, 0), False),
    ("flash_attn", 60, (8, 0), False), ("flash_attn_4", 128, (9, 0), True),
    ("flash_attn_4", 256, (9, 0), False), ("flash_attn_4", 192, (10, 0), False),
    ("flash_attn_4", 256, (10, 0), True), ("flash_attn_4", 128, (12, 0), False)])
def test_usable_head_dims(name, d, capability, ok):
    version = "4.0.0b27"  # the newest beta read (fa4-v4.0.0.beta27)
    assert fa.usable(name, torch.empty(1, 8, 4, d, dtype=torch.float16), capability, version) is ok
    assert not fa.usable(name, torch.empty(1, 8, 4, d, dtype=torch.float32), capability, version)


@pytest.mark.parametrize("d,capability,version,deterministic,ok", [
    (128, (9, 0), "4.0.0b4", False, True), (64, (9, 0), "4.0.0b4", False, False),
    (128, (9, 0), "4.0.0b4", True, False),  # sm90 deterministic backward from b5
    (64, (9, 0), "4.0.0b5", False, True), (96, (9, 0), "4.0.0b5", True, True),
    (192, (9, 0), "4.0.0b5", False, True), (256, (9, 0), "4.0.0b27", False, False),
    (80, (9, 0), "4.0.0b27", False, False), (128, (9, 0), None, False, True),
    (256, (10, 0), "4.0.0b10", False, False), (256, (10, 0), "4.0.0b11", False, True),
    (256, (11, 0), "4.0.0b11", False, False), (256, (11, 0), "4.0.0b15", False, True),
    (64, (10, 0), "4.0.0b1", False, True), (128, (12, 0), "4.0.0b27", False, False)])
def test_flash_attn_4_by_version_and_head_dim(d, capability, version, deterministic, ok):
    assert fa.fa4_runs(d, capability, version, deterministic) is ok


def _kernel(name, calls, fail=None):
    """A reference kernel that records its calls and raises ``fail`` while it is set."""
    from easy_context.attention.contract import Kernel
    from easy_context.attention.kernels import REFERENCE

    def wrap(direction):
        def run(*args, **kwargs):
            calls.append(f"{name}_{direction}")
            if fail and fail.get(direction):
                raise fail[direction]
            return getattr(REFERENCE, direction)(*args, **kwargs)
        return run
    return Kernel(name, wrap("forward"), wrap("backward"))


def test_a_kernel_that_fails_its_first_call_is_dropped_once_with_a_log_line(caplog):
    from easy_context.attention import selection

    calls = []
    broken = _kernel("flash_attn_4", calls, {"backward": RuntimeError("hdim 256 not supported")})
    fallback = _kernel("flash_attn", calls)
    key = ("test", 0, torch.float16, 256)
    kernel = selection.first_that_runs((broken, fallback), key)
    q = torch.randn(1, 8, 2, 16)
    out, lse = kernel.forward(q, q, q, True, None)
    with caplog.at_level("WARNING", logger="easy_context.attention.selection"):
        grads = kernel.backward(q, q, q, q, out, lse, True, None)
        kernel.backward(q, q, q, q, out, lse, True, None)
        kernel.forward(q, q, q, True, None)
    want = fallback.backward(q, q, q, q, out, lse, True, None)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)
    assert calls[:3] == ["flash_attn_4_forward", "flash_attn_4_backward", "flash_attn_backward"]
    assert calls[3:5] == ["flash_attn_backward", "flash_attn_forward"]  # never tried again
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "flash_attn_4 failed on its first backward call" in caplog.records[0].message
    assert "using flash_attn from now on" in caplog.records[0].message


def test_a_kernel_that_ran_keeps_its_errors():
    from easy_context.attention import selection

    calls, fail = [], {}
    works = _kernel("flash_attn_4", calls, fail)
    kernel = selection.first_that_runs((works, _kernel("flash_attn", calls)),
                                       ("test", 1, torch.float16, 64))
    q = torch.randn(1, 8, 2, 16)
    out, lse = kernel.forward(q, q, q, True, None)
    kernel.backward(q, q, q, q, out, lse, True, None)
    fail["forward"] = RuntimeError("a real error")
    with pytest.raises(RuntimeError, match="a real error"):
        kernel.forward(q, q, q, True, None)
    fail["forward"] = torch.OutOfMemoryError("out of memory")
    oom = selection.first_that_runs((_kernel("x", calls, fail), _kernel("y", calls)),
                                    ("test", 2, torch.float16, 64))
    with pytest.raises(torch.OutOfMemoryError):
        oom.forward(q, q, q, True, None)
