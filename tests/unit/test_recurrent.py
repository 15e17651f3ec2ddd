"""Recurrent layers' pieces in one process: the piece tables of every layout cover the
sequence once, in order; any cutting of a sequence into pieces, chained (scan.chain), gives
the kernel's whole-sequence output and final state (within 1e-5, fp32, relative); packed
documents reset the state; refusals."""

import pytest
import torch

from easy_context import layouts
from easy_context.recurrent.delta_rule import chunk_gated_delta_rule, delta_rule_recurrence
from easy_context.recurrent.mamba2 import mamba2_chunk_scan, mamba2_recurrence
from easy_context.recurrent.pieces import Piece, piece_table, sequence_order
from easy_context.recurrent.scan import chain, piece_map
from easy_context.recurrent.selective_scan import selective_scan, selective_scan_recurrence
from tests.dist.recurrent_cases import _rel, document_ids, per_document

TOL = 1e-5


@pytest.mark.parametrize("layout,world,ring_degree", [
    ("contiguous", 4, None), ("zigzag", 4, None), ("usp", 4, 2), ("usp", 6, 2), ("usp", 6, 3),
    ("usp", 4, 1), ("usp", 4, 4), ("whole", 3, None)])
def test_piece_tables_cover_the_sequence_in_order(layout, world, ring_degree):
    length = layouts.required_multiple(layout, world, ring_degree) * 3
    x = torch.arange(length)[None]
    local = length if layout == "whole" else length // world
    table = piece_table(layout, world, local, ring_degree)
    for r, pieces in enumerate(table):
        held = layouts.shard(x, layout, r, len(table), ring_degree=ring_degree)[0]
        for p in pieces:
            assert held[p.start:p.stop].tolist() == list(range(p.position, p.position + p.length))
    pos = 0
    for p in sequence_order(table):
        assert p.position == pos
        pos += p.length
    assert pos == length


def _delta():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, length, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    tokens = {"q": torch.randn(b, length, hk, dk, generator=gen),
              "k": torch.randn(b, length, hk, dk, generator=gen),
              "v": torch.randn(b, length, hv, dv, generator=gen),
              "g": -torch.rand(b, length, hv, generator=gen),
              "beta": torch.rand(b, length, hv, generator=gen)}
    rec = delta_rule_recurrence(torch_chunk_gated_delta_rule, chunk_size=16,
                                use_qk_l2norm_in_kernel=True)
    return rec, tokens


def _mamba():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan as kernel

    gen = torch.Generator().manual_seed(0)
    b, length, h, p, g, n = 2, 37, 4, 6, 2, 8
    tokens = {"x": torch.randn(b, length, h, p, generator=gen),
              "dt": torch.randn(b, length, h, generator=gen),
              "B": torch.randn(b, length, g, n, generator=gen),
              "C": torch.randn(b, length, g, n, generator=gen)}
    rec = mamba2_recurrence(kernel, A=-torch.rand(h, generator=gen) - 0.5, chunk_size=8,
                            D=torch.randn(h, generator=gen), dt_bias=torch.randn(h, generator=gen),
                            dt_softplus=True)
    return rec, tokens


def _selective(kernel=None, gated=True):
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    gen = torch.Generator().manual_seed(0)
    b, length, d, n = 2, 37, 6, 4
    tokens = {"u": torch.randn(b, length, d, generator=gen),
              "delta": torch.randn(b, length, d, generator=gen),
              "B": torch.randn(b, length, n, generator=gen),
              "C": torch.randn(b, length, n, generator=gen)}
    if gated:
        tokens["z"] = torch.randn(b, length, d, generator=gen)
    # A (D, N): a decay per channel and state entry
    rec = selective_scan_recurrence(kernel or mamba_selective_scan,
                                    -torch.rand(d, n, generator=gen) - 0.2,
                                    D=torch.randn(d, generator=gen),
                                    delta_bias=torch.randn(d, generator=gen),
                                    delta_softplus=True, gated=gated)
    return rec, tokens


def _selective_ungated():
    return _selective(gated=False)


def _selective_mamba_ssm():
    from tests.unit.recurrent_standins import selective_scan_fn

    return _selective(selective_scan_fn)


