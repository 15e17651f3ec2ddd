"""Pieces of max-length mode in one process: the tiled loss with its norm, the layer storage
(offload and nested recompute bookkeeping on a CPU), the allocator set-up, the flags."""

import torch
import pytest
from torch import nn

from easy_context.memory.loss import chunked_cross_entropy
from easy_context.memory.offload import DeviceStorage, LayerStorage
from easy_context.memory.tiled_loss import normed_chunked_cross_entropy
from easy_context.train.config import TrainConfig, parse_tiling


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_normed_loss_equals_norm_then_chunked_loss():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[::5] = -100
    norm = RMSNorm(16).double()
    got = normed_chunked_cross_entropy(h, norm, w, y, b, chunk_size=8)
    got.backward()
    grads = [t.grad.clone() for t in (h, w, b, norm.weight)]
    for t in (h, w, b, norm.weight):
        t.grad = None
    want = chunked_cross_entropy(norm(h), w, y, b, chunk_size=37)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-12)
    for g, t in zip(grads, (h, w, b, norm.weight)):
        assert torch.allclose(g, t.grad, rtol=1e-10, atol=1e-12)


def test_layer_storage_offload_and_nested_recompute():
    layers = 5
    xs = [torch.full((1, 3, 2), float(i)) for i in range(layers)]
    forward = [lambda x, i=i: x + 1 for i in range(layers)]  # layer i: x_{i+1} = x_i + 1
    for keep_every in (1, 2, 3):
        st = LayerStorage(layers, offload=True, keep_every=keep_every)
        handles = [st.pack([xs[i]], i, forward[i]) for i in range(layers)]
        kept = sum(e is not None for e in st.entries.values())
        assert kept == len([i for i in range(layers) if i % keep_every == 0 or i == layers - 1])
        for i in reversed(range(layers)):  # backward order; regenerated ones are exact
            (x,) = st.unpack(handles[i])
            assert torch.equal(x, xs[i])
            # the last layer's input stays where it is; the others come back as copies
            assert (x.data_ptr() == xs[i].data_ptr()) == (i == layers - 1)
        assert not st.entries
    d = DeviceStorage()
    assert d.unpack(d.pack([xs[0]], 0))[0] is xs[0]


def test_allocator_configuration(monkeypatch):
    from easy_context.utils import allocator

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "131072")
    assert "left as set by the user" in allocator.configure_cpu_allocator()
    monkeypatch.delenv("MALLOC_TOP_PAD_")
    assert "mapped directly" in allocator.configure_cpu_allocator()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert "left as set by the user" in allocator.configure_cuda_allocator()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    allocator.export_for_children()
    import os

    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_tiling_flags():
    assert parse_tiling("auto") == "auto" and parse_tiling("OFF") is None
    assert parse_tiling("4096") == 4096 and parse_tiling(2) == 2
    with pytest.raises(ValueError, match="--head-chunk must be auto, off or a number"):
        parse_tiling("0", "head_chunk")
    with pytest.raises(ValueError, match="--keep-every"):
        TrainConfig(model="m", dataset="d", keep_every=0).validate()


def test_rope_tables_in_pieces_equal_whole(monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from easy_context.memory import maxlen

    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    rotary = model.get_decoder().rotary_emb
    x, pos = torch.zeros(1, 23, 32), torch.arange(100, 123)[None]
    whole = rotary(x, pos)
    monkeypatch.setattr(maxlen, "ROPE_TILE", 5)
    maxlen._tile_rotary(model)
    pieces = rotary(x, pos)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))
