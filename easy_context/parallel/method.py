"""What a sequence-parallel method says about itself, in one place.

Each method module ends with one ``METHOD = Method(...)``: the function that computes it,
the layout its shards are cut with, what it needs (``check``), what the sequence length must
divide by (``required_multiple``), whether it keeps packed documents apart, and what the
memory planner needs to know (the bytes its attention saves per token, its communication
buffers in backward for a group of KV heads, the bytes it sends per layer, and, where it can
move a multi-head latent attention layer's latent instead of K/V, what that sends). The registry (``parallel/__init__.py``)
lists the modules; the trainer, the evals, the Hugging Face integration, the original API's
shim, the planner and the CLIs all ask the description, so adding a method means writing its
module and one line of the registry.

Every method computes ``attention(q, k, v, group=None, causal=True, softmax_scale=None,
document_ids=None, ring_degree=None, variant=None, sinks=None) -> out`` on local shards in
the flash-attn layout: q (B, S_local, Hq, D), k (B, S_local, Hkv, D), v (B, S_local, Hkv,
Dv); ``group`` is a process group, an :class:`~easy_context.mesh.SPGroup`, or None for the
world; ``variant`` a sliding window, chunks or soft-capping (attention/variants.py),
``sinks`` (Hq,) attention sinks (attention/sinks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from .. import layouts


class AttentionDims(NamedTuple):
    """The attention shape of a model, as the cost functions need it."""

    heads: int  # query heads
    kv_heads: int
    head_dim: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def no_check(heads: int | None, kv_heads: int | None, world: int,
             ring_degree: int | None) -> None:
    """Methods that run on any number of ranks and heads (block methods)."""


def standard_saved_per_token(dims: AttentionDims, a: int, world: int,
                             ring_degree: int | None) -> int:
    """Bytes per local token one layer's attention keeps for backward: RoPE'd q, k, v and the
    output in the compute dtype (``a`` bytes), and the float32 log-sum-exp per head."""
    hq, hkv, hd = dims
    return (hq + 2 * hkv) * hd * a + hq * hd * a + hq * 4


def no_buffers(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None,
               kv_heads: int = 1) -> int:
    return 0


def no_comm(dims: AttentionDims, s: int, a: int, world: int, ring_degree: int | None) -> int:
    return 0


def shard_call(dims: AttentionDims, s: int, world: int,
               ring_degree: int | None) -> tuple[int, int, AttentionDims]:
    """A block method's largest kernel call: a shard's queries against a shard's keys, all the
    model's heads (head groups take some of its KV heads)."""
    return s, s, dims


