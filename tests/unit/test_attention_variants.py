"""Windows, chunks, soft-capping, sinks and MLA head dims below the methods: the band tiling,
the plan's calls, the flash-attn adapters' arguments, the ring's skipped steps, and the
Hugging Face families on one process.

Tolerances: float32 against float64 ground truth, 1e-5 of its max |value| (measured: about
2e-6); the families against their own eager attention, 1e-5 relative (loss, every gradient).
"""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import easy_context as ec
from easy_context import layouts
from easy_context.attention import bands
from easy_context.attention.documents import Geometry, ShardDocuments
from easy_context.attention import flash_attn_adapters as fa
from easy_context.attention.kernels import CPU_FLASH, masked_backward, masked_forward, offsets
from easy_context.attention.variants import adapt, with_softcap
from easy_context.parallel.dist_flash import _steps
from easy_context.parallel.ring import contiguous_schedule, ring_steps
from easy_context.parallel.zigzag import zigzag_schedule

from . import kernel_standins as standins

TOL = 1e-5


def _band_mask(sq, sk, lo, hi):
    d = torch.arange(sk)[None] - torch.arange(sq)[:, None]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if lo is not None:
        keep &= d >= lo
    if hi is not None:
        keep &= d <= hi
    return keep


def _piece_mask(p, lo, hi):
    n, m = p.rows.stop - p.rows.start, p.keys.stop - p.keys.start
    if p.kind == bands.FULL:
        return torch.ones(n, m, dtype=torch.bool)
    if p.kind == bands.CAUSAL:
        assert n == m
        return torch.ones(n, n, dtype=torch.bool).tril()
    if p.kind == bands.FLIPPED:
        assert n == m
        return torch.ones(n, n, dtype=torch.bool).triu()
    shift = p.rows.start - p.keys.start
    return _band_mask(n, m, None if lo is None else lo + shift, None if hi is None else hi + shift)


def test_band_pieces_cover_the_band_once():
    """Every (query, key) of the band in exactly one piece, and no other pair."""
    rng = random.Random(0)
    for _ in range(300):
        sq, sk = rng.randint(1, 700), rng.randint(1, 700)
        lo = rng.choice([None, rng.randint(-700, 50)])
        hi = rng.choice([None, rng.randint(-50, 700)]) if lo is not None else rng.randint(-50, 700)
        if lo is not None and hi is not None and hi < lo:
            lo, hi = hi, lo
        cover = torch.zeros(sq, sk, dtype=torch.int32)
        for p in bands.pieces(sq, sk, lo, hi):
            cover[p.rows, p.keys] += _piece_mask(p, lo, hi).int()
        assert torch.equal(cover, _band_mask(sq, sk, lo, hi).int()), (sq, sk, lo, hi)


def _dense(q, k, v, lo, hi, softcap=None):
    g = q.size(2) // k.size(2)
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    x = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    x = x.masked_fill(~_band_mask(q.size(1), k.size(1), lo, hi), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(x, -1).nan_to_num(0), vv)


@pytest.mark.parametrize("sq,sk,window,dv,softcap", [
    (300, 300, (99, 0), 16, None), (700, 700, (300, 0), 8, None), (40, 90, (7, 3), 16, None),
    (129, 200, (150, 0), 16, 2.0), (200, 200, (1, 0), 24, None), (600, 1000, (-1, 0), 16, None),
    (50, 30, (5, 0), 16, None), (700, 700, (600, 0), 16, None),
    # an image span's queries against its later keys (documents._span_bands): the square's
    # upper triangle (0, -1), flipped into a causal square; and a block of a span cut by a shard
    (300, 300, (0, -1), 16, None), (20, 20, (0, -1), 16, None), (120, 200, (85, -1), 16, None)])
