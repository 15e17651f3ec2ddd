"""Attention-saving activation checkpointing: recompute a layer, but not its attention.

With plain checkpointing, backward re-runs each layer's forward, attention included: for a
sequence-parallel method that is a second pass of the most expensive kernel *and* of its
communication. LightSeq's rematerialisation-aware idea: keep each layer's attention output
and log-sum-exp (small: O(S) per head) and let the recompute take them instead.

``saving_context()`` gives the pair of contexts that ``torch.utils.checkpoint`` takes as
``context_fn``: one storage per checkpointed call; during the forward every attention result
is stored, during the recompute it is handed back in the same order. Attention functions
call :func:`run_saved` around their forward computation.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

_MODE: contextvars.ContextVar = contextvars.ContextVar("easy_context_attention_saving", default=None)


class _Store:
    def __init__(self):
        self.results: list = []
        self.next = 0


@contextlib.contextmanager
def _mode(store: _Store, reuse: bool):
    token = _MODE.set((store, reuse))
    try:
        yield
    finally:
        _MODE.reset(token)


def saving_context():
    """``context_fn`` for torch.utils.checkpoint.checkpoint (non-reentrant)."""
    store = _Store()
    return _mode(store, reuse=False), _mode(store, reuse=True)


def run_saved(compute: Callable[[], tuple]) -> tuple:
    """Run ``compute()`` (which returns e.g. (out, lse)), unless this is the recompute of a
    checkpointed layer whose forward already stored the result."""
    state = _MODE.get()
    if state is None:
        return compute()
    store, reuse = state
    if reuse:
        if store.next >= len(store.results):
            raise RuntimeError("attention-saving checkpointing: the recompute asked for more "
                               "attention results than the forward stored")
        result = store.results[store.next]
        store.results[store.next] = None  # hand it over; backward keeps it as long as needed
        store.next += 1
        return result
    result = compute()
    store.results.append(tuple(t.detach() if hasattr(t, "detach") else t for t in result))
    return result


@contextlib.contextmanager
def recording(results: list):
    """Append every attention result computed inside to ``results`` (detached), computing
    it as usual: for callers that keep the results themselves (the head-chunked decoder
    layer, easy_context.memory.fused_layer) and hand them back with :func:`replaying`."""
    store = _Store()
    store.results = results
    with _mode(store, reuse=False):
        yield


@contextlib.contextmanager
def replaying(results: list):
    """Hand back ``results`` in order instead of computing attention (see :func:`recording`)."""
    store = _Store()
    store.results = list(results)
    with _mode(store, reuse=True):
        yield