def _kda(kernel=None):
    # KDA (Kimi Linear): the gated delta rule with a gate per key channel, g (B, L, H, d_k)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    gen = torch.Generator().manual_seed(1)
    b, length, h, dk, dv = 2, 37, 2, 4, 3
    tokens = {"q": torch.randn(b, length, h, dk, generator=gen),
              "k": torch.randn(b, length, h, dk, generator=gen),
              "v": torch.randn(b, length, h, dv, generator=gen),
              "g": -torch.rand(b, length, h, dk, generator=gen),
              "beta": torch.rand(b, length, h, generator=gen)}
    options = dict(use_qk_l2norm_in_kernel=True)
    if kernel is None:
        kernel, options["chunk_size"] = chunk_kimi_delta_attention, 16
    return delta_rule_recurrence(kernel, **options), tokens


def _kda_fla():
    from tests.unit.recurrent_standins import chunk_kda

    return _kda(chunk_kda)


def _delta_fla():
    from tests.unit.recurrent_standins import chunk_gated_delta_rule

    _, tokens = _delta()
    return delta_rule_recurrence(chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True), tokens


def _mamba_ssm():
    from tests.unit.recurrent_standins import mamba_chunk_scan_combined

    rec, tokens = _mamba()
    gen = torch.Generator().manual_seed(0)
    h = tokens["x"].size(2)
    return mamba2_recurrence(mamba_chunk_scan_combined, A=-torch.rand(h, generator=gen) - 0.5,
                             chunk_size=8, D=torch.randn(h, generator=gen),
                             dt_bias=torch.randn(h, generator=gen), dt_softplus=True), tokens


# the CUDA packages' signatures (stand-ins computing with transformers' torch paths)
@pytest.mark.parametrize("make", [_delta, _mamba, _delta_fla, _mamba_ssm, _kda, _kda_fla,
                                  _selective, _selective_ungated, _selective_mamba_ssm])
@pytest.mark.parametrize("cuts", [[0, 37], [0, 1, 2, 20, 37], [0, 16, 17, 33, 36, 37]])
@pytest.mark.parametrize("documents", [False, True])
def test_any_cutting_chains_to_the_whole_sequence(make, cuts, documents):
    rec, tokens = make()
    length = next(iter(tokens.values())).size(1)
    ids = document_ids(2, length) if documents else None
    ref_out = per_document(lambda t: rec.run(t)[0], tokens, ids)
    order = [Piece(0, j, a, b, a) for j, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    maps = {p: piece_map(rec, {k: t[:, p.start:p.stop] for k, t in tokens.items()},
                         None if ids is None else ids[:, p.start:p.stop]) for p in order}
    edges = None if ids is None else (lambda p: torch.stack([ids[:, p.start], ids[:, p.stop - 1]]))
    states = chain(rec, order, lambda p: (maps[p][3], maps[p][2]), edges)
    out = torch.cat([maps[p][0] if s is None else maps[p][0] + rec.read(maps[p][1], s)
                     for p, s in zip(order, states)], 1)
    assert _rel(out, ref_out) <= TOL
    if ids is None:  # the state after the sequence
        assert _rel(states[-1], rec.run(tokens)[1]) <= TOL


def test_the_public_functions_call_cuda_signatures_with_what_they_take():
    from tests.unit import recurrent_standins as standins

    standins.CALLS.clear()
    _, t = _delta()
    ids = document_ids(2, t["q"].size(1))
    out, final = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                        use_qk_l2norm_in_kernel=True, output_final_state=True,
                                        kernel=standins.chunk_gated_delta_rule, layout="whole",
                                        document_ids=ids)
    assert out.shape == t["v"].shape and final.shape == (2, 4, 8, 6)
    _, m = _mamba()
    y = mamba2_chunk_scan(m["x"], m["dt"], -torch.ones(4), m["B"], m["C"], 8, D=torch.ones(4),
                          dt_bias=torch.zeros(4), dt_softplus=True,
                          kernel=standins.mamba_chunk_scan_combined, layout="whole")
    assert y.shape == m["x"].shape
    _, s = _selective()
    u, z = s["u"].transpose(1, 2), s["z"].transpose(1, 2)  # (B, D, L), mamba-ssm's layout
    out, last = selective_scan(u, s["delta"].transpose(1, 2), -torch.ones(6, 4),
                               s["B"].transpose(1, 2), s["C"].transpose(1, 2), D=torch.ones(6),
                               z=z, delta_bias=torch.zeros(6), delta_softplus=True,
                               return_last_state=True, kernel=standins.selective_scan_fn,
                               layout="whole", document_ids=document_ids(2, u.size(-1)))
    assert out.shape == u.shape and last.shape == (2, 6, 4)
    from easy_context.recurrent.conv import causal_conv1d

    x = torch.randn(2, 8, 11)
    y = causal_conv1d(x, torch.randn(8, 4), torch.randn(8), "silu", layout="whole",
                      kernel=standins.causal_conv1d_fn)
    assert y.shape == x.shape
    assert {"fla", "mamba_ssm", "mamba_ssm selective_scan", "causal_conv1d"} <= set(standins.CALLS)


