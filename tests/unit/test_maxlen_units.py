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


def test_normed_loss_writes_its_gradient_over_owned_hidden_states():
    torch.manual_seed(0)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[::5] = -100
    norm = RMSNorm(16).double()
    leaf = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    grads = {}
    for overwrite in (False, True):
        hidden = leaf * 1.0  # a non-leaf the loss alone reads, like the last layer's output
        hidden.register_hook(lambda g, o=overwrite: grads.__setitem__(o, g))
        before = hidden.detach().clone()
        loss = normed_chunked_cross_entropy(hidden, norm, w, y, chunk_size=8,
                                            overwrite_hidden=overwrite)
        loss.backward()
        # the gradient took the hidden states' memory only when asked to
        assert (grads[overwrite].data_ptr() == hidden.data_ptr()) == overwrite
        assert torch.equal(hidden.detach(), grads[True] if overwrite else before)
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_overwritten_hidden_states_fail_loudly_if_another_node_saved_them():
    norm = RMSNorm(16).double()
    w = torch.randn(50, 16, dtype=torch.float64)
    leaf = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    hidden = leaf * 1.0
    other = (hidden * hidden).sum()  # MulBackward saves hidden
    loss = normed_chunked_cross_entropy(hidden, norm, w, torch.randint(0, 50, (9,)),
                                        chunk_size=4, overwrite_hidden=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_layer_storage_offload_and_nested_recompute():
    layers = 5
    xs = [torch.full((1, 3, 2), float(i)) for i in range(layers)]
    forward = [lambda x, keep, i=i: x + 1 for i in range(layers)]  # layer i: x_{i+1} = x_i + 1
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
        if keep_every == 1:  # exact host bytes, and the next pass reuses the same buffers
            held = st.pool.bytes
            assert held == (layers - 1) * 6 * 4
            handles = [st.pack([xs[i]], i, forward[i]) for i in range(layers)]
            for i in reversed(range(layers)):
                st.unpack(handles[i])
            assert st.pool.bytes == held
    # without offload (the nested recompute alone) the last layer follows keep_every too
    for keep_every in (2, 3, 5):
        st = LayerStorage(layers, offload=False, keep_every=keep_every)
        handles = [st.pack([xs[i]], i, forward[i]) for i in range(layers)]
        kept = [i for i, e in st.entries.items() if e is not None]
        assert kept == [i for i in range(layers) if i % keep_every == 0]
        for i in reversed(range(layers)):
            (x,) = st.unpack(handles[i])
            assert torch.equal(x, xs[i])
            assert (x.data_ptr() == xs[i].data_ptr()) == (i in kept)  # kept ones are not copied
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


def _tiny_llama(layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()


@pytest.mark.parametrize("keep_every,kind,forwards",
                         [(1, "full", 8), (2, "full", 8), (4, "full", 10), (2, "offload", 9)])
def test_nested_recompute_reuses_the_regenerated_attention(monkeypatch, keep_every, kind,
                                                           forwards):
    """4 layers: the plain recompute runs each layer's attention twice (forward, backward);
    the nested one hands the attention of the last layer it regenerates to that layer's
    backward, so with 2 layers a group it runs no attention more (4 layers a group: the 2
    layers regenerated earlier run theirs once more). With offload the device memory comes
    first: the one layer regenerated (layer 0; the last layer's input stays on the device)
    runs its attention again."""
    import copy

    import easy_context as ec
    from easy_context.memory import fused_layer
    from easy_context.memory.maxlen import apply_max_length

    calls = []
    original = fused_layer.Run.attention_forward
    monkeypatch.setattr(fused_layer.Run, "attention_forward",
                        lambda self, *a, **k: calls.append(self.index) or original(self, *a, **k))
    base = _tiny_llama(4)
    ids = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(0))
    pos, tgt = torch.arange(24)[None], torch.roll(ids, -1, 1)
    grads = []
    for k in (1, keep_every):
        model = copy.deepcopy(base)
        apply_max_length(model, 8, 2, kind, keep_every=k)
        calls.clear()
        ec.causal_lm_loss(model, ids, pos, tgt, chunked=True, chunk_size=7).backward()
        grads.append([p.grad for p in model.parameters()])
    assert len(calls) == forwards
    for a, b in zip(*grads):  # the same numbers, however the inputs came back
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("path", ["fused", "generic"])
@pytest.mark.parametrize("kind,keep_every", [("offload", 1), ("full", 2), ("offload", 2)])
def test_two_forwards_then_one_backward(path, kind, keep_every):
    """Two forwards before one backward (gradient accumulation written as
    (model(a) + model(b)).backward()): each layer's backward finds its own forward's input,
    offloaded or regenerated by the nested recompute (a KeyError before: the layer storage
    held one forward's inputs). Loss and every gradient equal the plain model's (float64,
    1e-10 relative to the largest); nothing is left in the storage after the backward, and a
    second step does the same with the host buffers of the first."""
    import copy

    import easy_context as ec
    from easy_context.memory.maxlen import apply_max_length, max_length_settings

    plain = _tiny_llama(4)
    model = copy.deepcopy(plain)
    apply_max_length(model, 8, 2, kind, keep_every=keep_every, path=path)
    assert max_length_settings(model).paths == [path] * 4
    gen = torch.Generator().manual_seed(0)
    batches = []
    for length in (24, 16):  # two lengths: the forwards keep tensors of other shapes
        ids = torch.randint(0, 61, (1, length), generator=gen)
        batches.append((ids, torch.arange(length)[None], torch.roll(ids, -1, 1)))

    def step(m):
        m.zero_grad()
        loss = sum(ec.causal_lm_loss(m, *batch, chunked=True, chunk_size=7) for batch in batches)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    want, want_grads = step(plain)
    storage = max_length_settings(model).storage
    for _ in range(2):
        got, grads = step(model)
        assert abs(float(got - want)) <= 1e-10 * abs(float(want)), (got, want)
        for a, b in zip(grads, want_grads):
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            assert err <= 1e-10, err
        assert not storage.entries and not storage.pending()


def test_first_layer_input_and_rope_tables_are_recomputed(monkeypatch):
    from easy_context.memory import fused_layer, maxlen, offload
    from easy_context.memory.maxlen import apply_max_length, max_length_settings

    runs = []
    monkeypatch.setattr(maxlen, "Run", lambda *a: runs.append(fused_layer.Run(*a)) or runs[-1])

    d = DeviceStorage()
    assert torch.equal(d.unpack(d.pack([torch.zeros(2)], 0, recipe=lambda: torch.ones(2)))[0],
                       torch.ones(2))
    model = _tiny_llama(3)
    apply_max_length(model, 8, 2, "full", keep_every=2)
    state = max_length_settings(model)
    ids = torch.randint(0, 61, (1, 16))
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    handles = state.storage.entries
    # layer 0: a recipe; layer 2 (the next group's first): its input itself
    assert callable(handles[0]) and isinstance(handles[2], offload._Entry)
    x0 = model.get_input_embeddings()(ids)
    assert torch.equal(handles[0](), x0)
    assert [r.input_recipe is not None for r in runs] == [True, False, False]
    pos = torch.arange(16)[None]
    tables = model.get_decoder().rotary_emb(x0, pos)
    for r in runs:  # every layer recomputes the decoder's tables
        assert all(torch.equal(a, b) for a, b in zip(r.rope_recipe(), tables))
    hidden.sum().backward()
    # a model that changes its embeddings before the first layer keeps that input
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda m, a, out: out.mul_(2.0))
    with torch.no_grad():
        assert state.input_recipe(emb(ids)) is None
    handle.remove()


