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


class VocabScale:
    """A head whose logits are its linear projection times a factor per vocabulary entry,
    ``(h @ W.T + b) * c`` with c (V,) computed from its other parameters (Dory's learned
    ``logit_scale``). The chunked loss runs the projection ``W * c[:, None]`` (and ``b * c``):
    the same logits up to rounding, and autograd hands the gradient of W on to c."""

    def __init__(self, head: nn.Linear):
        self.head = head

    def factor(self) -> Tensor:
        """c (V,), with autograd to the head's parameters: the head's own forward on one
        token of 1.0 through an all-ones (V, 1) projection, no bias, gives c times 1."""
        head, params = self.head, self.head._parameters
        saved = {k: params[k] for k in ("weight", "bias") if k in params}
        w = head.weight
        params["weight"] = torch.ones(head.out_features, 1, dtype=w.dtype, device=w.device)
        if "bias" in params:
            params["bias"] = None
        try:
            c = head.forward(torch.ones(1, 1, dtype=w.dtype, device=w.device))  # (1, V)
        finally:
            params.update(saved)
        return c.reshape(-1)

    def projection(self) -> tuple[Tensor, Tensor | None]:
        """(W * c[:, None], b * c | None): the head as one linear layer, this step's weights."""
        head = self.head
        c = self.factor()
        weight = head.weight * c.unsqueeze(1).to(head.weight.dtype)  # (V, H)
        bias = None if head.bias is None else head.bias * c.to(head.bias.dtype)
        return weight, bias


def vocab_scaled_head(model: nn.Module) -> tuple[nn.Linear, VocabScale] | tuple[None, str]:
    """(the output head, its per-vocabulary factor) for a model whose logits are a linear
    layer's output times a factor per vocabulary entry that the head computes itself (a
    ``nn.Linear`` subclass with a forward of its own and parameters beside ``weight`` and
    ``bias``, Dory's ``DoryLMHead``); or (None, why not). Checked against the model's own
    forward on random hidden states (the decoder stubbed out), where the weights are whole
    and local: a factor that depends on the hidden states, or anything but a product, fails."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or type(head).forward is nn.Linear.forward:
        return None, "its head is not a linear layer with a forward of its own"
    if not {n for n, _ in head.named_parameters()} - {"weight", "bias"}:
        return None, "its head has no parameters beside the projection's"
    decoder = decoder_of(model)
    if any(child is not head and not any(m is decoder for m in child.modules())
           and any(True for _ in child.parameters()) for child in model.children()):
        return None, "it has parts with weights beside the decoder and the head"
    scale = VocabScale(head)
    reason = _head_probe(model, decoder, head, lambda h: nn.functional.linear(
        h, *scale.projection()), [p for _, p in head.named_parameters()],
        "its projection times a factor per vocabulary entry")
    return (None, reason) if reason else (head, scale)


def _head_probe(model: nn.Module, decoder: nn.Module, head: nn.Linear,
                transform, params: list | None = None,
                what: str = "the projection of its other parts' per-token transform"
                ) -> str | None:
    """Whether ``transform(h)`` (a HeadTransform, run before the projection; or a callable
    giving the logits) gives the model's own logits for random hidden states h."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    logits_of = (transform if not isinstance(transform, HeadTransform) else
                 lambda h: nn.functional.linear(transform(h), head.weight, head.bias))
    params = [head.weight, *transform.parameters()] if params is None else params
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
            got = logits_of(h).float()
    except Exception as e:  # noqa: BLE001  (a head the stub cannot drive: not this shape)
        return f"its head could not be run on its own ({type(e).__name__})"
    finally:
        model.train(training)
        if had is None:
            del decoder.forward
        else:
            decoder.forward = had
    if got.shape != want.shape:
        return f"its logits are not {what} (shapes differ)"
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
    tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 5e-2
    return None if err <= tol else (
        f"its logits are not {what} ({err:.1e} apart on random hidden states)")