@dataclass(frozen=True)
class Method:
    """One sequence-parallel method (see the module docstring)."""

    name: str
    attention: Callable[..., object]
    """fn(q, k, v, group=None, causal=True, softmax_scale=None, document_ids=None,
    ring_degree=None, variant=None, sinks=None) -> out, autograd-aware."""
    layout: str
    """How the sequence is cut into shards (easy_context.layouts)."""
    summary: str
    """How it works, in one line."""
    use_when: str
    """When to pick it, in one line (README, planner)."""
    short: str
    """Abbreviation for tables."""
    speed_rank: int
    """Planner preference: lower runs faster where it can run (0: no communication)."""
    documents: bool = True
    """Keeps packed documents apart (takes document_ids)."""
    aliases: tuple[str, ...] = ()
    """Other names accepted for it (the original EasyContext's, short ones)."""
    needs_ring_degree: bool = False
    check_fn: Callable[[int | None, int | None, int, int | None], None] = no_check
    """Raises the ValueError that says what to change; heads may be None (unknown yet)."""
    unsuitable: Callable[[int, int, int], str | None] = lambda heads, kv_heads, world: None
    """Why the planner should not pick it here although it can run (or None)."""
    ring_degrees: Callable[[int, int, int], list[int | None]] = lambda heads, kv, world: [None]
    """The ring degrees worth planning with, best first (usp); [None] for the others."""
    saved_per_token: Callable[[AttentionDims, int, int, int | None], int] = standard_saved_per_token
    """Bytes per local token the attention of one layer saves for backward."""
    group_buffers: Callable[..., int] = no_buffers
    """(dims, s local tokens, a bytes per element, world, ring_degree, kv_heads) -> bytes of
    the buffers alive in one layer's backward when it runs ``kv_heads`` KV heads at a time
    (head_groups.py); linear in kv_heads for the block methods, constant for the others."""
    kernel_call: Callable[[AttentionDims, int, int, int | None],
                          tuple[int, int, AttentionDims]] = shard_call
    """(dims, s, world, ring_degree) -> (query rows, key rows, heads) of one layer's largest
    attention kernel call with every head at once: what its backward's workspace
    (attention/workspace.py) grows with; its passes divide those KV heads into groups."""
    comm_bytes: Callable[[AttentionDims, int, int, int, int | None], int] = no_comm
    """(dims, s, a, world, ring_degree) -> bytes one rank sends per layer, forward and
    backward (recomputation under checkpointing not counted)."""
    latent_comm_bytes: Callable[[int, int, int, int], int] | None = None
    """(latent values per token, s, a, world) -> bytes one rank sends per layer when it moves
    a multi-head latent attention layer's latent (kv_lora_rank + qk_rope_head_dim values a
    token) instead of its expanded K/V (parallel/latent.py, integrations/hf_latent.py); None:
    the method moves the expanded K/V of MLA layers too."""

    def check(self, heads: int | None, kv_heads: int | None, world: int,
              ring_degree: int | None = None) -> None:
        """Raise a ValueError that says what to change when this method cannot run with
        ``heads`` query / ``kv_heads`` key-value heads over ``world`` ranks."""
        if world < 1:
            raise ValueError(f"{self.name}: the number of ranks must be >= 1, got {world}")
        if ring_degree is not None and not self.needs_ring_degree:
            raise ValueError(f"ring_degree applies to usp_attn only, not {self.name}; drop it")
        if heads is not None and kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
            raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads "
                             f"({kv_heads}) for grouped-query attention")
        self.check_fn(heads, kv_heads, world, ring_degree)

    def kv_heads_per_group(self, dims: AttentionDims, s: int, a: int, world: int,
                           ring_degree: int | None = None, budget: int | None = None,
                           workspace: Callable[..., int] | None = None) -> int:
        """KV heads per pass under ``budget`` bytes (default: the GPU budget), as the method
        picks them at run time (head_groups.kv_heads_per_group): the budget bounds the part
        of the buffers that grows with the group (usp's Ulysses buffers do not) plus the
        kernel's backward workspace for the group's heads, ``workspace(sq, sk, hq, hkv, d,
        a)`` (attention/workspace.py; None: not counted)."""
        from .head_groups import BUDGETS, kv_heads_per_group

        budget = BUDGETS["cuda"] if budget is None else budget
        fixed = self.group_buffers(dims, s, a, world, ring_degree, 0)
        call_heads = self.kernel_call(dims, s, world, ring_degree)[2]
        return kv_heads_per_group(
            lambda g: (self.group_buffers(dims, s, a, world, ring_degree, g) - fixed
                       + self.workspace(dims, s, a, world, ring_degree, g, workspace)),
            call_heads.kv_heads, budget)

    def workspace(self, dims: AttentionDims, s: int, a: int, world: int,
                  ring_degree: int | None, kv_heads: int,
                  workspace: Callable[..., int] | None) -> int:
        """The kernel's backward workspace for a call on ``kv_heads`` of the call's KV heads."""
        if workspace is None:
            return 0
        sq, sk, call = self.kernel_call(dims, s, world, ring_degree)
        g = min(kv_heads, call.kv_heads)
        return workspace(sq, sk, g * (call.heads // call.kv_heads), g, call.head_dim, a)

    def buffers(self, dims: AttentionDims, s: int, a: int, world: int,
                ring_degree: int | None = None, budget: int | None = None,
                workspace: Callable[..., int] | None = None) -> int:
        """Bytes of the buffers alive in one layer's backward, with the group size the
        method picks under ``budget`` (default: the GPU budget, head_groups.BUDGETS)."""
        g = self.kv_heads_per_group(dims, s, a, world, ring_degree, budget, workspace)
        return self.group_buffers(dims, s, a, world, ring_degree, g)

    def call_workspace(self, dims: AttentionDims, s: int, a: int, world: int,
                       ring_degree: int | None = None, budget: int | None = None,
                       workspace: Callable[..., int] | None = None) -> int:
        """The kernel's backward workspace of one call with the group size picked."""
        g = self.kv_heads_per_group(dims, s, a, world, ring_degree, budget, workspace)
        return self.workspace(dims, s, a, world, ring_degree, g, workspace)

    def required_multiple(self, world: int, ring_degree: int | None = None) -> int:
        """What the sequence length must be divisible by over ``world`` ranks."""
        if world == 1:
            return 1
        return layouts.required_multiple(self.layout, world,
                                         ring_degree if self.layout == "usp" else None)


def check_ring_degree(method: str, world: int, ring_degree: int | None) -> int:
    """``ring_degree`` must divide the ranks (usp); returns it."""
    if ring_degree is None:
        raise ValueError(f"{method} needs ring_degree (the number of ring ranks); with "
                         f"{world} ranks pick one of {_divisors(world)} (1: pure Ulysses, "
                         f"{world}: pure zigzag ring)")
    if not isinstance(ring_degree, int) or ring_degree < 1 or world % ring_degree:
        raise ValueError(f"{method}: ring_degree={ring_degree!r} does not divide the "
                         f"{world} ranks; pick one of {_divisors(world)}")
    return ring_degree