def test_windowed_calls_on_the_cpu_op_equal_the_band(sq, sk, window, dv, softcap):
    """The CPU op has no window, softcap or own v head dim: adapt tiles, pads, or falls back."""
    torch.manual_seed(0)
    q = torch.randn(2, sq, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, 2, dv, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, sq, 4, dv, dtype=torch.float64)
    lo, hi = offsets(sq, sk, False, window)
    ref = _dense(q, k, v, lo, hi, softcap)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    kernel = with_softcap(CPU_FLASH, softcap) if softcap else adapt(CPU_FLASH)
    args = [t.detach().float() for t in (q, k, v)]
    out, lse = kernel.forward(*args, causal=False, scale=0.3, window=window)
    mine = kernel.backward(dout.float(), *args, out, lse, causal=False, scale=0.3, window=window)
    scale = lambda t: t.abs().max()
    assert (out - ref).abs().max() <= TOL * scale(ref)
    for g, r in zip(mine, grads):
        assert (g - r).abs().max() <= TOL * scale(r)
    # the reference takes the same calls natively
    o2, l2 = masked_forward(*args, 0.3, lo, hi, softcap)
    assert (o2 - ref).abs().max() <= TOL * scale(ref)
    assert all((g - r).abs().max() <= TOL * scale(r)
               for g, r in zip(masked_backward(dout.float(), *args, o2, l2, 0.3, lo, hi, softcap),
                               grads))


def test_a_band_on_the_cpu_op_costs_about_its_share():
    """The CPU op computes every score of a non-causal call, and a causal square under 512
    rows whole (it skips masked work in blocks of 512 keys); counting every call as rows x
    keys (an upper bound for causal squares over 512 rows), a 1K window
    over 4K rows (bf16) costs at most 1.3x the band's scores (masked tiles of 256 rows: 1.25x);
    the flipped and causal pieces cost about 2x (n^2 for each square of n ~ W rows)."""
    calls = []

    def forward(q, k, v, causal=False, scale=None, attn_mask=None):
        calls.append((q.size(1), k.size(1)))
        return CPU_FLASH.forward(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask)

    op = ec.attention.contract.Kernel("counted", forward, CPU_FLASH.backward, additive_mask=True)
    s, w = 4096, 1024
    q, k, v = (torch.randn(1, s, 1, 16, dtype=torch.bfloat16) for _ in range(3))
    adapt(op).forward(q, k, v, causal=False, scale=0.25, window=(w - 1, 0))
    band = int(_band_mask(s, s, -(w - 1), 0).sum())
    work = sum(n * m for n, m in calls)
    assert work <= 1.3 * band, (work / band, len(calls))


@pytest.mark.parametrize("name,make,dv", [
    ("2.6", lambda: fa.adapter_2_6(standins.flash_attn_2_6()), 8),
    ("2.7", lambda: fa.adapter_2_7(standins.flash_attn_2_7()), 8),
    ("2.7 MLA", lambda: fa.adapter_2_7(standins.flash_attn_2_7()), 6),
    ("4", lambda: fa.adapter_4(standins.flash_attn_4()), 8),
    ("4 MLA", lambda: fa.adapter_4(standins.flash_attn_4()), 6)])
@pytest.mark.parametrize("window,softcap", [((3, 0), None), ((5, 2), 2.0), (None, 1.5),
                                            ((-1, 4), None), ((4, -1), None)])
