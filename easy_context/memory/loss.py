"""Causal-LM cross-entropy without the (tokens x vocab) logits, and its exact global mean.

For T tokens with hidden states h (T, H), an lm_head W (V, H) (and bias b) and targets y:

    # naive: logits = h @ W.T + b                       (T, V): 4 GiB at 32K x 32K in fp32
    #        loss_t = -log(softmax(logits_t)[y_t])
    loss_t = logsumexp(logits_t) - logits_t[y_t]        # stable form, fp32

computed ``chunk_size`` rows at a time, so only a (chunk, V) block of logits ever exists.
Backward recomputes each block instead of keeping it (one extra matmul buys ~T*V*4 bytes):

    d loss_t / d logits_t = softmax(logits_t) - onehot(y_t) = exp(logits_t - lse_t) - onehot(y_t)

Matmuls run in one dtype, chosen once in forward and reused in backward: the inputs' dtype,
or autocast's (bf16) when forward runs under ``torch.autocast``, as the model's lm_head would
compute. Backward runs outside autocast, so letting autocast decide each matmul would give
bf16 logits (and lse) in forward but fp32 logits in backward: softmax = exp(logits - lse)
then mixes two precisions, and with logits of magnitude ~10 the gradient is off by several
percent (tests/unit/test_loss.py measures it). Softmax, lse and the token losses are fp32,
and the sums across chunks (loss, grad W, grad b) accumulate in fp32.

The mean is over every valid target (!= ignore_index) of the global batch: each rank's
summed loss and count are all-reduced, then divided. The original EasyContext averaged the
per-rank means instead, which weights tokens wrongly whenever ranks hold different numbers
of valid targets (see ``global_token_mean``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup if dist.is_available() else object


# Rows per chunk. On a CPU, about 64 MiB of float32 logits: the matmuls are compute-bound at
# any row count there, and the block stays small next to a step's memory. On a GPU each
# chunk's GEMMs re-read the whole (V, H) head, so a chunk of C rows does about C H / (C + H)
# FLOP per byte: at 130 rows (64 MiB at a 128K vocabulary) that is ~126, below an
# H100/H200's balance point (~200-300), and a 128K-token step ran about 1,000 chunks, each
# also rewriting the fp32 head gradient (2 GB at Llama-3-8B's head). 2,048 rows give ~1,365
# at H = 4096 (compute-bound; 64 chunks per 128K tokens), capped at 1 GiB of float32 logits
# for the largest vocabularies (1,024 rows at 256K).
LOSS_CHUNK_BYTES = 64 * 2**20
LOSS_CHUNK_BYTES_GPU = 2**30
GPU_CHUNK_ROWS = 2048
MIN_CHUNK_ROWS = 128


def default_chunk_size(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk of the loss on ``device`` (a torch device, or the planner's "gpu" /
    "cpu"): on a CPU about LOSS_CHUNK_BYTES (64 MiB) of float32 logits; on an accelerator
    GPU_CHUNK_ROWS (2,048), at most LOSS_CHUNK_BYTES_GPU (1 GiB) of them; at least 128."""
    kind = device if isinstance(device, str) else device.type
    if kind.split(":")[0] == "cpu":
        rows = LOSS_CHUNK_BYTES // (4 * vocab_size)
    else:
        rows = min(GPU_CHUNK_ROWS, LOSS_CHUNK_BYTES_GPU // (4 * vocab_size))
    return max(MIN_CHUNK_ROWS, rows)


# (device type, input dtype, accumulator dtype) -> whether torch.addmm(acc, a, b,
# out_dtype=acc.dtype, out=acc) runs and is right there (see add_matmul_).
_OUT_DTYPE_ADDMM: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}


def _out_dtype_addmm_works(acc: Tensor, a: Tensor) -> bool:
    """Whether this device's addmm takes bf16/fp16 inputs into a float32 accumulator in place
    (``out_dtype``: CUDA kernels of torch >= 2.8; the CPU has none). The op's checks changed
    across releases (some ask ``self`` to have the inputs' dtype), so it is tried once on
    small tensors against a float64 product, and any error or mismatch means no."""
    key = (acc.device.type, a.dtype, acc.dtype)
    if key not in _OUT_DTYPE_ADDMM:
        ok = False
        try:
            g = torch.Generator().manual_seed(0)
            x, y = (torch.randn(s, generator=g) for s in ((24, 40), (40, 16)))
            base = torch.randn(24, 16, generator=g)
            want = base.double() + x.to(a.dtype).double() @ y.to(a.dtype).double()
            out = base.to(device=acc.device, dtype=acc.dtype)
            xd, yd = (t.to(device=acc.device, dtype=a.dtype) for t in (x, y))
            got = torch.addmm(out, xd, yd, out_dtype=acc.dtype, out=out)
            ok = (got.data_ptr() == out.data_ptr()
                  and torch.allclose(out.double().cpu(), want, rtol=1e-5, atol=1e-4))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _OUT_DTYPE_ADDMM[key] = ok
    return _OUT_DTYPE_ADDMM[key]


