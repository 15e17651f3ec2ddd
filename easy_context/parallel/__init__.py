"""Sequence-parallel methods, picked by name. Each module describes its method once
(``METHOD``, see method.py); this registry lists them.

Every method takes local shards in the flash-attn layout and the same arguments:

    attention(q, k, v, group=None, causal=True, softmax_scale=None, document_ids=None,
              ring_degree=None, variant=None, sinks=None) -> out
    q: (B, S_local, Hq, D), k, v: (B, S_local, Hkv, D), out: (B, S_local, Hq, D)
"""

from __future__ import annotations

from . import allgather, dist_flash, local, ring, ulysses, usp, zigzag
from .method import AttentionDims, Method

METHODS: dict[str, Method] = {m.name: m for m in (
    local.METHOD, ring.METHOD, zigzag.METHOD, dist_flash.METHOD, ulysses.METHOD, usp.METHOD,
    allgather.METHOD)}

ALIASES: dict[str, str] = {alias: m.name for m in METHODS.values() for alias in m.aliases}

# The methods that split a sequence over ranks, fastest first (the planner's order).
SEQUENCE_PARALLEL = tuple(sorted((n for n in METHODS if METHODS[n].layout != "whole"),
                                 key=lambda n: METHODS[n].speed_rank))


def get_method(name: str) -> Method:
    """The method called ``name`` (or one of its aliases, e.g. the original EasyContext's)."""
    method = METHODS.get(ALIASES.get(name, name))
    if method is None:
        raise ValueError(f"unknown sequence-parallel method {name!r}; choose one of "
                         f"{sorted(METHODS)} (or an alias: {sorted(ALIASES)})")
    return method


__all__ = ["ALIASES", "AttentionDims", "METHODS", "Method", "SEQUENCE_PARALLEL", "get_method"]
