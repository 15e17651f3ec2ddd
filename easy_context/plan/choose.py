"""Pick the sequence-parallel method for a setup, and the longest sequence that fits.

The order of preference is by speed, from what each method communicates and how it balances
a causal mask (ours and the papers' measurements agree on the order; it is not measured per
setup here):
  1. ulysses_attn: two all-to-alls per attention, O(s H D) per device whatever N, no ring
     steps, balanced. Needs heads % N == 0 (and KV heads dividing N or N dividing them).
  2. usp_attn: Ulysses inside groups of U devices, zigzag ring across N/U groups: Ulysses
     speed when N exceeds (or does not divide) the head count.
  3. allgather_attn: one all-gather of K/V per layer; cheap when K/V are a small fraction of
     q (GQA with heads / kv_heads >= 4), but holds the whole sequence's K/V.
  4. zigzag_ring_attn: N ring steps overlapped with compute, balanced under the causal mask;
     works for any N and head count.
  5. dist_flash_attn: balanced too, with more, smaller messages (relayed q/out/dout).
  6. ring_attn: the last device does N times the first one's work under a causal mask.
The first candidate whose constraints hold and whose estimate fits the device is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .estimate import MemoryEstimate, estimate_memory
from .shapes import ModelShape

ORDER = ("ulysses_attn", "usp_attn", "allgather_attn", "zigzag_ring_attn", "dist_flash_attn",
         "ring_attn")
GQA_ALLGATHER_RATIO = 4  # heads / kv_heads from which all-gathering K/V is cheaper than a ring


@dataclass
class MethodChoice:
    method: str | None  # None: nothing fits
    ring_degree: int | None
    reason: str
    estimate: MemoryEstimate | None
    rejected: dict[str, str] = field(default_factory=dict)  # method -> why not


def required_multiple(method: str, world_size: int, ring_degree: int | None = None) -> int:
    """What seq_len must be divisible by: the method's layout rule (easy_context.layouts);
    "local" (one device) needs nothing; usp without a ring degree plans a pure ring."""
    if method == "local" or world_size == 1:
        return 1
    from ..sequence_parallel import required_multiple as layout_multiple

    if method == "usp_attn" and ring_degree is None:
        ring_degree = world_size
    return layout_multiple(method, world_size, ring_degree)


def _kv_ok(kv_heads: int, n: int) -> bool:
    return kv_heads % n == 0 or n % kv_heads == 0


def constraint(shape: ModelShape, method: str, world_size: int) -> tuple[str | None, int | None]:
    """(why ``method`` cannot or should not run here, or None; the usp ring degree)."""
    n, hq, hkv = world_size, shape.heads, shape.kv_heads
    if method == "ulysses_attn":
        if hq % n:
            return f"Ulysses needs heads divisible by N ({hq} % {n} != 0)", None
        if not _kv_ok(hkv, n):
            return f"Ulysses needs KV heads ({hkv}) to divide N or N to divide them", None
        return None, None
    if method == "usp_attn":
        # The largest Ulysses degree U < N that the heads allow; the ring takes the rest.
        for u in sorted((d for d in range(2, n) if n % d == 0), reverse=True):
            if hq % u == 0 and _kv_ok(hkv, u):
                return None, n // u
        return f"no Ulysses degree 1 < U < {n} divides both N and the {hq} heads", None
    if method == "allgather_attn":
        if hq < GQA_ALLGATHER_RATIO * hkv:
            return (f"K/V are {hkv}/{hq} of the heads (no strong GQA): gathering them costs "
                    f"more than a ring", None)
        return None, None
    if method in ("zigzag_ring_attn", "dist_flash_attn", "ring_attn"):
        return None, None
    raise ValueError(f"unknown method {method!r}")


_WHY = {
    "ulysses_attn": "Ulysses: two all-to-alls per layer, no ring steps, balanced",
    "usp_attn": "USP: Ulysses inside groups of {u}, zigzag ring over {r} groups "
                "(Ulysses alone cannot use all N devices with {h} heads)",
    "allgather_attn": "all-gather: K/V are only {kv}/{h} of the heads (GQA), one gather per layer",
    "zigzag_ring_attn": "zigzag ring: works for any N and head count, balanced under the causal mask",
    "dist_flash_attn": "dist_flash (LightSeq): balanced, with more, smaller messages",
    "ring_attn": "ring: the simplest; unbalanced under the causal mask",
}


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
        u = world_size // ring_degree if ring_degree else world_size
        reason = _WHY[method].format(u=u, r=ring_degree, h=shape.heads, kv=shape.kv_heads)
        skipped = [m for m in methods[: methods.index(method)]]
        if skipped:
            reason += "; faster ones ruled out: " + "; ".join(
                f"{m}: {rejected[m]}" for m in skipped if m in rejected)
        return MethodChoice(method, ring_degree, reason, est, rejected)
    return MethodChoice(None, None, "no method fits: " + "; ".join(
        f"{m}: {r}" for m, r in rejected.items()), best_tried, rejected)


def max_sequence_length(shape: ModelShape, world_size: int, device_bytes: int,
                        method: str | None = None, ring_degree: int | None = None,
                        granularity: int = 1, limit: int = 1 << 26, **kw) -> tuple[int, str | None]:
    """(longest seq_len that fits, the method) by binary search over multiples of what the
    method needs (times ``granularity``); memory grows with L for every component, so the
    search is exact for the model. method None: the longest over all methods that can run
    here (ties go to the faster). Returns (0, None) when not even one step fits."""
    if method is None:
        best, best_m = 0, None
        candidates = ("local",) if world_size == 1 else ORDER
        for m in candidates:
            if m != "local" and constraint(shape, m, world_size)[0]:
                continue
            rd = constraint(shape, m, world_size)[1] if m == "usp_attn" else None
            length, _ = max_sequence_length(shape, world_size, device_bytes, m, rd, granularity,
                                            limit, **kw)
            if length > best:
                best, best_m = length, m
        return best, best_m
    step = math.lcm(required_multiple(method, world_size, ring_degree), granularity)

    def fits(k: int) -> bool:
        est = estimate_memory(shape, k * step, world_size, method, ring_degree=ring_degree, **kw)
        return est.total <= device_bytes

    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step, method