def add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b``, accumulated inside the GEMM (beta = 1) where the dtypes allow it:
    no (M, N) product is formed, written and read back. ``acc`` is the float32 (or float64)
    accumulator of a head gradient; ``a`` and ``b`` are in the matmul dtype. Same dtype:
    ``addmm_``. bf16/fp16 inputs into float32: the GEMM's own float32 output where the device
    has it (_out_dtype_addmm_works), else the product in the inputs' dtype, then added (what
    the GEMM would round to anyway: its output dtype is the inputs')."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if _out_dtype_addmm_works(acc, a):  # once per device type and dtypes; no on a CPU
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(a @ b)


def count_valid_targets(targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Number of targets that count towards the loss, as an int64 scalar tensor."""
    return (targets != ignore_index).sum()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; float64 stays float64 (for exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The inputs' dtype, or autocast's when it is on for their device (float64 is never
    autocast, as torch's own autocast leaves it alone)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return hidden.dtype


@dataclass(frozen=True)
class LogitTransform:
    """What some families do to the head's output x before the softmax:
    ``softcap * tanh(scale * x / softcap)`` (Gemma 2: ``final_logit_softcapping``), or
    ``scale * x`` (Cohere's ``logit_scale``; Granite divides by ``logits_scaling``)."""

    scale: float = 1.0
    softcap: float | None = None

    def apply_(self, x: Tensor) -> Tensor:
        """The logits from x, in place."""
        if self.scale != 1.0:
            x.mul_(self.scale)
        if self.softcap is not None:
            x.div_(self.softcap).tanh_().mul_(self.softcap)
        return x

    def slope(self, z: Tensor) -> Tensor | float:
        """dz/dx at the logits z: scale (1 - tanh^2) = scale (1 - (z / softcap)^2)."""
        if self.softcap is None:
            return self.scale
        return (z / self.softcap).square_().neg_().add_(1.0).mul_(self.scale)


def transform_grad_(p: Tensor, slope: Tensor | float) -> Tensor:
    """d loss / d x from d loss / d z (``p``, in place) and the transform's slope."""
    return p if isinstance(slope, float) and slope == 1.0 else p.mul_(slope)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(C, H) x (V, H) -> (C, V) logits for one chunk, in the accumulation dtype. The caller
    has cast h, weight and bias to the matmul dtype and turned autocast off."""
    logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
    return logits.to(_acc_dtype(logits.dtype))


# Rows of one chunk that the entropy pass takes at a time on a CPU: about 1 MB of fp32 logits,
# so that each block's max, exp and products run in cache (a third of the cost of whole-chunk
# passes at a 32K vocabulary, measured on 2 EPYC cores). On an accelerator the whole chunk is
# one block: per-block kernel launches would cost more than the memory traffic they save.
_STATS_BLOCK_ELEMENTS = 2**18


def lse_(logits: Tensor, y: Tensor, valid: Tensor, stats: Tensor | None = None) -> Tensor:
    """Row logsumexp of one chunk's (C, V) logits, in place: torch.logsumexp would allocate a
    second (C, V) buffer; the caller reads nothing from this one afterwards.

    ``stats`` (3,) float64, when given, gets the chunk's (entropy sum, top-1 hits, valid
    targets) added over its valid rows: what TRL logs as ``entropy`` and
    ``mean_token_accuracy``, here without the logits of the whole sequence. With z = logits -
    max, e = exp(z), s = sum(e), the entropy is log(s) - sum(e z) / s (e z summed pairwise, as
    accurate as xlogy(e, e), without its logarithms), in blocks of rows with one block-sized
    temporary; top-1 is torch.max's index, the first maximum, as TRL's argmax."""
    if stats is None:
        m = logits.amax(dim=1)
        s = logits.sub_(m.unsqueeze(1)).exp_().sum(dim=1)
        return s.log_().add_(m)
    C, V = logits.shape
    rows = C if logits.device.type != "cpu" else max(1, _STATS_BLOCK_ELEMENTS // max(V, 1))
    m = torch.empty(C, dtype=logits.dtype, device=logits.device)
    top1 = torch.empty(C, dtype=torch.long, device=logits.device)
    s, ez = torch.empty_like(m), torch.empty_like(m)
    with torch.no_grad():
        for i in range(0, C, rows):
            j = min(i + rows, C)
            z = logits[i:j]
            torch.max(z, dim=1, out=(m[i:j], top1[i:j]))
            z.sub_(m[i:j].unsqueeze(1))
            e = z.exp()
            s[i:j] = e.sum(dim=1)
            ez[i:j] = e.mul_(z).sum(dim=1)
        entropy = s.log() - ez / s
        stats += torch.stack([(entropy * valid).sum().double(),
                              ((top1 == y) & valid).sum().double(), valid.sum().double()])
    return s.log_().add_(m)


def chunk_grad_(p: Tensor, lse: Tensor, y: Tensor, valid: Tensor, g: Tensor,
                transform: LogitTransform | None) -> Tensor:
    """d (g x summed loss) / d x for one chunk, in place in ``p``, the chunk's recomputed
    (C, V) float32 head outputs x: softmax(z) - onehot(y) on the valid rows (zero rows for
    ignored targets), times the transform's slope dz/dx (z: the logits, ``transform`` of x)."""
    slope = 1.0
    if transform is not None:
        slope = transform.slope(transform.apply_(p))
    p.sub_(lse.unsqueeze(1)).exp_()
    p[torch.arange(p.shape[0], device=p.device), torch.where(valid, y, 0)] -= 1.0
    p.mul_((valid.to(p.dtype) * g).unsqueeze(1))
    return transform_grad_(p, slope)


def _forward_chunk(h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, ignore_index: int,
                   lse_out: Tensor, transform: LogitTransform | None = None,
                   stats: Tensor | None = None) -> Tensor:
    """One chunk's summed token loss; writes its rows' lse into ``lse_out`` (C,)."""
    valid = y != ignore_index
    logits = _chunk_logits(h, weight, bias)  # (C, V) fp32
    if transform is not None:
        transform.apply_(logits)
    # Ignored rows gather column 0 (any index is fine): they are masked out below.
    tgt = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
    lse_out.copy_(lse_(logits, y, valid, stats))
    return ((lse_out - tgt) * valid).sum()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(hidden (T, H), weight (V, H), targets (T,), bias (V,) | None, chunk_size, ignore_index,
    transform | None, stats | None) -> (sum of token losses: fp32 scalar (float64 for float64
    inputs), count: int64 scalar). ``stats``: see :func:`lse_`.

    Saves hidden, weight, targets and the per-token lse (T,) fp32; never a (T, V) tensor.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                chunk_size: int, ignore_index: int, transform: LogitTransform | None = None,
                stats: Tensor | None = None) -> tuple[Tensor, Tensor]:
        dtype = _matmul_dtype(hidden)
        T, acc = hidden.shape[0], _acc_dtype(dtype)
        lse = torch.zeros(T, dtype=acc, device=hidden.device)  # (T,)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        # One cast of the head (as autocast would cache it), not one per chunk.
        w, b = weight.to(dtype), _cast(bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, T, chunk_size):
                e = min(s + chunk_size, T)
                total += _forward_chunk(hidden[s:e].to(dtype), w, b, targets[s:e], ignore_index,
                                        lse[s:e], transform, stats)
        count = count_valid_targets(targets, ignore_index)
        ctx.save_for_backward(hidden, weight, targets, bias, lse)
        ctx.chunk_size, ctx.ignore_index, ctx.dtype = chunk_size, ignore_index, dtype
        ctx.transform = transform
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_count: Tensor | None):
        hidden, weight, targets, bias, lse = ctx.saved_tensors
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        T, acc, dtype = hidden.shape[0], lse.dtype, ctx.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        g = grad_total.to(acc)
        # The forward's matmul dtype, whatever autocast says now: the recomputed logits must
        # be the ones whose lse forward kept.
        w, b = weight.to(dtype), _cast(bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, T, ctx.chunk_size):
                e = min(s + ctx.chunk_size, T)
                h, y = hidden[s:e].to(dtype), targets[s:e]
                # softmax - onehot, built in place in the recomputed logits buffer.
                p = chunk_grad_(_chunk_logits(h, w, b), lse[s:e], y, y != ctx.ignore_index,
                                g, ctx.transform)  # (C, V) fp32
                if need_b:
                    grad_b += p.sum(0)
                pc = p.to(dtype)
                del p
                if need_h:
                    grad_h[s:e] = pc @ w
                if need_w:
                    add_matmul_(grad_w, pc.T, h)
                del pc
        return (grad_h,
                None if grad_w is None else grad_w.to(weight.dtype),
                None,
                None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None)