def test_flash_attn_runs_windows_and_softcap_itself(name, make, dv, window, softcap):
    """One kernel call each way (no tiling), with flash-attn's own argument conventions (the
    stand-ins apply them as the real C++ / cute code does); flash-attn 2 gets v padded."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 20, 4, 8), torch.randn(2, 24, 2, 8)
    v, dout = torch.randn(2, 24, 2, dv), torch.randn(2, 20, 4, dv)
    kernel = adapt(make())
    standins.CALLS.clear()
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.4, window=window, softcap=softcap)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.4, window=window,
                            softcap=softcap)
    assert len(standins.CALLS) == 2, standins.CALLS
    ref = adapt(CPU_FLASH) if softcap is None else with_softcap(CPU_FLASH, softcap)
    r_out, r_lse = ref.forward(q, k, v, causal=False, scale=0.4, window=window)
    r_grads = ref.backward(dout, q, k, v, r_out, r_lse, causal=False, scale=0.4, window=window)
    assert out.shape == (2, 20, 4, dv) and grads[2].shape == v.shape
    assert (out - r_out).abs().max() <= TOL * r_out.abs().max()
    for g, r in zip(grads, r_grads):
        assert (g - r).abs().max() <= TOL * r.abs().max()


def _plan_mask(docs, qs, ks, nq, nk):
    """The (nq, nk) mask the plan's calls of a block cover, for batch row 0."""
    cover = torch.zeros(nq, nk, dtype=torch.int32)
    for c in docs.calls(qs, slice(None), ks, slice(None), False):
        if c.batch != slice(None) and c.batch.start != 0:
            continue
        rows, keys = range(nq)[c.q], range(nk)[c.kv]
        n, m = len(rows), len(keys)
        if c.window is not None:
            assert all(side >= -1 for side in c.window) and not c.causal
            part = _band_mask(n, m, *offsets(n, m, False, c.window))
        elif c.causal:
            assert n == m
            part = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            part = torch.ones(n, m, dtype=torch.bool)
        assert part.any(), "a call where no query sees a key"
        cover[rows.start:rows.stop, keys.start:keys.stop] += part.int()
    return cover


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_plan_covers_exactly_what_the_layer_sees(layout):
    """For every pair of shards: the calls cover each visible (query, key) pair once, with
    windows below, around and past a shard, chunks, and documents."""
    rng = random.Random(2)
    for _ in range(40):
        world, half = rng.choice([2, 3, 4]), rng.randint(1, 7)
        s = 2 * half
        length = world * s
        window, chunk = rng.choice([None, rng.randint(1, length + 3)]), None
        if window is None or rng.random() < 0.3:
            chunk = rng.randint(1, length)
        segments = tuple(layouts.segments(layout, r, world, s) for r in range(world))
        geometry = Geometry(segments, True, window, chunk)
        ids = torch.sort(torch.randint(0, 3, (1, length)), dim=1).values
        shards = torch.stack([layouts.shard(ids, layout, r, world) for r in range(world)])
        docs = ShardDocuments.from_ids(shards, geometry)
        index = torch.stack([layouts.shard(torch.arange(length)[None], layout, r, world)[0]
                             for r in range(world)])
        for qs in range(world):
            for ks in range(world):
                i, j = index[qs][:, None], index[ks][None]
                want = (j <= i) & (ids[0, index[qs]][:, None] == ids[0, index[ks]][None])
                if window:
                    want &= i - j < window
                if chunk:
                    want &= i // chunk == j // chunk
                got = _plan_mask(docs, qs, ks, s, s)
                assert torch.equal(got, want.int()), (layout, world, s, window, chunk, qs, ks)


def test_a_ring_stops_where_the_window_ends():
    """Steps past the window's reach run nowhere (no kernel, no transfer): contiguous shards
    of 8 on 4 ranks need 1 step for a window of 1, 2 for 3..9, 3 up to 17; zigzag shards hold
    chunks from both ends, so their ring needs every step."""
    def steps(layout, schedule, window, world=4, s=8):
        g = Geometry(tuple(layouts.segments(layout, r, world, s) for r in range(world)), True,
                     window)
        return ring_steps(schedule, ShardDocuments.plain((s,) * world, g), world, s, True)

    assert [steps("contiguous", contiguous_schedule, w) for w in (1, 3, 9, 10, 17, 18)] == \
        [1, 2, 2, 3, 3, 4]
    assert steps("zigzag", zigzag_schedule, 3) == 4
    g = Geometry(tuple(layouts.segments("contiguous", r, 4, 8) for r in range(4)), True, 3)
    docs = ShardDocuments.plain((8,) * 4, g)
    tasks = [t for step in _steps(4, True, 8, docs) for t in step]
    assert len(_steps(4, True, 8, docs)) == 2  # the diagonal and the neighbour steps
    assert {t.q_owner - t.kv_owner for t in tasks} == {0, 1}