@pytest.mark.parametrize("scale,softcap", [(1.0, 3.0), (0.25, None), (0.5, 2.0)])
def test_both_chunked_losses_soft_cap_and_scale_logits_like_the_model(scale, softcap):
    """Gemma 2's final soft-capping, Cohere's / Granite's logit scale: the chunked losses
    (plain and normed) against the full logits transformed by hand, float64."""
    from easy_context.memory.loss import LogitTransform

    torch.manual_seed(1)
    h = torch.randn(29, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (29,))
    y[::4] = -100
    norm = RMSNorm(16).double()
    t = LogitTransform(scale, softcap)

    def by_hand(x):
        z = (x @ w.T) * scale
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        return torch.nn.functional.cross_entropy(z, y, ignore_index=-100)

    for loss_of, hidden in ((lambda: chunked_cross_entropy(h, w, y, chunk_size=6, transform=t), h),
                            (lambda: normed_chunked_cross_entropy(h, norm, w, y, chunk_size=6,
                                                                  transform=t), norm(h))):
        got = loss_of()
        gh, gw = torch.autograd.grad(got, (h, w))
        want = by_hand(hidden)
        wh, ww = torch.autograd.grad(want, (h, w))
        assert torch.allclose(got, want, rtol=1e-12)
        assert torch.allclose(gh, wh, rtol=1e-9, atol=1e-12)
        assert torch.allclose(gw, ww, rtol=1e-9, atol=1e-12)


def test_max_length_survives_train_and_eval_of_a_loaded_model(tmp_path):
    """A model loaded with from_pretrained is kernelized by transformers >= 5.25
    (use_kernels on by default), and kernelized again at every train()/eval(), which pops
    instance forwards: max-length mode's final-norm fold was lost that way (the Trainer calls
    train(); the loss came out 4e-6 off, the final norm applied twice). Here the loss after
    train() and eval() equals the plain model's in float64."""
    import easy_context as ec
    from transformers import AutoModelForCausalLM

    from easy_context.memory.maxlen import apply_max_length

    _tiny_llama(2).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").double()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").double()
    ids = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(0))
    pos, tgt = torch.arange(24)[None], torch.roll(ids, -1, 1)
    want = ec.causal_lm_loss(plain, ids, pos, tgt, chunked=True, chunk_size=7)
    apply_max_length(model, 8, 2, "full")
    for switch in (model.train, model.eval, model.train):
        switch()
        got = ec.causal_lm_loss(model, ids, pos, tgt, chunked=True, chunk_size=7)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("path", ["fused", "generic"])
def test_inference_mode_forward(path):
    """A model in max-length mode runs under torch.inference_mode (the RoPE-recompute hook
    skips inference tensors, which keep no version counter), with the logits of no_grad."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import easy_context as ec
    from easy_context.memory.maxlen import apply_max_length

    config = AutoConfig.for_model("llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    ec.apply_sequence_parallel(model, "local")
    apply_max_length(model, 4, 2, "full", path=path)
    ids, pos = torch.randint(0, 97, (1, 12)), torch.arange(12)[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
    with torch.inference_mode():
        got = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
