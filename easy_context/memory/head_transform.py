"""A BERT-style output head taken apart for max-length mode's chunked loss: the logits are
``projection(transform(h))`` where the transform (dense, activation, LayerNorm: the model's
parts beside the decoder) has parameters of its own (BERT, RoBERTa, ELECTRA, ModernBERT). The
loss runs the transform and the projection chunk by chunk instead of on the whole sequence.
The decomposition is checked against the model's own forward on random hidden states."""

from __future__ import annotations

import torch
from torch import nn

from ..utils.decoder import decoder_of, text_config

Tensor = torch.Tensor


class HeadTransform(nn.Module):
    """What a BERT-style head does to each token's hidden state before its output projection
    (dense, activation, LayerNorm): the model's parts beside the decoder, run in the order
    they were registered, with the projection passed over (identity) inside them. (B, S, H)
    or (T, H) -> (..., H'); its parameters are the parts' but the projection's."""

    def __init__(self, parts: list[nn.Module], head: nn.Linear):
        super().__init__()
        self.parts, self.head = parts, head  # not registered: the model's own modules
        skip = {id(q) for q in head.parameters()}
        self._params = list({id(q): q for m in parts for q in m.parameters()
                             if id(q) not in skip}.values())

    def parameters(self, recurse: bool = True):
        return iter(self._params)

    def forward(self, h: Tensor) -> Tensor:
        had = vars(self.head).get("forward")
        self.head.forward = lambda x: x  # the projection is the chunked loss's
        try:
            for part in self.parts:
                h = part(h)
        finally:
            if had is None:
                del self.head.forward
            else:
                self.head.forward = had
        return h


HEAD_PROBE_TOKENS = 4


def head_transform(model: nn.Module) -> tuple[nn.Linear, HeadTransform] | tuple[None, str]:
    """(the output projection, the per-token transform before it) for a model whose logits
    are ``projection(transform(decoder's last hidden state))`` with a transform that has
    parameters (BERT, RoBERTa, ELECTRA, ModernBERT heads); or (None, why not). The
    decomposition is checked against the model's own forward on random hidden states (the
    decoder stubbed out, eval mode, no grad), where the weights are whole and local."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or {n for n, _ in head.named_parameters()} - {
            "weight", "bias"}:
        return None, "its output projection is not a linear layer"
    decoder = decoder_of(model)
    parts = [child for child in model.children()
             if not any(m is decoder for m in child.modules())
             and (child is head or any(True for _ in child.parameters()))]
    if not any(any(m is head for m in part.modules()) for part in parts):
        return None, "its output projection is not among its parts"
    if parts == [head]:
        # nothing with weights between the decoder and the projection: no transform to take
        # apart (a plain head, or one whose logit soft-cap/scale the chunked loss applies)
        return None, "its head is the projection alone"
    transform = HeadTransform(parts, head)
    reason = _head_probe(model, decoder, head, transform)
    return (None, reason) if reason else (head, transform)


def _head_probe(model: nn.Module, decoder: nn.Module, head: nn.Linear,
                transform: HeadTransform) -> str | None:
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    params = [head.weight, *transform.parameters()]
    if any(q.is_meta or hasattr(q, "ds_id") or type(q.data) is not torch.Tensor
           or not q.is_floating_point() for q in params):
        return None  # not whole here: the structure alone
    width = text_config(model.config).hidden_size
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, HEAD_PROBE_TOKENS, width, generator=gen).to(head.weight)
    ids = torch.zeros(1, HEAD_PROBE_TOKENS, dtype=torch.long, device=h.device)
    had = vars(decoder).get("forward")
    decoder.forward = lambda *a, **k: BaseModelOutputWithPastAndCrossAttentions(
        last_hidden_state=h)
    training = model.training
    try:
        model.train(False)
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = nn.functional.linear(transform(h), head.weight, head.bias).float()
    except Exception as e:  # noqa: BLE001  (a head the stub cannot drive: not this shape)
        return f"its head could not be run on its own ({type(e).__name__})"
    finally:
        model.train(training)
        if had is None:
            del decoder.forward
        else:
            decoder.forward = had
    if got.shape != want.shape:
        return "its logits are not the projection of a per-token transform"
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
    tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 5e-2
    return None if err <= tol else (
        f"its logits are not the projection of its other parts' per-token transform "
        f"({err:.1e} apart on random hidden states)")