# --------------------------------------------------------------------------- models
from tests.dist.hf_cases import VARIANT_FAMILIES, make_batch, tiny_model  # noqa: E402


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("family", sorted(VARIANT_FAMILIES))
def test_families_on_one_process_equal_their_own_attention(family, chunked):
    """world 1: the model with our attention against itself with its eager attention; the
    chunked loss applies Gemma 2's final soft-capping and Cohere 2's logit scale itself."""
    base = tiny_model(family)
    inputs, positions, targets = make_batch(24, base.config.vocab_size)
    ref = copy.deepcopy(base)
    logits = ref(input_ids=inputs, position_ids=positions).logits.float()
    ref_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")
    loss = ec.causal_lm_loss(model, inputs, positions, targets, chunked=chunked, chunk_size=7)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert (p.grad - r.grad).abs().max() <= TOL * r.grad.abs().max().clamp(min=1e-6), name


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Stub(torch.nn.Module):
    def __init__(self, **config):
        super().__init__()
        self.config = _Config(**config)


@pytest.mark.parametrize("config,named", [
    (dict(layer_types=["linear_attention", "full_attention"]), "linear_attention"),
    (dict(layer_types=["conv", "full_attention", "conv"]), "conv"),
    (dict(layers_block_type=["mamba", "attention"]), "mamba")])
def test_layers_that_are_not_attention_are_refused_by_name(config, named):
    with pytest.raises(ValueError, match=named):
        ec.check_model_supported(_Stub(**config))


def test_llama4_temperature_tuning_is_taken_from_global_positions():
    """Accepted: the NoPE layer's scale comes from the tokens' positions while a sequence-
    parallel attention runs it, transformers' own scaling otherwise (exactness at 2 and 4
    ranks: tests/dist/test_whole_sequence.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from easy_context.integrations.whole_sequence import temperature_of
    from tests.dist.hf_cases import COMMON
    config = dict(VARIANT_FAMILIES["llama4_text"], attn_temperature_tuning=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama4_text", **{**COMMON, **config}))
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")
    nope, rope = (layer.self_attn for layer in (model.model.layers[1], model.model.layers[0]))
    assert temperature_of(nope) is not None and temperature_of(rope) is None
    ids = torch.randint(0, 97, (1, 12))
    model(input_ids=ids, position_ids=torch.arange(12)[None])
    assert nope.attn_temperature_tuning is False  # ours applied it
    model.set_attn_implementation("eager")
    model(input_ids=ids)
    assert nope.attn_temperature_tuning is True  # transformers' own again
    # switched by name only, without the hooks: refused, not scaled from the shard
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama4_text", **{**COMMON, **config}),
        attn_implementation="zigzag_ring_attn")
    with pytest.raises(ValueError, match="attn_temperature_tuning.*apply_sequence_parallel"):
        plain(input_ids=ids, position_ids=torch.arange(12)[None])


def test_window_traffic_for_the_planner():
    """A 1K window at 16K on 2 zigzag ranks: each rank sends the 1,023 K/V rows its
    neighbour's window reaches (and as many dK/dV rows back), not its 8,192-row shard; a
    contiguous ring of 8 ranks at 128K under a 4K window runs 2 steps."""
    from easy_context.parallel.method import AttentionDims
    from easy_context.parallel.window_cost import window_traffic

    row = 2 * 8 * 64 * 2  # K and V, 8 heads of 64, bf16
    t = window_traffic("zigzag_ring_attn", AttentionDims(8, 8, 64), 16384, 2, 1024)
    assert (t["forward_bytes"], t["backward_bytes"]) == (1023 * row, 2 * 1023 * row)
    assert (t["global_forward_bytes"], t["global_backward_bytes"]) == (8192 * row, 2 * 8192 * row)
    ring = window_traffic("ring_attn", AttentionDims(8, 2, 64), 131072, 8, 4096)
    assert (ring["steps"], ring["of"]) == (2, 8)
    # all-gather: its halo, the 511 rows before its later chunk (chunk 2), to rank 0
    ag = window_traffic("allgather_attn", AttentionDims(8, 2, 64), 4096, 2, 512)
    assert ag["forward_bytes"] == 511 * 2 * 2 * 64 * 2, ag
