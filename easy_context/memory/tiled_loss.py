"""The final norm, the output head and the cross-entropy, chunk by chunk.

easy_context.memory.loss never builds the (tokens x vocab) logits, but the final norm before
it still runs on the whole sequence: in bf16 a float32 copy of every hidden state, the
normalized states and the norm's output, all kept for backward (about four times the
hidden states). In max-length mode (easy_context.memory.maxlen) the decoder skips that norm
and this loss applies it to each chunk of rows, keeping only the un-normed hidden states
(which exist anyway: the last layer's output) and the per-token log-sum-exp; backward
recomputes each chunk's norm and logits. With ``overwrite_hidden`` (max-length mode, whose
hidden states nothing else uses) backward writes each chunk's gradient over that chunk's rows
of the hidden states once it has read them, so the gradient takes no memory of its own:

    hn = norm(h_c);  logits = hn @ W.T + b;  loss_t = lse_t - logits_t[y_t]
    d hn = (softmax - onehot) @ W;  d W += (softmax - onehot).T @ hn;  d h_c = norm's VJP(d hn)

Matmuls in the inputs' dtype, softmax/lse/loss and the sums across chunks in float32, as in
easy_context.memory.loss; the mean is the exact global token mean (global_token_mean).
"""

from __future__ import annotations

import torch
from torch import nn

from .loss import (LogitTransform, add_matmul_, chunk_grad_, count_valid_targets,
                   global_token_mean, lse_)

Tensor = torch.Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _logits(hn: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    logits = hn @ weight.T if bias is None else torch.addmm(bias, hn, weight.T)
    return logits.to(_acc(logits.dtype))


def _forward_of(norm: nn.Module):
    """The norm's own forward, without module hooks: ZeRO-3 would release the weight after
    each call (the engine keeps it gathered for the whole loss instead); max-length mode
    patched ``forward`` to skip the norm inside the decoder, the original is kept aside."""
    return getattr(norm, "_ec_original_forward", norm.forward)


class NormedChunkedCrossEntropy(torch.autograd.Function):
    """(hidden (T, H) before the final norm, norm, weight (V, H), targets (T,), bias | None,
    chunk_size, ignore_index, overwrite_hidden, transform | None, stats | None (see
    easy_context.memory.loss.lse_), *norm parameters) -> (sum of token losses, valid count)."""

    @staticmethod
    def forward(ctx, hidden, norm: nn.Module, weight, targets, bias, chunk_size: int,
                ignore_index: int, overwrite_hidden: bool, transform: LogitTransform | None,
                stats: Tensor | None, *norm_params):
        T, acc = hidden.shape[0], _acc(hidden.dtype)
        norm_forward = _forward_of(norm)
        lse = torch.empty(T, dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            y = targets[s:e]
            valid = y != ignore_index
            logits = _logits(norm_forward(hidden[s:e]), weight, bias)  # (C, V)
            if transform is not None:
                transform.apply_(logits)
            tgt = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
            lse[s:e] = lse_(logits, y, valid, stats)  # in place, as easy_context.memory.loss
            total += ((lse[s:e] - tgt) * valid).sum()
            del logits
        count = count_valid_targets(targets, ignore_index)
        ctx.save_for_backward(hidden, weight, targets, bias, lse)
        ctx.norm, ctx.chunk_size, ctx.ignore_index = norm, chunk_size, ignore_index
        ctx.overwrite_hidden, ctx.transform = overwrite_hidden, transform
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, grad_total, _grad_count):
        hidden, weight, targets, bias, lse = ctx.saved_tensors
        norm = ctx.norm
        params = [p for p in norm.parameters()]
        need_h, _, need_w, _, need_b = ctx.needs_input_grad[:5]
        T, acc = hidden.shape[0], lse.dtype
        # Overwriting the saved hidden states bumps their version: any other autograd node
        # that saved them would raise at its backward instead of reading gradients.
        overwrite = need_h and ctx.overwrite_hidden and hidden.is_contiguous()
        grad_h = (hidden if overwrite else torch.empty_like(hidden)) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        grad_n = [torch.zeros(p.shape, dtype=_acc(p.dtype), device=p.device) if p.requires_grad
                  else None for p in params]
        g = grad_total.to(acc)
        for s in range(0, T, ctx.chunk_size):
            e = min(s + ctx.chunk_size, T)
            y = targets[s:e]
            valid = y != ctx.ignore_index
            h = hidden[s:e].detach().requires_grad_(need_h)
            with torch.enable_grad():
                hn = _forward_of(norm)(h)
            # softmax - onehot, in place in the recomputed logits
            p = chunk_grad_(_logits(hn.detach(), weight, bias), lse[s:e], y, valid, g,
                            ctx.transform)
            if need_b:
                grad_b += p.sum(0)
            pc = p.to(hn.dtype)
            del p
            if need_w:
                add_matmul_(grad_w, pc.T, hn.detach())
            live = [t for t in [h, *params] if t.requires_grad]
            if live:
                got = iter(torch.autograd.grad(hn, live, pc @ weight, allow_unused=True))
                if need_h:
                    grad_h[s:e] = next(got)
                for i, prm in enumerate(params):
                    if prm.requires_grad:
                        gp = next(got)
                        if gp is not None:
                            grad_n[i] += gp
            del pc, hn, h
        return (grad_h, None, None if grad_w is None else grad_w.to(weight.dtype), None,
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None,
                *[None if gn is None else gn.to(prm.dtype) for gn, prm in zip(grad_n, params)])


def normed_chunked_cross_entropy(hidden: Tensor, norm: nn.Module, weight: Tensor,
                                 targets: Tensor, bias: Tensor | None = None, *,
                                 chunk_size: int, ignore_index: int = -100, group=None,
                                 num_items_in_batch: Tensor | int | None = None,
                                 overwrite_hidden: bool = False,
                                 transform: LogitTransform | None = None,
                                 stats: Tensor | None = None) -> Tensor:
    """The global-mean loss of ``norm(hidden) @ weight.T (+ bias)``, chunk by chunk (see the
    module docstring); hidden (B, S, H) or (T, H), targets shifted, -100 ignored.
    ``overwrite_hidden``: backward writes the gradient into ``hidden`` (only for hidden states
    that the caller owns and nothing reads after the loss)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states but {y.shape[0]} targets")
    local_sum, local_count = NormedChunkedCrossEntropy.apply(
        h, norm, weight, y, bias, chunk_size, ignore_index, overwrite_hidden, transform, stats,
        *norm.parameters())
    return global_token_mean(local_sum, local_count, group, num_items_in_batch)
