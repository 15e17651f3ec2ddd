"""Families refused by mechanism, and the logit transforms the chunked loss copies (one
process, tiny models from benchmarks/families.py's builder)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec
from benchmarks.families import build_tiny
from easy_context.integrations.hf import check_model_supported, output_head

TOL = 1e-5
# decoders that number their positions from the input's own length (no position_ids)
BART_LIKE = ["bart", "mbart", "marian", "pegasus", "plbart", "bigbird_pegasus", "blenderbot",
             "blenderbot-small"]


@pytest.mark.parametrize("family", BART_LIKE)
def test_positions_from_input_length_refused(family):
    with pytest.raises(ValueError, match="takes no position_ids"):
        check_model_supported(build_tiny(family))


def _ids(vocab: int, length: int = 12):
    ids = torch.randint(3, vocab, (2, length + 1), generator=torch.Generator().manual_seed(0))
    return ids


@pytest.mark.parametrize("family,scaling", [("hyperclovax", 2.5), ("hyperclovax", 0.4),
                                            ("granite", 2.5)])
def test_logits_scaling_loss_equals_transformers(family, scaling):
    """HyperCLOVAX multiplies its logits by logits_scaling, Granite divides: the chunked loss
    (which never builds the logits) equals transformers' own loss for both."""
    config = AutoConfig.for_model(family, vocab_size=97, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, logits_scaling=scaling)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    ids = _ids(97)
    want = model(input_ids=ids, labels=ids).loss
    assert output_head(model)[1] is not None
    got = ec.causal_lm_loss(model, ids[:, :-1], torch.arange(12).expand(2, -1), ids[:, 1:],
                            chunked=True)
    err = abs(got.item() - want.item()) / want.item()
    assert err <= TOL, (family, scaling, got.item(), want.item())


def test_head_transform_between_decoder_and_head():
    """BERT-style heads (dense, activation, LayerNorm, then the projection): the logits are
    not the projection of the decoder's output, so the chunked loss and generate refuse,
    and the default loss takes the logits path and equals transformers' own."""
    model = build_tiny("bert")
    assert output_head(model) == (None, None)
    ids = _ids(97)
    with pytest.raises(ValueError, match="not a linear layer of the decoder"):
        ec.causal_lm_loss(model, ids[:, :-1], torch.arange(12).expand(2, -1), ids[:, 1:],
                          chunked=True)
    logits = model(input_ids=ids[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    got = ec.causal_lm_loss(model, ids[:, :-1], torch.arange(12).expand(2, -1), ids[:, 1:])
    assert abs(got.item() - want.item()) <= TOL * want.item()
    with pytest.raises(ValueError, match="not its output head applied"):
        ec.generate(model.eval(), ids[:1, :8], method="zigzag_ring_attn", max_new_tokens=2)


def _default_loss_matches_transformers(model):
    ids = _ids(97)
    want = model(input_ids=ids, labels=ids).loss
    got = ec.causal_lm_loss(model, ids[:, :-1], torch.arange(12).expand(2, -1), ids[:, 1:])
    assert abs(got.item() - want.item()) <= TOL * want.item(), (got.item(), want.item())
    with pytest.raises(ValueError, match="not a linear layer of the decoder"):
        ec.causal_lm_loss(model, ids[:, :-1], torch.arange(12).expand(2, -1), ids[:, 1:],
                          chunked=True)


def test_head_with_parameters_of_its_own_is_no_plain_head():
    """Dory's head is a Linear subclass that multiplies by a learned per-token scale: the
    chunked loss (which reads only the weight) refuses it."""
    model = build_tiny("dory")
    assert output_head(model) == (None, None)
    _default_loss_matches_transformers(model)


def test_composite_model_logit_transform_is_not_guessed():
    """Gemma 3's multimodal class applies none of its text config's final soft-capping: the
    chunked loss must not apply it either (it refuses; the logits path is the model's own)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                final_logit_softcapping=3.0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text,
                                                        vision_config=vision)).float()
    assert output_head(model) == (None, None)
    _default_loss_matches_transformers(model)
