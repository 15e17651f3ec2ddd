"""Pick the sequence-parallel method for a setup, and the longest sequence that fits.

The order of preference is each method's ``speed_rank`` (easy_context.parallel: Ulysses,
USP, all-gather, zigzag ring, dist_flash, ring), from what each method communicates and how
it balances a causal mask (ours and the papers' measurements agree on the order; it is not
measured per setup here). The first method whose description accepts the heads and ranks
(``check``), that suits them (``unsuitable``: e.g. all-gather without strong GQA) and whose
estimate fits the device is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..parallel import SEQUENCE_PARALLEL, get_method
from .estimate import MemoryEstimate, estimate_memory
from .shapes import ModelShape

ORDER = SEQUENCE_PARALLEL


@dataclass
class MethodChoice:
    method: str | None  # None: nothing fits
    ring_degree: int | None
    reason: str
    estimate: MemoryEstimate | None
    rejected: dict[str, str] = field(default_factory=dict)  # method -> why not


def required_multiple(method: str, world_size: int, ring_degree: int | None = None) -> int:
    """What seq_len must be divisible by (the method's rule); usp without a ring degree plans
    a pure ring."""
    m = get_method(method)
    if m.needs_ring_degree and ring_degree is None:
        ring_degree = world_size
    return m.required_multiple(world_size, ring_degree)


def constraint(shape: ModelShape, method: str, world_size: int) -> tuple[str | None, int | None]:
    """(why ``method`` cannot or should not run here, or None; the ring degree to use)."""
    m = get_method(method)
    # an MLA model under a method that sends its latent moves no K/V heads (hf_latent.py)
    latent = bool(shape.kv_lora_rank) and m.latent_comm_bytes is not None
    why = None if latent else m.unsuitable(shape.heads, shape.kv_heads, world_size)
    if why:
        return why, None
    for ring_degree in m.ring_degrees(shape.heads, shape.kv_heads, world_size):
        try:
            m.check(shape.heads, shape.kv_heads, world_size, ring_degree)
        except ValueError as e:
            why = str(e)
            continue
        return None, ring_degree
    return why or f"{method} cannot run with {shape.heads} heads on {world_size} devices", None


def _reason(method: str, world_size: int, ring_degree: int | None) -> str:
    m = get_method(method)
    if ring_degree is None:
        return f"{m.name}: {m.use_when}"
    return (f"{m.name}: {m.use_when} (Ulysses groups of {world_size // ring_degree}, "
            f"ring_degree {ring_degree})")


def choose_method(shape: ModelShape, seq_len: int, world_size: int, device_bytes: int,
                  methods: tuple[str, ...] = ORDER, **kw) -> MethodChoice:
    """The fastest method (see ORDER) that runs here and fits ``device_bytes``.

    ``kw`` goes to estimate_memory (engine, offload, checkpointing, dtype, loss_chunk, ...).
    seq_len is rounded up to what the method needs (padding, as the trainer does).
    """
    if world_size == 1:
        est = estimate_memory(shape, seq_len, 1, "local", **kw)
        fits = est.total <= device_bytes
        return MethodChoice("local" if fits else None, None,
                            "one device: plain attention, no sequence parallelism"
                            if fits else f"does not fit on one device: needs "
                            f"{est.total / 2**30:.1f} GiB > {device_bytes / 2**30:.1f} GiB", est)
    rejected: dict[str, str] = {}
    best_tried = None
    for method in methods:
        why_not, ring_degree = constraint(shape, method, world_size)
        if why_not:
            rejected[method] = why_not
            continue
        mult = required_multiple(method, world_size, ring_degree)
        length = -(-seq_len // mult) * mult
        est = estimate_memory(shape, length, world_size, method, ring_degree=ring_degree, **kw)
        if est.total > device_bytes:
            rejected[method] = (f"needs {est.total / 2**30:.1f} GiB per device > "
                                f"{device_bytes / 2**30:.1f} GiB")
            best_tried = best_tried or est
            continue
        reason = _reason(method, world_size, ring_degree)
        skipped = [m for m in methods[: methods.index(method)]]
        if skipped:
            reason += "; faster ones ruled out: " + "; ".join(
                f"{m}: {rejected[m]}" for m in skipped if m in rejected)
        return MethodChoice(method, ring_degree, reason, est, rejected)
    return MethodChoice(None, None, "no method fits: " + "; ".join(
        f"{m}: {r}" for m, r in rejected.items()), best_tried, rejected)


def max_sequence_length(shape: ModelShape, world_size: int, device_bytes: int,
                        method: str | None = None, ring_degree: int | None = None,
                        granularity: int = 1, limit: int = 1 << 26, host_bytes: int | None = None,
                        **kw) -> tuple[int, str | None]:
    """(longest seq_len that fits, the method) by binary search over multiples of what the
    method needs (times ``granularity``); memory grows with L for every component, so the
    search is exact for the model. method None: the longest over all methods that can run
    here (ties go to the faster). ``host_bytes``: also keep the offloaded states and
    checkpoints within this much host memory per device. Returns (0, None) when not even one
    step fits."""
    if method is None:
        best, best_m = 0, None
        candidates = ("local",) if world_size == 1 else ORDER
        for m in candidates:
            why_not, rd = (None, None) if m == "local" else constraint(shape, m, world_size)
            if why_not:
                continue
            length, _ = max_sequence_length(shape, world_size, device_bytes, m, rd, granularity,
                                            limit, host_bytes, **kw)
            if length > best:
                best, best_m = length, m
        return best, best_m
    step = math.lcm(required_multiple(method, world_size, ring_degree), granularity)

    def fits(k: int) -> bool:
        est = estimate_memory(shape, k * step, world_size, method, ring_degree=ring_degree, **kw)
        return est.total <= device_bytes and (host_bytes is None or est.host_bytes <= host_bytes)

    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step, method
