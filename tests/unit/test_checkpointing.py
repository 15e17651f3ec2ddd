"""``--checkpointing offload``: the layer inputs each checkpoint saves go to exact-size host
buffers (memory/pinned.py), the previous layer's come back while one runs backward
(memory/offload.py HostCheckpoints), and the gradients are plain full checkpointing's.

No GPU here: the copies run as plain CPU copies (the same code without streams), and a
stand-in for ``torch.cuda.cudart()`` checks what the pool registers on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from easy_context.memory.checkpointing import apply_activation_checkpointing
from easy_context.memory.pinned import PinnedPool, caching_allocator_bytes
from tests.train_fixtures import TINY


def _model(kind: str, layers: int = 4):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": layers})
    torch.manual_seed(0)
    return apply_activation_checkpointing(AutoModelForCausalLM.from_config(config), kind).train()


def test_offload_trains_like_full_and_holds_each_input_once(monkeypatch):
    layers, seq = 4, 24
    ids = torch.arange(seq).unsqueeze(0) % TINY["vocab_size"]
    grads = {}
    for kind in ("full", "offload"):
        model = _model(kind, layers)
        if kind == "offload":
            storage = model._ec_host_checkpoints
            seen = []
            real_take, real_copy = storage.copies._take, storage.copies._to_device
            # a take of an entry with no copy on its way is a copy the layer waits for
            monkeypatch.setattr(storage.copies, "_take", lambda e: seen.append(
                "fetch" if e.arriving is None else "arrived") or real_take(e))
            monkeypatch.setattr(storage.copies, "_to_device",
                                lambda e: seen.append("prefetch") or real_copy(e))
        for _ in range(2):  # a second step reuses the first step's host buffers
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["full"], grads["offload"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sum(len(v) for v in storage.entries.values()) == layers - 1  # this step's only
    # the last layer's input stays on the device; the others' (1, seq, hidden) fp32 inputs
    # are held once, exactly, across both steps
    assert storage.copies.pool.bytes == (layers - 1) * seq * TINY["hidden_size"] * 4
    # in backward no layer waits for a copy it asks for: each offloaded layer's input was
    # on its way back while the layer after it ran backward (the last kept on the device)
    assert seen == ["prefetch", "arrived"] * (2 * (layers - 1)), seen


def test_offload_two_forwards_then_one_backward():
    """Two forwards before one backward ((model(a) + model(b)).backward(), gradient
    accumulation in one graph): each layer's backward takes back its own forward's inputs
    (before, the second forward's replaced the first's: "not enough values to unpack").
    The gradients are full checkpointing's, exactly; no host copy is left waiting."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, TINY["vocab_size"], (1, n), generator=gen) for n in (24, 16)]
    grads = {}
    for kind in ("full", "offload"):
        model = _model(kind)
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in batches)
        loss.backward()
        grads[kind] = [p.grad for p in model.parameters()]
    for a, b in zip(grads["full"], grads["offload"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not model._ec_host_checkpoints.pending()


def test_the_pool_holds_exact_bytes_where_the_caching_allocator_rounds_up():
    pool = PinnedPool(pin=False)
    shapes = [(3 * 2**18 + 4,)] * 3 + [(5, 7)]  # 3 MiB + 16 bytes each, fp32
    bufs = [pool.take(s, torch.float32) for s in shapes]
    exact = sum(b.numel() * 4 for b in bufs)
    assert pool.bytes == exact
    rounded = sum(caching_allocator_bytes(b.numel() * 4) for b in bufs)
    assert rounded == 3 * 2**22 + 256 and rounded > 1.3 * exact  # 3 MiB + 16 -> 4 MiB
    for b in bufs:
        pool.give(b)
    again = [pool.take(s, torch.float32) for s in shapes]  # the next step: the same buffers
    assert {id(b) for b in again} == {id(b) for b in bufs} and pool.bytes == exact
    assert caching_allocator_bytes(2**20) == 2**20 and caching_allocator_bytes(2**20 + 1) == 2**21
    assert caching_allocator_bytes(0) == 0 and caching_allocator_bytes(1) == 1


class _Cudart:
    def __init__(self, fail: int = 0):
        self.fail, self.registered = fail, {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        if self.fail:
            return self.fail
        self.registered[ptr] = (size, flags)
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        del self.registered[ptr]
        return 0


def test_on_cuda_the_pool_page_locks_exactly_what_it_holds(monkeypatch):
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = PinnedPool(pin=True)
    buf = pool.take((3, 1000), torch.bfloat16)
    assert cudart.registered == {buf.data_ptr(): (6000, 0)}  # not 8192
    pool.give(buf)
    assert pool.take((3, 1000), torch.bfloat16) is buf and len(cudart.registered) == 1
    pool.close()
    assert cudart.registered == {} and pool.bytes == 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(fail=2))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 400 bytes failed"):
        PinnedPool(pin=True).take((100,), torch.float32)


def test_the_planner_counts_the_rounding_of_fsdps_pinned_shards():
    """FSDP2's CPUOffloadPolicy pins each parameter's shard (and gradient) through the
    caching host allocator: the planner's host share on a GPU holds each rounded up."""
    from easy_context.plan.shapes import ModelShape
    from easy_context.plan.states import model_states

    shape = ModelShape("tiny", hidden=96, layers=1, heads=4, kv_heads=2, intermediate=160,
                       vocab=300, head_dim=24)
    # (rows, cols) by hand: q, k, v, o, gate, up, down, two norms; embedding, head; final norm
    params = [(96, 96), (48, 96), (48, 96), (96, 96), (160, 96), (160, 96), (96, 160),
              (96, 1), (96, 1), (300, 96), (300, 96), (96, 1)]
    assert sum(r * c for r, c in params) == shape.num_params()

    def pow2(n):
        return 1 << (n - 1).bit_length()
    shards = [(r // 2) * c * 4 for r, c in params]  # 2 ranks, fp32
    extra = sum(pow2(b) - b for b in shards)
    gpu = model_states(shape, 2, "fsdp", "params", "bf16", "gpu").host
    cpu = model_states(shape, 2, "fsdp", "params", "bf16", "cpu").host  # not pinned there
    assert gpu - cpu == 2 * extra  # parameters and gradients
    assert model_states(shape, 2, "deepspeed", "params", "bf16", "gpu").host == \
        model_states(shape, 2, "deepspeed", "params", "bf16", "cpu").host