def test_initial_states_are_refused():
    rec, t = _delta()
    with pytest.raises(ValueError, match="zero state"):
        chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                               initial_state=torch.zeros(2, 4, 8, 6), kernel=lambda *a, **k: None)
    with pytest.raises(ValueError, match="zero state"):
        mamba2_chunk_scan(t["q"], t["g"], None, t["k"], t["k"], 8,
                          initial_states=torch.zeros(1), kernel=lambda *a, **k: None)


def test_the_exchange_figures_the_docs_quote():
    """docs/guides/hf-models.md and recurrent/mixer.py: with Qwen3NextConfig's defaults a
    linear layer sends 4.05 MiB x 2 (N-1) per piece, and less than a ring attention layer
    (2 KiB x 3 (N-1) per local token) from about 1.4K local tokens per piece on."""
    from transformers import Qwen3NextConfig

    from easy_context.parallel.ring import ring_comm
    from easy_context.parallel.method import AttentionDims
    from easy_context.recurrent.mixer import GATED_DELTA_NET

    c = Qwen3NextConfig()
    dims = GATED_DELTA_NET.dims(c.linear_num_key_heads, c.linear_num_value_heads,
                                c.linear_key_head_dim, c.linear_value_head_dim,
                                c.linear_conv_kernel_dim)
    for world in (2, 4, 8):
        sent = GATED_DELTA_NET.comm_bytes(dims, 1, 2, world)
        assert round(sent / (2 * (world - 1)) / 2**20, 2) == 4.05
        attention = AttentionDims(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        per_token = ring_comm(attention, 1, 2, world, None)
        assert per_token == 2048 * 3 * (world - 1)
        assert round(sent / per_token / 100) * 100 == 1400


def test_mixer_dims_are_what_the_scan_exchanges():
    # Mixer.dims(...).state is the float32 count of one piece's (A, B) per sequence, the size the
    # scan all-gathers (plan/ reads it): Mamba-1 2 D N, KDA H d_k (d_k + d_v)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    from easy_context.recurrent.mixer import KDA, MAMBA1, MIXERS

    rec, t = _selective()
    _, _, b, a = rec.extended(t)
    d, n = t["u"].size(-1), t["B"].size(-1)
    assert a[0].numel() + b[0].numel() == MAMBA1.dims(d, n, 4).state
    assert MAMBA1.dims(d, n, 4).conv_channels == d
    gen = torch.Generator().manual_seed(0)
    bsz, length, h, dk, dv = 2, 9, 3, 4, 5
    kda = {"q": torch.randn(bsz, length, h, dk, generator=gen),
           "k": torch.randn(bsz, length, h, dk, generator=gen),
           "v": torch.randn(bsz, length, h, dv, generator=gen),
           "g": -torch.rand(bsz, length, h, dk, generator=gen),  # a gate per channel
           "beta": torch.rand(bsz, length, h, generator=gen)}
    _, _, b, a = delta_rule_recurrence(chunk_kimi_delta_attention, chunk_size=4).extended(kda)
    assert a[0].numel() + b[0].numel() == KDA.dims(h, dk, dv, 4).state
    assert KDA.dims(h, dk, dv, 4).conv_channels == h * (2 * dk + dv)
    assert {"kda", "mamba1"} <= set(MIXERS)


def test_selective_scan_final_state_is_the_kernels():
    # the offset b, computed from the tokens (mamba-ssm's last state has no gradient), equals
    # the state transformers' kernel ends in
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    rec, t = _selective()
    A = -torch.rand(t["u"].size(-1), t["B"].size(-1), generator=torch.Generator().manual_seed(0))
    rec = selective_scan_recurrence(mamba_selective_scan, A - 0.2, delta_bias=torch.ones(6),
                                    delta_softplus=True, gated=True)
    _, last = mamba_selective_scan(*(t[k].transpose(1, 2) for k in ("u", "delta")), A - 0.2,
                                   *(t[k].transpose(1, 2) for k in ("B", "C")),
                                   z=t["z"].transpose(1, 2), delta_bias=torch.ones(6),
                                   delta_softplus=True, return_last_state=True)
    assert _rel(rec.run(t)[1], last) <= TOL


@pytest.mark.parametrize("make", [_delta_fla, _mamba_ssm, _kda_fla, _selective_mamba_ssm])
def test_bf16_through_the_cuda_signatures(make):
    # the CUDA packages train in bf16 and hand back states in their own dtypes (mamba-ssm's
    # chunked scan: C's, so bf16): the maps the scan exchanges and reads stay float32. Before,
    # a bf16 state from mamba-ssm met a float32 basis in the read and raised
    rec, tokens = make()
    tokens = {k: t.bfloat16() for k, t in tokens.items()}
    order = [Piece(0, j, a, b, a) for j, (a, b) in enumerate(zip([0, 5, 20], [5, 20, 37]))]
    maps = {p: piece_map(rec, {k: t[:, p.start:p.stop] for k, t in tokens.items()}, None)
            for p in order}
    assert all(m[2].dtype == m[3].dtype == torch.float32 for m in maps.values())
    states = chain(rec, order, lambda p: (maps[p][3], maps[p][2]))
    out = torch.cat([maps[p][0] if s is None else maps[p][0] + rec.read(maps[p][1], s).to(
        maps[p][0].dtype) for p, s in zip(order, states)], 1)
    ref = rec.run(tokens)[0]
    assert out.dtype == ref.dtype and _rel(out.float(), ref.float()) <= 3e-2


def test_selective_scan_blocks_of_rows_change_nothing(monkeypatch):
    # b and the read are computed ROWS rows at a time, each block recomputed in backward:
    # blocks of 4 rows (37 rows: 10 blocks, the last of 1) against one block, values and grads
    from easy_context.recurrent import selective_scan as ss

    def run(rows):
        monkeypatch.setattr(ss, "ROWS", rows)
        rec, t = _selective()
        t = {k: x.clone().requires_grad_() for k, x in t.items()}
        _, basis, b, a = rec.extended(t)
        s = torch.randn(b.shape, generator=torch.Generator().manual_seed(2))
        total = (b * 1.3).sum() + rec.read(basis, s).square().sum() + a.sum()
        total.backward()
        return [b, rec.read(basis, s)] + [t[k].grad for k in sorted(t)]

    for x, ref in zip(run(4), run(1000)):
        assert _rel(x, ref) <= TOL


def test_mamba2_piece_map_runs_the_kernel_once_on_the_layers_channels():
    """Mamba-2's piece map calls the kernel once, on the layer's own P channels from a zero
    state; its transition and each row's read of an incoming state (closed form: a scalar
    decay per head) are what the kernel gives N extra zero-input channels started from the
    identity (the identity-block trick, which cost N / P kernel channels more: 32x for the
    families sweep's tiny Falcon-H1, P 8 and N 256), within TOL."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan as kernel

    _, tokens = _mamba()
    gen = torch.Generator().manual_seed(1)
    h, p, n = 4, 6, 8
    options = dict(A=-torch.rand(h, generator=gen) - 0.5, D=torch.randn(h, generator=gen),
                   dt_bias=torch.randn(h, generator=gen), dt_softplus=True,
                   dt_limit=(0.0, 1.5))  # the clamp bites: softplus(dt + bias) reaches 3
    channels = []

    def counting(x, *args, **kwargs):
        channels.append(x.size(-1))
        return kernel(x, *args, **kwargs)

    rec = mamba2_recurrence(counting, chunk_size=8, **options)
    o0, basis, state, a = rec.extended(tokens)
    assert channels == [p]
    b, length = tokens["x"].shape[:2]
    x_ext = torch.cat([tokens["x"], tokens["x"].new_zeros(b, length, h, n)], -1)
    init = torch.cat([torch.zeros(b, h, p, n), torch.eye(n).expand(b, h, n, n)], -2)
    want, final = kernel(x_ext, tokens["dt"], options["A"], tokens["B"], tokens["C"], 8,
                         initial_states=init, return_final_states=True,
                         **{k: v for k, v in options.items() if k != "A"})
    for got, ref in ((o0, want[..., :p]), (basis, want[..., p:]), (state, final[..., :p, :]),
                     (a, final[..., p:, :])):
        err = _rel(got.float(), ref.float())
        assert err <= TOL, err
