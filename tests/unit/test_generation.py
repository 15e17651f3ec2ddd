"""The pieces of easy_context.generate in one process: the decode step's masks and partial
attention, token choice, stopping, and the refusals (tests/dist/test_generate.py runs the
whole thing on 1, 2 and 4 ranks against transformers)."""

from __future__ import annotations

import copy
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


def test_decode_scores_are_float32_for_a_bf16_cache():
    """bf16 queries and keys whose products need more than bf16's 8 bits: the scores (and so
    the lse) come out as float32 products of the bf16 values, as the prefill's kernels make
    them, not rounded to bf16 first (which was off by ~1e-2 here)."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, 64, generator=g) * 3).bfloat16()
    k = (torch.randn(2, 2, 40, 64, generator=g) * 3).bfloat16()
    v = torch.randn(2, 2, 40, 16, generator=g).bfloat16()
    seen = torch.ones(2, 40, dtype=torch.bool)
    _, lse = partial_attention(q, k, v, seen, scale=64 ** -0.5)
    kk = k.double().repeat_interleave(2, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kk) * 64 ** -0.5
    err = float((lse.double() - torch.logsumexp(s, dim=-1)).abs().max())
    assert err <= 1e-5, err


def _greedy_pair(model, ids, mask, **kw):
    want = copy.deepcopy(model).generate(ids, attention_mask=mask, max_new_tokens=12,
                                         pad_token_id=0, **kw)
    got = ec.generate(copy.deepcopy(model), ids, attention_mask=mask, method="local", max_new_tokens=12,
                      pad_token_id=0, **kw)
    return want[:, ids.size(1):].tolist(), got[:, ids.size(1):].tolist()


def _left_padded(vocab=50):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def test_repetition_penalty_and_min_new_tokens_as_transformers():
    """Greedy with RepetitionPenaltyLogitsProcessor (the prompt without its padding, and the
    tokens so far) and MinNewTokensLengthLogitsProcessor (no EOS before min_new_tokens):
    transformers' tokens. The penalty changes them, and the EOS would end row 0 early."""
    model = _tiny()
    ids, mask = _left_padded()
    plain, _ = _greedy_pair(model, ids, mask, eos_token_id=[])
    want, got = _greedy_pair(model, ids, mask, repetition_penalty=1.8, eos_token_id=[])
    assert got == want and want != plain
    eos = plain[0][1]  # row 0's second token
    want, got = _greedy_pair(model, ids, mask, eos_token_id=eos, min_new_tokens=5)
    assert got == want and eos not in want[0][:5]


def test_the_models_generation_config_is_honoured():
    """Settings left out come from model.generation_config, as in transformers: its
    repetition_penalty gives transformers' tokens; its do_sample samples (a hot temperature:
    not the greedy tokens), and an explicit do_sample=False still wins."""
    model = _tiny()
    ids, mask = _left_padded()
    model.generation_config.repetition_penalty = 1.8
    want, got = _greedy_pair(model, ids, mask, eos_token_id=[])
    model.generation_config.repetition_penalty = 1.0
    plain, _ = _greedy_pair(model, ids, mask, eos_token_id=[])
    assert got == want and want != plain
    model.generation_config.do_sample = True
    model.generation_config.temperature = 5.0
    sampled = ec.generate(model, ids, attention_mask=mask, method="local", max_new_tokens=12,
                          eos_token_id=[], seed=0)[:, 9:].tolist()
    assert sampled != plain
    greedy = ec.generate(model, ids, attention_mask=mask, method="local", max_new_tokens=12,
                         eos_token_id=[], do_sample=False)[:, 9:].tolist()
    assert greedy == plain


def test_min_p_top_k_top_p_keep_what_transformers_warpers_keep():
    """The tokens sampling can pick: exactly those transformers' warpers (temperature,
    top-k, top-p, min-p, in its order) leave finite."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4)) * 2
    for kw in (dict(min_p=0.2), dict(min_p=0.05, top_k=10, temperature=0.7),
               dict(top_p=0.9, min_p=0.1, temperature=1.3)):
        warpers = LogitsProcessorList([TemperatureLogitsWarper(kw.get("temperature", 1.0))])
        if "top_k" in kw:
            warpers.append(TopKLogitsWarper(kw["top_k"]))
        if "top_p" in kw:
            warpers.append(TopPLogitsWarper(kw["top_p"]))
        warpers.append(MinPLogitsWarper(kw["min_p"]))
        allowed = set(torch.isfinite(warpers(None, logits.clone()))[0].nonzero().flatten().tolist())
        picks = TokenChooser(SamplingConfig(True, seed=0, **kw))(logits.expand(3000, -1))
        assert set(picks.tolist()) == allowed, kw


def test_num_return_sequences_and_a_streamer():
    """Each prompt repeated in place (as transformers expands it), sampled differently; a
    streamer gets the prompts, each step's tokens, then end(), as transformers calls it."""
    model = _tiny()
    ids, mask = _left_padded()

    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.clone())

        def end(self):
            self.calls.append("end")

    streamer = Recorder()
    out = ec.generate(model, ids, attention_mask=mask, method="local", max_new_tokens=6,
                      do_sample=True, num_return_sequences=3, seed=1, eos_token_id=[],
                      streamer=streamer)
    assert out.shape == (6, 15)
    assert torch.equal(out[:, :9], ids.repeat_interleave(3, dim=0))
    assert len({tuple(r) for r in out[:3, 9:].tolist()}) > 1  # three different samples
    assert streamer.calls[-1] == "end" and len(streamer.calls) == 1 + 6 + 1
    assert torch.equal(streamer.calls[0], out[:, :9])
    assert torch.equal(torch.stack(streamer.calls[1:-1], dim=1), out[:, 9:])
    with pytest.raises(ValueError, match="num_return_sequences=2 with greedy decoding"):
        ec.generate(model, ids, method="local", num_return_sequences=2)


