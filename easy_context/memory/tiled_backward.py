"""The generic layer's backward in sequence tiles: its own forward, split at the attention call.

Why: the generic path's plain backward (generic_layer.GenericLayer) runs the layer's forward
again with grad over the whole local sequence, so while it runs its autograd graph holds
every whole-sequence intermediate the layer's code makes: the norms' outputs and float
copies, q and k before and after their norms, the attention's saved tensors, the residuals,
the sandwich norms. Measured with saved-tensor hooks at 4K tokens: about 17 hidden-sized
tensors per token on Gemma 3's layer, against about one for the fused layer.

In such a layer everything but the attention call is per token. So backward runs the layer's
own forward in passes, each over sequence tiles except the attention itself:

0. no grad, per tile: the forward up to its attention call, stopped there, its q, k, v
   written into whole-sequence buffers (:func:`gather`); then the attention over the whole
   sequence head chunk by chunk, its results recorded (easy_context.attention.saving) or,
   with ``keep_attention``, replayed; q, k, v are then let go (pass 1 does not read them);
1. per tile, the forward with grad, its attention call handing back the tile's rows of the
   attention output as a leaf: differentiating the tile's output from dy gives d(out) for
   those rows and the gradients along every path that does not pass through attention (what
   follows it, the residual, a parallel MLP on the same normed input as Falcon's and Phi's,
   a gate computed before attention and applied after it as in Qwen3-Next's);
2. q, k, v gathered again as in pass 0; per head chunk, the attention on the recorded
   results (no second pass of its forward communication) differentiated from d(out): dq,
   dk, dv over the whole sequence, through the sequence-parallel method's own backward;
3. per tile, the forward with grad up to the attention call, stopped there, differentiated
   from the tile's rows of (dq, dk, dv): the gradients along the paths through attention.
The gradients of passes 1 and 3 add up to the layer's (the chain rule over the two kinds of
path); the parameters' are summed over the tiles, in another order than one backward would.

Beside the layer input and its gradient, backward holds over the whole sequence the
attention output and its gradient, with one tile's graph (pass 1) or q, k, v and one head
chunk's attention backward (pass 2: each chunk's dq, dk, dv are written over its q, k, v
once its call is done, so the two are never held at once). The per-token parts before the
attention call run four times (passes 0, 1, 2 and 3), those after it once (pass 1), where
the plain backward runs the whole layer once.

The layer's forward runs in the same split (:func:`split_forward`): q, k, v in tiles, the
attention, then the layer per tile again with the attention's rows handed back; the parts
before the attention call run twice. It holds q, k, v and the attention output, not every
intermediate of the whole sequence's projections (MLA's expanded K/V beside its latent and
RoPE'd copies).

Where it holds is checked, not assumed (:func:`qualifies`): on the first forward of each
layer structure (its module types and argument names), the layer's forward runs on a few
random tokens with the real call's arguments for those tokens, its attention replaced by a
per-token stand-in, once whole with autograd and once split in two tiles as above; the output
and every gradient must agree. A layer that calls attention more than once, whose attention
reads keys of another length than its queries (MLA's gathered latent), that takes an
attention mask or a per-token argument this module does not know how to cut
(:data:`SEQUENCE_DIMS`), or whose results differ in tiles for any other reason, keeps the
plain backward (an INFO log line says why). The verdict is the same on every rank (a MIN
all-reduce: the backward's collectives must match).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Callable

import torch

from ..attention.saving import recording, replaying
from .fused_layer import _grad, tiles

Tensor = torch.Tensor
log = logging.getLogger(__name__)

# While set: a callable (q, k, v, calls) that takes the attention call a generic layer makes
# (generic_layer.chunked_attention hands it over; ``calls``: the head-chunked calls it would
# make, [(query heads, KV heads, call(q, k, v) -> (out, weights))]) and returns the
# attention output (B, S, Hq, Dv) or raises _Stop.
INTERCEPT: contextvars.ContextVar = contextvars.ContextVar("ec_split_attention", default=None)
# the layer arguments that are per token, and their sequence dimension (document_ids: ours,
# passed through to the attention function, which reads them only in pass 0's whole call)
SEQUENCE_DIMS = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1,
                 "document_ids": -1}
# While gather runs: {id(cut): (cut, whole)} for the per-token arguments cut_rows cut for the
# tile being run (the layer hands some on to its attention call: document_ids, position_ids)
_CUTS: contextvars.ContextVar = contextvars.ContextVar("ec_cut_arguments", default=None)
PROBE_TOKENS = 8
_VERDICTS: dict = {}  # layer structure -> None (qualifies) or why not
VERDICTS: dict = {}  # the same by layer class name, the latest (for logs and tests)


class _Stop(Exception):
    """Raised at the attention call to end a forward there (passes 0 and 3)."""


class Unfit(Exception):
    """The layer does not qualify (raised inside the probe, the same on every rank)."""


@contextlib.contextmanager
def _intercepting(fn: Callable):
    token = INTERCEPT.set(fn)
    try:
        yield
    finally:
        INTERCEPT.reset(token)


def cut_rows(kwargs: dict, rows: slice, length: int, keep: tuple = ()) -> dict:
    """The layer's keyword arguments for the tokens ``rows`` of ``length``: the per-token ones
    (SEQUENCE_DIMS) cut; ``keep`` (the caller's own cuts) as they are.
    Raises Unfit for another tensor with a dimension of ``length`` (a per-token argument of
    unknown layout) or an attention mask (the tiles' forwards make no attention call)."""
    cuts = _CUTS.get()

    def cut(value, dim):
        if isinstance(value, Tensor):
            part = value.narrow(dim, rows.start, rows.stop - rows.start)
            if cuts is not None:
                cuts[id(part)] = (part, value)
            return part
        if isinstance(value, tuple) and all(isinstance(t, Tensor) for t in value):
            return tuple(cut(t, dim) for t in value)
        raise Unfit(f"its per-token argument has an unknown type {type(value).__name__}")

    out = {}
    for k, v in kwargs.items():
        if k in keep or v is None:
            out[k] = v
        elif k in SEQUENCE_DIMS:
            out[k] = cut(v, SEQUENCE_DIMS[k])
        elif k == "attention_mask":
            raise Unfit("it takes an attention mask")
        elif isinstance(v, Tensor) and length > 1 and length in v.shape:
            raise Unfit(f"its argument {k!r} {tuple(v.shape)} may be per token")
        else:
            out[k] = v
    return out


def stand_in(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A per-token attention of q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) ->
    (B, T, Hq, Dv) through which every input gets a gradient (the probe's)."""
    if k.size(2) != q.size(2) or v.size(2) != q.size(2):
        raise Unfit(f"its attention reads {k.size(2)} keys for {q.size(2)} queries")
    r = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    gate = torch.sigmoid((q * k).sum(-1, keepdim=True) / q.size(-1))
    return (v * gate).transpose(1, 2)


def _add(total: list, got) -> None:
    for i, g in enumerate(got):
        if g is not None:
            total[i] = g if total[i] is None else total[i] + g


def _grads(outputs, inputs: list, wants) -> list:
    """fused_layer._grad (None for the inputs that need no grad), also when none does."""
    if not any(i is not None and i.requires_grad for i in inputs):
        return [None] * len(inputs)
    return _grad(outputs, inputs, wants)


def _tile_inputs(x: Tensor, extras: dict, rows: slice) -> tuple[Tensor, dict]:
    xt = x[:, rows].detach().requires_grad_(x.requires_grad)
    return xt, {n: e[:, rows].detach().requires_grad_(e.requires_grad) for n, e in extras.items()}


class _Sums:
    """Gradients of (x, *extras, *params), summed over tiles and passes: x's and the extras'
    over the whole sequence (each tile writes its rows), the parameters' added."""

    def __init__(self, x: Tensor, extras: dict, params: list):
        self.rows = [torch.zeros_like(x) if x.requires_grad else None,
                     *(torch.zeros_like(e) if e.requires_grad else None
                       for e in extras.values())]
        self.params: list = [None] * len(params)

    def add(self, got: list, rows: slice | None) -> None:
        n = len(self.rows)
        if rows is not None:
            for total, g in zip(self.rows, got[:n]):
                if g is not None and total is not None:
                    total[:, rows] += g
        _add(self.params, got[n:])

    def result(self) -> list:
        return [*self.rows, *self.params]


def split_grads(call: Callable, x: Tensor, extras: dict, params: list, dy: Tensor, tile: int,
                attention: Callable, differentiate: Callable,
                output: bool = False) -> tuple[list, Tensor | None]:
    """Gradients of the layer's output w.r.t. (x, *extras, *params) from ``dy`` (None for
    those not requiring grad), in the passes of the module docstring, and with ``output``
    the layer's output (B, S, H) (the probe compares it), else None.
    ``call(x, rows, **override)`` runs the layer's forward on x, the tokens ``rows`` of its
    arguments; ``attention(q, k, v, calls)`` -> the output's head chunks [(B, S, hc, Dv)]
    (pass 0; ``calls``: the layer's own head-chunked calls, generic_layer.chunk_calls);
    ``differentiate(q, k, v, douts, params)`` -> (dq, dk, dv, [gradient or None per
    parameter]) (pass 2; q, k, v are this function's own buffers: it may write the
    gradients over them)."""
    s = x.size(1)
    q, k, v, calls = gather(call, x, extras, tile)  # pass 0
    with torch.no_grad():
        outs = attention(q, k, v, calls)
    del q, k, v, calls  # pass 1 needs none of them: gathered again for pass 2
    widths = [o.size(2) for o in outs]

    sums = _Sums(x, extras, params)
    ys, douts = [], [torch.zeros_like(o) for o in outs]
    for t in tiles(s, tile):  # pass 1
        xt, et = _tile_inputs(x, extras, t)
        leaf = torch.cat([o[:, t] for o in outs], dim=2).requires_grad_(True)
        seen: list = []

        def after(q_, k_, v_, calls, leaf=leaf):
            if seen or q_.size(2) != leaf.size(1):
                raise Unfit("its attention calls do not follow the tiles")
            seen.append(True)
            return leaf

        with torch.enable_grad(), _intercepting(after):
            y = call(xt, t, **et)
        if not seen or not y.requires_grad:
            raise Unfit("its output does not depend on its attention call")
        res = _grads(y, [leaf, xt, *et.values(), *params], dy[:, t])
        if res[0] is not None:
            for dst, part in zip(douts, res[0].split(widths, dim=2)):
                dst[:, t] = part
        sums.add(res[1:], t)
        if output:
            ys.append(y.detach())
        del leaf, y, res
    del outs
    q, k, v, _ = gather(call, x, extras, tile)
    dq, dk, dv, dparams = differentiate(q, k, v, douts, params)  # pass 2
    del douts, q, k, v
    sums.add([None] * len(sums.rows) + list(dparams), None)

    for t in tiles(s, tile):  # pass 3
        xt, et = _tile_inputs(x, extras, t)
        seen: dict = {}

        def before(q_, k_, v_, calls, n=t.stop - t.start):
            if not q_.size(2) == k_.size(2) == v_.size(2) == n:
                raise Unfit("its attention calls do not follow the tiles")
            seen.update(q=q_, k=k_, v=v_)
            raise _Stop

        with torch.enable_grad(), _intercepting(before), contextlib.suppress(_Stop):
            call(xt, t, **et)
        if not seen:
            raise Unfit("its forward made no attention call in a tile")
        pairs = [(seen[n], g[:, :, t]) for n, g in zip("qkv", (dq, dk, dv))
                 if seen[n].requires_grad]
        if pairs:
            sums.add(_grads([o for o, _ in pairs], [xt, *et.values(), *params],
                            [w for _, w in pairs]), t)
    return sums.result(), torch.cat(ys, dim=1) if output else None


def gather(call: Callable, x: Tensor, extras: dict, tile: int) -> tuple:
    """Pass 0: the layer's forward without grad, tile by tile, stopped at its attention call:
    (q, k, v) of the whole sequence (B, H, S, D), written from the tiles' rows into buffers
    of their own (pass 2 writes the gradients over them), and the attention's head-chunked
    calls with the whole sequence's arguments in place of the tile's (the cut per-token
    arguments the layer handed on, as :func:`cut_rows` recorded them)."""
    s = x.size(1)
    whole: list = [None, None, None]
    calls: list = []
    cuts: dict = {}
    token = _CUTS.set(cuts)
    try:
        for t in tiles(s, tile):
            n, got = t.stop - t.start, {}
            cuts.clear()

            def capture(q, k, v, calls_, n=n, got=got):
                if got:
                    raise Unfit("it calls attention more than once")
                if not q.size(2) == k.size(2) == v.size(2) == n:
                    raise Unfit(f"its attention reads {k.size(2)} keys for {q.size(2)} "
                                f"queries of {n} tokens")
                got.update(qkv=(q, k, v), calls=calls_)
                raise _Stop

            xt, et = _tile_inputs(x, extras, t)
            with torch.no_grad(), _intercepting(capture), contextlib.suppress(_Stop):
                call(xt, t, **et)
            if not got:
                raise Unfit("its forward made no attention call this path sees")
            for i, part in enumerate(got["qkv"]):
                if whole[i] is None:
                    whole[i] = part.new_empty((*part.shape[:2], s, *part.shape[3:]))
                whole[i][:, :, t] = part
            calls = _whole_calls(got["calls"], cuts, n, s)
            del got
    finally:
        _CUTS.reset(token)
    return (*whole, calls)


def _whole_calls(calls: list, cuts: dict, n: int, s: int) -> list:
    """A tile's head-chunked calls [(query heads, KV heads, functools.partial)] re-bound to
    the whole sequence's arguments: each cut argument swapped for the tensor it was cut from.
    Raises Unfit for another tensor of two or more dims with one of the tile's length (a
    per-token argument of unknown origin: a tile's attention mask)."""
    def swap(value):
        if isinstance(value, Tensor):
            if id(value) in cuts:
                return cuts[id(value)][1]
            if n != s and value.dim() >= 2 and n in value.shape:
                raise Unfit(f"its attention takes a per-token argument {tuple(value.shape)} "
                            "this path cannot give it whole")
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    out = []
    for qs, ks, run in calls:
        if not isinstance(run, functools.partial):
            raise Unfit("its attention calls cannot be given the whole sequence's arguments")
        out.append((qs, ks, functools.partial(run.func, *swap(run.args), **swap(run.keywords))))
    return out


def split_forward(call: Callable, x: Tensor, extras: dict, tile: int) -> Tensor:
    """The layer's output without grad, run in the same split as its backward: q, k, v in
    tiles (:func:`gather`), the attention over the whole sequence, head chunk by chunk (its
    results recorded where a caller records them: attention.saving), then the layer's
    forward per tile again, its attention call handing back the tile's rows of the output.
    What the whole-sequence forward holds at once (every intermediate before attention:
    MLA's expanded K/V beside its projections, the RoPE'd copies) is then one tile's; the
    per-token parts before attention run twice."""
    s = x.size(1)
    q, k, v, calls = gather(call, x, extras, tile)
    outs = [run(q[:, qs], k[:, ks], v[:, ks])[0] for qs, ks, run in calls]
    del q, k, v, calls
    y = None
    for t in tiles(s, tile):
        rows = torch.cat([o[:, t] for o in outs], dim=2)
        seen: list = []

        def after(q_, k_, v_, calls_, rows=rows):
            if seen or q_.size(2) != rows.size(1):
                raise Unfit("its attention calls do not follow the tiles")
            seen.append(True)
            return rows

        xt, et = _tile_inputs(x, extras, t)
        with torch.no_grad(), _intercepting(after):
            yt = call(xt, t, **et)
        if not seen:
            raise Unfit("its forward made no attention call in a tile")
        if y is None:
            y = yt.new_empty((yt.size(0), s, *yt.shape[2:]))
        y[:, t] = yt
        del rows, yt
    return y


def chunked(record: list, replay: bool) -> tuple[Callable, Callable]:
    """``attention`` and ``differentiate`` of :func:`split_grads` for the layer's own
    attention, head chunk by chunk (each chunk call as generic_layer.chunk_calls makes it).
    Pass 0 records each chunk's result into ``record`` (or replays them, where the forward
    kept them: ``keep_attention``); pass 2 replays them, so backward runs the attention's
    forward communication once and its backward's once."""
    chunk_list: list = []

    def attention(q, k, v, calls):
        chunk_list[:] = calls
        with (replaying(record) if replay else recording(record)):
            return [run(q[:, qs], k[:, ks], v[:, ks])[0] for qs, ks, run in calls]

    def differentiate(q, k, v, douts, params):
        # q, k, v are this backward's own (gather's buffers): a chunk's gradients
        # overwrite its heads once no later call reads them (a KV head's after the last of
        # its query heads), so that backward never holds q, k, v and dq, dk, dv at once
        last = {(ks.start, ks.stop): i for i, (_, ks, _) in enumerate(chunk_list)}
        pending: dict = {}  # KV heads -> their (dk, dv) summed over the calls so far
        dparams: list = [None] * len(params)
        with torch.enable_grad(), replaying(record):
            for i, (qs, ks, run) in enumerate(chunk_list):
                qc, kc, vc = (t.detach().requires_grad_(True) for t in (q[:, qs], k[:, ks],
                                                                         v[:, ks]))
                res = _grads(run(qc, kc, vc)[0], [qc, kc, vc, *params], douts[i])
                del qc, kc, vc
                douts[i] = None
                got = [torch.zeros_like(t) if g is None else g
                       for t, g in zip((q[:, qs], k[:, ks], v[:, ks]), res[:3])]
                q[:, qs] = got[0]
                key = (ks.start, ks.stop)
                if key in pending:
                    got[1:] = [a + b for a, b in zip(pending.pop(key), got[1:])]
                if last[key] == i:
                    k[:, ks], v[:, ks] = got[1], got[2]
                else:
                    pending[key] = got[1:]
                _add(dparams, res[3:])
                del res, got
        return q, k, v, dparams

    return attention, differentiate


def _stand_in_pair() -> tuple[Callable, Callable]:
    def attention(q, k, v, calls):
        return [stand_in(q, k, v)]

    def differentiate(q, k, v, douts, params):
        with torch.enable_grad():
            qc, kc, vc = (t.detach().requires_grad_(True) for t in (q, k, v))
            dq, dk, dv = torch.autograd.grad(stand_in(qc, kc, vc), [qc, kc, vc], douts[0])
        return dq, dk, dv, [None] * len(params)

    return attention, differentiate


# ------------------------------------------------------------------------- the check
def structure(layer: torch.nn.Module, kwargs: dict) -> tuple:
    """What the verdict depends on: the layer's module types (LoRA adapters included), their
    settings (the number, flag and name attributes: a sliding or a K/V-sharing layer of the
    same class is checked on its own) and its arguments' names and kinds."""
    def settings(m):
        return tuple(sorted((k, v) for k, v in vars(m).items() if k != "training"
                            and isinstance(v, (bool, int, float, str, type(None)))))

    return (tuple((type(m), settings(m)) for m in layer.modules()),
            tuple(sorted((k, type(v).__name__) for k, v in kwargs.items())))


def qualifies(key: tuple, call: Callable, x: Tensor, extras: dict, params: list,
              name: str = "decoder") -> str | None:
    """None when the layer may take :func:`split_grads` (checked once per ``key``: see the
    module docstring), else why not."""
    if key in _VERDICTS:
        return _VERDICTS[key]
    why = _probe(call, x, extras, params)
    why = _agree(why, x.device)
    if why is not None:
        log.info("max-length mode: a %s layer runs its backward over the whole sequence "
                 "(not in tiles): %s", name, why)
    _VERDICTS[key] = why
    VERDICTS[name] = why
    return why


def _probe(call: Callable, x: Tensor, extras: dict, params: list) -> str | None:
    n = min(x.size(1), PROBE_TOKENS)
    if n < 2:
        return "too few tokens to check"
    gen = torch.Generator().manual_seed(0)
    xp = torch.randn(x.size(0), n, x.size(2), generator=gen).to(x.device, x.dtype)
    xp.requires_grad_(True)
    dy = torch.randn(xp.shape, generator=gen).to(x.device, x.dtype)
    ep = {k: e[:, :n].detach().requires_grad_(e.requires_grad) for k, e in extras.items()}
    try:
        def whole(q, k, v, calls):
            return stand_in(q, k, v)

        with torch.enable_grad(), _intercepting(whole):
            y = call(xp, slice(0, n), **ep)
        want = _grads(y, [xp, *ep.values(), *params], dy)
        have, y2 = split_grads(call, xp.detach().requires_grad_(True), ep, params, dy,
                               n // 2, *_stand_in_pair(), output=True)
    except (Unfit, _Stop) as e:
        return str(e) or "its forward stopped early"
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        return f"its forward failed on tiles: {type(e).__name__}: {e}"
    tol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 5e-2
    if not _close(y2, y.detach(), tol):
        return "its output differs when split at the attention call"
    for a, b in zip(have, want):
        if (a is None) != (b is None) and not _zero(a if b is None else b):
            return "a gradient is missing when split at the attention call"
        if a is not None and b is not None and not _close(a, b, tol):
            return ("its gradients differ when split at the attention call (it mixes "
                    "tokens outside its attention call)")
    return None


def _zero(t: Tensor) -> bool:
    return bool((t == 0).all())  # a NaN is not zero


def _close(a: Tensor, b: Tensor, tol: float) -> bool:
    scale = b.detach().float().abs().max().clamp(min=1e-12)
    err = (a.detach().float() - b.detach().float()).abs().max() / scale
    return bool(err <= tol)


def _agree(why: str | None, device) -> str | None:
    """The verdict of every rank: split only where all ranks may (backward's collectives
    must match)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return why
    flag = torch.tensor([0 if why else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if why is None and int(flag.item()) == 0:
        return "another rank's layer does not qualify"
    return why
