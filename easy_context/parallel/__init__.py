"""Sequence-parallel attention methods, picked by name.

Every method takes local shards in the flash-attn layout and the same arguments:

    fn(q, k, v, group=None, causal=True, softmax_scale=None) -> out
    q: (B, S_local, Hq, D), k, v: (B, S_local, Hkv, D), out: (B, S_local, Hq, D)

``usp_attn`` also takes ``ring_degree``; the methods marked ``documents`` take
``document_ids`` (B, S_local) for packed sequences. Each method names the layout its shards must be
cut with (easy_context.layouts).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Method:
    name: str
    layout: str
    module: str  # easy_context.parallel.<module> defines a function called `name`
    doc: str
    documents: bool = False  # takes document_ids= (packed documents, block masks)

    @property
    def fn(self) -> Callable:
        # Imported on first use: a user of one method does not load the others.
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), self.name)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ring_attn", "contiguous", "ring", "K/V passed around a ring; simple, unbalanced when causal",
           documents=True),
    Method("zigzag_ring_attn", "zigzag", "zigzag", "ring over zigzag shards; balanced when causal",
           documents=True),
    Method("dist_flash_attn", "contiguous", "dist_flash",
           "LightSeq's balanced schedule: idle ranks compute blocks for busy ones"),
    Method("ulysses_attn", "contiguous", "ulysses", "all-to-all between sequence and heads"),
    Method("usp_attn", "usp", "usp", "Ulysses inside groups of neighbours, zigzag ring across them"),
    Method("allgather_attn", "zigzag", "allgather", "K/V gathered once (Llama-3 style); cheap with GQA",
           documents=True),
)}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown sequence-parallel method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name]