def _world(group: ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def global_token_mean(local_sum: Tensor, local_count: Tensor | int,
                      group: ProcessGroup | None = None,
                      num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """Exact token mean over ``group`` from this rank's summed loss and valid-target count.

    VALUE: ``global_sum / global_count`` with both all-reduced (SUM) over ``group`` in one
    collective; ``group=None`` means the default (world) group when torch.distributed is
    initialized, and a single process otherwise. With ``num_items_in_batch`` (the count of
    valid targets across data-parallel ranks and gradient-accumulation micro-batches, as
    transformers passes it) that number is the denominator instead, so summing the values
    over micro-batches and data-parallel replicas gives the mean over the whole step.

    GRADIENT: that of ``local_sum / denominator`` only. The other ranks' losses enter as a
    detached constant, so (a) each rank's gradient w.r.t. its own activations is exactly its
    shard of the single-process gradient, and (b) SUMMING parameter gradients over the ranks
    gives the gradient of the global mean. A trainer whose gradient reduction AVERAGES over
    W ranks (DDP, FSDP) must multiply the loss (or the gradients) by W.

    No valid target anywhere (denominator 0): the loss is 0 with zero gradient, not NaN --
    an all-padding batch is legal in packed training and must not poison the weights.
    """
    if (isinstance(num_items_in_batch, Tensor) and num_items_in_batch.is_floating_point()
            and torch.finfo(num_items_in_batch.dtype).bits < 32):
        # bf16 holds integers exactly only up to 256 (100001 becomes 99840): the loss and
        # every gradient would be off by up to 0.4%.
        raise ValueError(f"num_items_in_batch is {num_items_in_batch.dtype}, which rounds token "
                         "counts; a mixed-precision wrapper probably cast it with the inputs. "
                         "Pass an int, or an int64/float64 tensor kept out of input casting")
    # float64 keeps the count exact and the cross-rank sum free of fp32 rounding.
    stats = torch.stack([local_sum.detach().double(),
                         torch.as_tensor(local_count, device=local_sum.device).double()])
    if _world(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    global_sum, global_count = stats[0], stats[1]
    denom = global_count if num_items_in_batch is None else torch.as_tensor(
        num_items_in_batch, device=local_sum.device).double()
    denom = denom.clamp(min=1.0)
    # local/denom - (local/denom).detach() is exactly 0 in value but carries the gradient;
    # the value is the float64 global mean rounded once.
    local = local_sum / denom.to(local_sum.dtype)
    return local - local.detach() + (global_sum / denom).to(local_sum.dtype)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                          bias: Tensor | None = None, *, chunk_size: int = 4096,
                          ignore_index: int = -100, group: ProcessGroup | None = None,
                          num_items_in_batch: Tensor | int | None = None,
                          transform: LogitTransform | None = None,
                          stats: Tensor | None = None) -> Tensor:
    """Global-mean cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising logits
    (``transform``: the family's scaling or soft-capping of those logits, LogitTransform;
    ``stats``: this rank's entropy and accuracy sums are added to it, see :func:`lse_`).

    hidden: (B, S, H) or (T, H); targets: (B, S) or (T,), already shifted (targets[t] is the
    token after hidden[t]); weight: (V, H), the lm_head; bias: (V,) or None. Returns an fp32
    scalar (float64 for float64 inputs) with the value/gradient contract of :func:`global_token_mean`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h = hidden.reshape(-1, hidden.shape[-1])  # (T, H)
    y = targets.reshape(-1)  # (T,)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states but {y.shape[0]} targets")
    local_sum, local_count = ChunkedLinearCrossEntropy.apply(h, weight, y, bias, chunk_size,
                                                             ignore_index, transform, stats)
    return global_token_mean(local_sum, local_count, group, num_items_in_batch)


def logits_cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                         group: ProcessGroup | None = None,
                         num_items_in_batch: Tensor | int | None = None,
                         stats: Tensor | None = None) -> Tensor:
    """The plain path through full logits (B, S, V) or (T, V), upcast to fp32 as transformers
    does, with the same global-mean contract. Fine for small vocabularies; the reference."""
    flat = logits.reshape(-1, logits.shape[-1])  # (T, V)
    flat = flat.to(_acc_dtype(flat.dtype))
    y = targets.reshape(-1)
    if stats is not None:
        lse_(flat.detach().clone(), y, y != ignore_index, stats)
    local_sum = F.cross_entropy(flat, y, ignore_index=ignore_index, reduction="sum")
    return global_token_mean(local_sum, count_valid_targets(y, ignore_index), group,
                             num_items_in_batch)
