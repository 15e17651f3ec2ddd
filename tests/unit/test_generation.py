"""The pieces of easy_context.generate in one process: the decode step's masks and partial
attention, token choice, stopping, and the refusals (tests/dist/test_generate.py runs the
whole thing on 1, 2 and 4 ranks against transformers)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import easy_context as ec
from easy_context.generation.decode_attention import partial_attention, visible_keys
from easy_context.generation.generate import check_rope_range
from easy_context.generation.sampling import SamplingConfig, StopCriteria, TokenChooser


def _tiny(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_visible_keys_follow_positions_windows_chunks_and_padding():
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]])  # any layout
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 0] = False  # a pad slot
    q = torch.tensor([6, 7])
    assert visible_keys(pos, valid, q).tolist() == [[True] * 7 + [False], [False] + [True] * 7]
    window = visible_keys(pos, valid, q, sliding_window=3)  # q - k < 3
    assert window[0].nonzero().flatten().tolist() == [4, 5, 6]
    assert sorted(pos[1][window[1]].tolist()) == [5, 6]  # 7 is the pad slot
    chunk = visible_keys(pos, valid, q, chunk_size=4)  # same chunk of 4 as the query
    assert pos[0][chunk[0]].tolist() == [4, 5, 6]
    assert sorted(pos[1][chunk[1]].tolist()) == [4, 5, 6]


def test_partial_attention_equals_softmax_and_marks_rows_that_see_nothing():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 2, 5, 6, generator=g, dtype=torch.float64))
    seen = torch.tensor([[True, False, True, True, False], [False] * 5])
    out, lse = partial_attention(q, k, v, seen, scale=0.3, softcap=2.0)
    kk = k.repeat_interleave(2, dim=1)  # (B, Hq, n, D)
    s = 2.0 * torch.tanh(torch.einsum("bhd,bhnd->bhn", q, kk) * 0.3 / 2.0)
    s = s.masked_fill(~seen[:, None], float("-inf"))
    want_lse = torch.logsumexp(s[0], dim=-1)
    want = torch.einsum("hn,hnd->hd", torch.softmax(s[0], dim=-1), v.repeat_interleave(2, 1)[0])
    torch.testing.assert_close(lse[0].double(), want_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(out[0].double(), want, rtol=1e-6, atol=1e-7)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()  # merged as nothing


def test_greedy_top_k_one_and_tiny_top_p_are_argmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    greedy = TokenChooser(SamplingConfig())(logits)
    assert torch.equal(greedy, logits.argmax(-1))
    for cfg in (SamplingConfig(True, top_k=1, seed=3), SamplingConfig(True, top_p=1e-9, seed=3)):
        assert torch.equal(TokenChooser(cfg)(logits), greedy)


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).expand(4000, 3)
    picks = TokenChooser(SamplingConfig(True, seed=0))(logits)
    freq = torch.bincount(picks, minlength=3).double() / len(picks)
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64), atol=0.03)
    # top_p 0.8 keeps the two tokens whose mass reaches it; temperature sharpens
    picks = TokenChooser(SamplingConfig(True, top_p=0.8, seed=0))(logits)
    assert set(picks.tolist()) == {0, 1}
    hot = TokenChooser(SamplingConfig(True, temperature=0.25, seed=0))(logits)
    assert (hot == 0).double().mean() > 0.9
    again = TokenChooser(SamplingConfig(True, seed=0))(logits)
    other = TokenChooser(SamplingConfig(True, seed=1))(logits)
    first = TokenChooser(SamplingConfig(True, seed=0))(logits)
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("kw,message", [
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be >= 1"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
])
def test_sampling_settings_are_checked(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig(**kw)


class _Chars:
    """A tokenizer whose token i is the character chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def test_stop_strings_end_a_row_after_the_token_that_completes_them():
    stops = StopCriteria([25], ["cd"], _Chars())
    done = torch.zeros(2, dtype=torch.bool)
    texts = [[], []]
    for step, (a, b) in enumerate([(0, 2), (2, 25), (3, 3)]):  # "acd"..., "cz"
        texts[0].append(a)
        if not done[1]:
            texts[1].append(b)
        done = stops.update(texts, torch.tensor([a, b]), done)
        if step == 1:
            assert done.tolist() == [False, True]  # row 1: EOS (25)
    assert done.tolist() == [True, True]  # row 0: "acd" ends with "cd"
    with pytest.raises(ValueError, match="stop_strings need the tokenizer"):
        StopCriteria([], ["x"], None)


def test_refusals_say_what_to_change():
    model = _tiny()
    ids = torch.randint(3, 50, (2, 10))
    right = torch.ones_like(ids)
    right[0, -3:] = 0
    with pytest.raises(ValueError, match="padding_side='left'"):
        ec.generate(model, ids, attention_mask=right, method="local")
    with pytest.raises(ValueError, match=r"exceed the model's RoPE range \(max_position_embeddings=64\)"):
        ec.generate(model, ids, method="local", max_new_tokens=60)
    probe = ec.generate(model, ids, method="local", max_new_tokens=60, beyond_rope_range=True)
    assert probe.shape == (2, 70)  # past the range on purpose, when asked
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        ec.generate(model, ids, method="local", max_new_tokens=0)
    with pytest.raises(ValueError, match="not switched to sequence-parallel attention"):
        ec.generate(_tiny(), ids)
    # a scaled RoPE may go past max_position_embeddings
    scaled = _tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64})
    check_rope_range(scaled.config, 200)
    assert math.isfinite(float(ec.generate(scaled, ids, method="local", max_new_tokens=3)
                               .float().sum()))