def test_generate_leaves_no_inference_tensors():
    """torch.no_grad, not torch.inference_mode: nothing generate returns or leaves behind
    is an inference tensor, which a following training step could not use."""
    model = _tiny()
    ids, mask = _left_padded()
    out = ec.generate(model, ids, attention_mask=mask, method="local", max_new_tokens=3)
    assert not out.is_inference()


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_models_with_recurrent_state_generate_as_transformers(family):
    """A short-convolution (LFM2) or gated DeltaNet + conv (Qwen3-Next) model decodes from
    the prompt's state, kept by its routed layers at the prefill: token for token what
    transformers' greedy generate gives (prompts of 13 and 3, the second shorter than the
    conv kernel, padded after its end). These were refused before ("carry a recurrent or
    convolution state"); tests/dist/test_generate_hybrid.py runs them on 1, 2 and 4 ranks."""
    from tests.dist.hf_recurrent_cases import tiny_hybrid, tiny_qwen3_next

    model = (tiny_hybrid("lfm2") if family == "lfm2" else tiny_qwen3_next()).eval()
    for length in (13, 3):
        ids = torch.randint(3, 50, (1, length), generator=torch.Generator().manual_seed(length))
        want = copy.deepcopy(model).generate(ids, max_new_tokens=6, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
        got = ec.generate(copy.deepcopy(model), ids, method="zigzag_ring_attn",
                          max_new_tokens=6, eos_token_id=[], pad_token_id=0)
        assert got.tolist() == want.tolist(), (length, got.tolist(), want.tolist())


def test_unrouted_recurrent_layers_are_refused():
    """MiniMax's lightning attention (a linear attention with a state) is not routed:
    generate refuses it before any collective (it would decode each new token from no
    state). Jamba's Mamba-1, refused here before, now decodes (test_generate_hybrid.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "minimax", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="carry a recurrent or convolution state "
                                         r"\(linear_attention\)"):
        ec.generate(model, torch.randint(3, 50, (1, 12)), method="local", max_new_tokens=4)


def test_jamba_generates_and_keeps_no_cache_on_its_layers():
    """Jamba's decoder layer passes its Mamba-1 mixer none of its keyword arguments: generate's
    cache reaches the mixer's kernels through a hook on that caller, recorded on the mixer for
    the call only (after generate no layer holds the prompts' KV and states); the decode is
    transformers' greedy generate's, token for token."""
    from tests.dist.generate_cases import LOGITS_TOL, MAMBA_IN_SCALE
    from tests.dist.hf_recurrent_cases import tiny_hybrid

    model = tiny_hybrid("jamba").eval()
    with torch.no_grad():  # a state large enough that decoding from none changes the tokens
        model.model.layers[0].mamba.in_proj.weight.mul_(MAMBA_IN_SCALE)
    ids = torch.randint(3, 50, (1, 9), generator=torch.Generator().manual_seed(9))
    want = copy.deepcopy(model).generate(ids, max_new_tokens=6, do_sample=False,
                                         eos_token_id=None, pad_token_id=0, output_logits=True,
                                         return_dict_in_generate=True)
    got = ec.generate(model, ids, method="zigzag_ring_attn", max_new_tokens=6,
                      eos_token_id=[], pad_token_id=0, output_logits=True, return_stats=True)
    assert got.sequences.tolist() == want.sequences.tolist()
    # the tokens of so tiny a model may survive a lost state; its logits do not (0.05 off)
    want_logits = torch.stack(want.logits, 1)
    err = (torch.stack(got.logits, 1) - want_logits).abs().max() / want_logits.abs().max()
    assert float(err) <= LOGITS_TOL, float(err)
    mixer = next(m for m in model.modules() if type(m).__name__ == "JambaMambaMixer")
    assert not any(k.endswith("_generating") for k in mixer.__dict__)


def test_recurrent_layers_not_switched_are_refused():
    """A model whose attention is switched but whose recurrent layers are not (their settings
    gone) is refused: their kernels would run without generate's state."""
    from easy_context.parallel.settings import ATTR
    from tests.dist.hf_recurrent_cases import tiny_qwen3_next

    model = tiny_qwen3_next().eval()
    ec.apply_sequence_parallel(model, "local")
    for m in model.modules():
        if type(m).__name__ == "Qwen3NextGatedDeltaNet":
            delattr(m, ATTR)
    with pytest.raises(ValueError, match="recurrent layers .*Qwen3NextGatedDeltaNet.* are not "
                                         "switched"):
        ec.generate(model, torch.randint(3, 50, (1, 12)), max_new_tokens=4)


def test_single_step_kernels_run_only_inside_generate():
    """generate lets a routed layer's single-step kernels run inside its decode calls only:
    afterwards the model given a transformers cache still refuses (its recurrent layers
    would decode a shard's state as the whole sequence's)."""
    from tests.dist.hf_recurrent_cases import tiny_qwen3_next

    model = tiny_qwen3_next().eval()
    ids = torch.randint(3, 50, (1, 8))
    ec.generate(model, ids, method="zigzag_ring_attn", max_new_tokens=3)
    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet")
    assert not any(k.endswith("_decoding") for k in layer.__dict__)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=True)
