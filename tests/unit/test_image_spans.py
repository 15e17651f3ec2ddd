"""Image spans (Gemma 3: image tokens attend to each other both ways) on one device.

The CPU op (torch's flash op, a span's upper triangle run as a flipped causal square by
bands.py) and the reference kernel, with random spans, sliding windows and packed documents,
against float64 attention with the mask written out (tests/dist/image_span_cases.py, which
writes transformers' composition from scratch); and the plan: a block of later keys gets
calls only where a span crosses into it.
"""

import random

import pytest
import torch

from easy_context.attention.documents import Geometry, ShardDocuments, schedule_causal
from easy_context.attention.variants import Variant, variant_of
from easy_context.parallel.local import local_attention

from tests.dist.image_span_cases import dense_attention, span_mask

TOL = 1e-5


def _random_spans(rng: random.Random, length: int) -> tuple:
    spans, at = [], rng.randrange(0, 8)
    while at < length - 1:
        n = rng.randrange(1, 48)
        spans.append((at, min(length, at + n)))
        at = min(length, at + n) + rng.randrange(0, 20)
    return tuple(spans)


@pytest.mark.parametrize("kernel", ["cpu_flash", "reference"])
@pytest.mark.parametrize("seed", range(4))
def test_spans_match_a_dense_mask(kernel, seed):
    rng = random.Random(seed)
    length, b = 160, 2
    spans = tuple(_random_spans(rng, length) for _ in range(b))
    window = [None, 7, 40, 100][seed]
    doc = None
    if seed % 2:  # documents whose boundaries may cut a span (each part stays inside one)
        doc = torch.tensor([[0] * 50 + [1] * 60 + [2] * 50, [0] * 90 + [1] * 70])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, 4, 16, generator=gen)
    k, v = (torch.randn(b, length, 2, 16, generator=gen) for _ in range(2))
    dout = torch.randn(b, length, 4, 16, generator=gen)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*ref_in, span_mask(length, spans, window, doc))
    ref.backward(dout.double())
    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*got_in, causal=True, kernel=kernel, document_ids=doc,
                          variant=variant_of(window, None, None, spans))
    out.backward(dout)
    for name, x, r in [("out", out, ref)] + [
            (n, t.grad, rt.grad) for n, t, rt in zip("qkv", got_in, ref_in)]:
        err = ((x.double() - r.detach()).abs().max() / r.detach().abs().max()).item()
        assert err <= TOL, (name, err)


def test_spans_change_the_result():
    """Without the spans the same case is far off: the test above sees them."""
    length = 64
    spans = (((3, 40),),)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, length, 2, 8, generator=gen) for _ in range(3))
    ref = dense_attention(q.double(), k.double(), v.double(), span_mask(length, spans))
    out = local_attention(q, k, v, causal=True, kernel="cpu_flash")
    assert not ((out.double() - ref).abs().max() <= 1e-2)


def test_later_blocks_get_calls_only_where_a_span_crosses():
    """Four contiguous shards of 8 rows; one span (5, 19) crosses shards 0, 1 and 2: shard 0's
    queries see keys of shards 1 and 2 (its later part), shard 1's those of shard 2; no other
    later block has a call, and shard 3 sees nothing later."""
    segments = tuple(((0, 8, 8 * r),) for r in range(4))
    g = Geometry(segments, True, None, None, (((5, 19),),))
    docs = ShardDocuments.plain((8,) * 4, g)
    later = {(q, kv) for q in range(4) for kv in range(q + 1, 4)
             if docs.calls(q, slice(None), kv, slice(None), False)}
    assert later == {(0, 1), (0, 2), (1, 2)}
    # the upper triangle of the span inside shard 1: window (0, -1) on rows 8..17 vs 9..18
    (call,) = [c for c in docs.calls(1, slice(None), 1, slice(None), True) if c.window]
    assert (call.q, call.kv, call.window) == (slice(0, 7), slice(1, 8), (0, -1))
    assert not schedule_causal(True, g) and schedule_causal(True, Geometry(segments, True, 4))


def test_span_arguments_are_checked():
    with pytest.raises(ValueError, match="first < stop"):
        Variant(spans=(((5, 5),),))
    with pytest.raises(ValueError, match="chunked"):
        Variant(chunk=4, spans=(((0, 2),),))
    with pytest.raises(ValueError, match="past the sequence"):
        Variant(spans=(((0, 20),),)).geometry((((0, 8, 0),),), True, 8)
    assert Variant(spans=(((0, 4),),)).geometry((((0, 8, 0),),), False, 8) is None


def test_gemma4_spans_on_sliding_layers_only():
    """Gemma 4 with use_bidirectional_attention='vision' makes its image (and video) spans
    bidirectional on its sliding layers only, marked by mm_token_type_ids: described so, and
    each attention layer applies the spans as its type says (hf.layer_image_spans); without
    it, its images are causal; 'all' (bidirectional everywhere) is refused."""
    import transformers as tf

    from easy_context.integrations.hf import layer_image_spans
    from easy_context.integrations.vision import describe

    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=97,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8, global_head_dim=8)
    spans = (((2, 6),),)
    for bidirectional in ("vision", None, "all"):
        config = tf.Gemma4Config(text_config={**text, "use_bidirectional_attention": bidirectional},
                                 vision_config=vision, audio_config=None)
        model = tf.Gemma4ForConditionalGeneration(config)
        if bidirectional == "all":
            with pytest.raises(ValueError, match="bidirectionally everywhere"):
                describe(model)
            continue
        family = describe(model)
        assert family.image_spans == (bidirectional == "vision") and family.patch_positions
        if bidirectional:
            assert family.spans_from == "mm_token_type_ids"
            layers = model.model.language_model.layers
            assert layer_image_spans(layers[0].self_attn, spans) == spans   # sliding
            assert layer_image_spans(layers[1].self_attn, spans) is None    # full: causal


def test_gemma3_spans_on_every_layer():
    """Gemma 3 applies its image spans on every layer, sliding and full."""
    import transformers as tf

    from easy_context.integrations.hf import layer_image_spans

    config = tf.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8,
                                 layer_types=["sliding_attention", "full_attention"])
    layers = tf.Gemma3TextModel(config).layers
    spans = (((2, 6),),)
    assert all(layer_image_spans(layer.self_attn, spans) == spans for layer in layers)


def test_spans_per_batch_row_are_checked_up_front():
    q = torch.randn(2, 16, 2, 8)
    with pytest.raises(ValueError, match="one tuple of spans per batch row"):
        import easy_context as ec
        ec.sequence_parallel_attention(q, q, q, "local", image_spans=(((0, 4),),))
