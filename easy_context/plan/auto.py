"""``easy-context plan --auto``: search every memory setting for the longest context, or for the
fastest setup that fits a given length; ``easy-context train --auto-memory`` applies it.

The search space: each sequence-parallel method that can run on the devices (and its ring
degree), the engine (FSDP, ZeRO-3), offload of optimizer states / parameters, activation
checkpointing (full, offloaded to host with prefetch, attention-saving), and max-length
mode (easy_context.memory.maxlen): the MLP tile, query heads per attention chunk and the nested
recompute (every k-th layer input kept). Each setup is costed by easy_context.plan.estimate;
one fits when its peak is within the device budget and what it keeps in host memory
(offloaded states and checkpoints) within ``--host-memory`` per device.

Longest context: the setup whose longest fitting length is the largest; among setups within
2% of it, the fastest by the order below (so attention-saving checkpointing whenever it fits
there as well as full or offloaded checkpoints do, other settings equal). For a given length:
the fastest setup that fits. Each plan says what each checkpointing choice would cost
(plan/recompute.py: memory kept against the share of the step's FLOPs recomputed).
Speed order (a ranking from what each setting costs per step, not a measured time): no
offload, then optimizer offload, then parameter offload (every step moves them through the
host link); attention-saving checkpointing, then full, then offloaded, then nested (each one
recomputes or moves more); untiled layers before fused ones, fewer head chunks and larger
tiles first; then the methods' own order (easy_context.parallel: Ulysses, USP, all-gather,
zigzag ...); FSDP before ZeRO-3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from .choose import ORDER, constraint, max_sequence_length, required_multiple
from .estimate import GIB, MemoryEstimate, estimate_memory
from .lora import LINEAR, LoRASpec
from .recompute import checkpointing_costs, describe
from .shapes import ModelShape

TILES = (16384, 8192, 4096, 2048, 1024, 512)
FAST_TILE = 4096  # tiles this long keep the MLP's matmuls efficient; smaller only to fit
KEEP_EVERY = (1, 2, 4)
NEAR_BEST = 0.98
_OFFLOAD_RANK = {"none": 0, "optimizer": 1, "params": 2}
_CKPT_RANK = {"attention": 0, "full": 1, "offload": 2, "none": 0}


@dataclass(frozen=True)
class Setup:
    """One point of the search: everything ``easy-context train`` needs besides the data."""

    method: str
    ring_degree: int | None
    engine: str
    offload: str
    checkpointing: str
    mlp_tile: int | None = None  # None: the untiled layers
    heads_per_chunk: int | None = None
    keep_every: int = 1
    deterministic: bool = False  # --deterministic: counted in the kernel workspace, not searched
    # --lora-rank / --lora-targets / --lora-4bit: given, not searched; every candidate carries
    # them into its estimate and its train flags
    lora: LoRASpec | None = None

    @property
    def fused(self) -> bool:
        return self.mlp_tile is not None

    def kw(self, dtype: str) -> dict:
        return dict(engine=self.engine, offload=self.offload, checkpointing=self.checkpointing,
                    dtype=dtype, loss_chunk="auto", ring_degree=self.ring_degree,
                    mlp_tile=self.mlp_tile, heads_per_chunk=self.heads_per_chunk,
                    keep_every=self.keep_every, deterministic=self.deterministic, lora=self.lora)

    def speed_key(self, shape: ModelShape) -> tuple:
        from ..parallel import get_method

        groups = -(-shape.heads // (self.heads_per_chunk or shape.heads))
        return (_OFFLOAD_RANK[self.offload], _CKPT_RANK[self.checkpointing] + (self.keep_every > 1),
                int(self.fused), groups, -(self.mlp_tile or 1 << 30),
                get_method(self.method).speed_rank, self.engine != "fsdp")

    def train_flags(self, seq_len: int, devices: int, dtype: str = "bf16") -> str:
        flags = [f"--seq-length {seq_len}", f"--nproc-per-node {devices}" if devices > 1 else "",
                 f"--parallel-mode {'data_parallel' if self.method == 'local' else self.method}",
                 f"--ring-degree {self.ring_degree}" if self.ring_degree else "",
                 f"--engine {self.engine}", f"--offload {self.offload}",
                 f"--checkpointing {self.checkpointing}", f"--mixed-precision {dtype}",
                 f"--mlp-tile {self.mlp_tile if self.fused else 'off'}",
                 f"--head-chunk {self.heads_per_chunk if self.fused else 'off'}",
                 f"--keep-every {self.keep_every}" if self.keep_every > 1 else "",
                 "--deterministic" if self.deterministic else ""] + lora_flags(self.lora)
        return " ".join(f for f in flags if f)


def lora_flags(lora: LoRASpec | None) -> list[str]:
    """``easy-context train`` flags of a LoRA run (none for full fine-tuning)."""
    if lora is None:
        return []
    targets = "all-linear" if set(lora.targets) == set(LINEAR) else ",".join(lora.targets)
    return [f"--lora-rank {lora.rank}",
            f"--lora-targets {targets}" if targets != "all-linear" else "",
            "--lora-4bit" if lora.base_4bit else ""]


@dataclass
class AutoPlan:
    setup: Setup | None
    seq_len: int  # the length the setup is planned for (the longest, with --max-seq-len)
    estimate: MemoryEstimate | None
    reason: str
    considered: int = 0
    runners_up: list = field(default_factory=list)  # (length, Setup) of other setups


def _bases(shape: ModelShape, devices: int, engines=("fsdp", "deepspeed"),
           lora: LoRASpec | None = None) -> list[Setup]:
    """The untiled setups to search: method x engine x offload x checkpointing, each carrying
    ``lora`` (a 4-bit base runs on FSDP only: ZeRO-3 would partition its NF4 weights)."""
    if lora is not None and lora.base_4bit:
        engines = tuple(e for e in engines if e == "fsdp")
    out = []
    methods = [("local", None)] if devices == 1 else []
    for m in ORDER if devices > 1 else ():
        why, rd = constraint(shape, m, devices)
        if not why:
            methods.append((m, rd))
    for method, rd in methods:
        for engine in engines:
            for offload in ("none", "params") if engine == "fsdp" else ("none", "optimizer", "params"):
                for ckpt in ("attention", "full", "offload"):
                    out.append(Setup(method, rd, engine, offload, ckpt, lora=lora))
    return out


def chunk_choices(shape: ModelShape, setup: Setup, devices: int) -> list[int]:
    """Query heads per chunk the method accepts for every chunk (largest first): multiples of
    the GQA ratio (whole KV heads) and its divisors (parts of one KV head's query heads)."""
    from ..memory.fused_layer import head_chunks
    from ..parallel import get_method

    m = get_method("local" if devices == 1 else setup.method)
    r = shape.heads // shape.kv_heads
    sizes = [c * r for c in range(shape.kv_heads, 0, -1)] + [d for d in range(r - 1, 0, -1)
                                                             if r % d == 0]
    ok = []
    for c in sizes:
        try:
            for hq, hkv in {(q.stop - q.start, k.stop - k.start)
                            for q, k in head_chunks(shape.heads, shape.kv_heads, c)}:
                m.check(hq, hkv, devices, setup.ring_degree)
        except ValueError:
            continue
        ok.append(c)
    return ok


def _fits(shape, seq_len, devices, setup, device_bytes, host_bytes, dtype):
    est = estimate_memory(shape, seq_len, devices, setup.method, **setup.kw(dtype))
    return est.total <= device_bytes and (host_bytes is None or est.host_bytes <= host_bytes), est


def fastest_tiling(shape: ModelShape, seq_len: int, devices: int, setup: Setup,
                   device_bytes: int, host_bytes: int | None, dtype: str = "bf16",
                   allow_untiled: bool = True, tile: int | None = None, chunk: int | None = None,
                   keep_every: int | None = None) -> tuple[Setup | None, MemoryEstimate | None]:
    """``setup`` untiled if it fits, else with the fastest (tile, chunk, keep_every) that fits
    (``tile``, ``chunk``, ``keep_every``: fixed values instead of searched ones);
    (None, estimate of the most frugal one) when nothing fits. A LoRA setup is tiled like
    any other (its layers take max-length mode's generic path, which runs the adapters; the
    fused layer's terms plan it, with LoRA's own changes: plan/lora.py)."""
    if allow_untiled or not shape.tileable:
        ok, est = _fits(shape, seq_len, devices, setup, device_bytes, host_bytes, dtype)
        if ok or not shape.tileable:  # never tiled (shapes.tileable)
            return (setup if ok else None), est
    s = seq_len // devices
    tiles = [tile] if tile else sorted({min(t, s) for t in TILES}, reverse=True)
    chunks = [chunk] if chunk else chunk_choices(shape, setup, devices)
    keeps = [keep_every] if keep_every else [k for k in KEEP_EVERY if k <= shape.layers]
    tried = [replace(setup, mlp_tile=t, heads_per_chunk=c, keep_every=k)
             for c in chunks for t in tiles for k in keeps]
    tried.sort(key=lambda x: x.speed_key(shape))
    last = None
    for cand in tried:
        ok, est = _fits(shape, seq_len, devices, cand, device_bytes, host_bytes, dtype)
        if ok:
            return cand, est
        last = est
    return None, last


def plan_for_length(shape: ModelShape, seq_len: int, devices: int, device_bytes: int,
                    host_bytes: int | None = None, dtype: str = "bf16",
                    bases: list[Setup] | None = None) -> AutoPlan:
    """The fastest setup (by the module's order) in which ``seq_len`` fits."""
    found = []
    for base in bases or _bases(shape, devices):
        mult = required_multiple(base.method, devices, base.ring_degree)
        length = -(-seq_len // mult) * mult  # padded, as the trainer asks
        setup, est = fastest_tiling(shape, length, devices, base, device_bytes, host_bytes, dtype)
        if setup is not None:
            found.append((setup.speed_key(shape), length, setup, est))
    if not found:
        return AutoPlan(None, seq_len, None, f"nothing fits {seq_len:,} tokens on {devices} "
                        "device(s) with this memory", len(bases or []))
    found.sort(key=lambda f: f[0])
    _, length, setup, est = found[0]
    return AutoPlan(setup, length, est, "the fastest setup that fits", len(found),
                    [(f[1], f[2]) for f in found[1:4]])


def plan_longest(shape: ModelShape, devices: int, device_bytes: int,
                 host_bytes: int | None = None, dtype: str = "bf16", granularity: int = 1024,
                 bases: list[Setup] | None = None) -> AutoPlan:
    """The setup that reaches the longest sequence (see the module docstring)."""
    results = []
    for base in bases or _bases(shape, devices):
        frugal = [base] + [replace(base, mlp_tile=1024, heads_per_chunk=c, keep_every=k)
                           for c in chunk_choices(shape, base, devices)[-1:] for k in KEEP_EVERY
                           if k == 1 or (base.checkpointing != "attention" and k <= shape.layers)
                           if shape.tileable]  # untiled only: models some layer of
        # which max-length mode does not run (shapes.tileable)
        for setup in frugal:
            length, _ = max_sequence_length(shape, devices, device_bytes, setup.method,
                                            setup.ring_degree, granularity, limit=1 << 31,
                                            host_bytes=host_bytes, **{
                                                k: v for k, v in setup.kw(dtype).items()
                                                if k != "ring_degree"})
            if length:
                results.append((length, setup))
    if not results:
        return AutoPlan(None, 0, None, "not even the shortest sequence fits", 0)
    best = max(length for length, _ in results)
    near = [(length, s) for length, s in results if length >= NEAR_BEST * best]
    near.sort(key=lambda r: r[1].speed_key(shape))
    length, setup = near[0]
    if setup.fused:  # the fastest tiling that still fits this length
        tuned, _ = fastest_tiling(shape, length, devices, replace(
            setup, mlp_tile=None, heads_per_chunk=None, keep_every=1), device_bytes,
            host_bytes, dtype, allow_untiled=False)
        setup = tuned or setup
    est = estimate_memory(shape, length, devices, setup.method, **setup.kw(dtype))
    results.sort(key=lambda r: -r[0])
    return AutoPlan(setup, length, est, f"longest of {len(results)} setups; the fastest within "
                    f"{100 - 100 * NEAR_BEST:.0f}% of it", len(results), results[:4])


# --------------------------------------------------------------------------- the CLI's output
def _describe(setup) -> str:
    tiling = (f"max-length mode: MLP tiles of {setup.mlp_tile} tokens, "
              f"{setup.heads_per_chunk} query head(s) per attention chunk"
              + (f", one layer input in {setup.keep_every} kept (nested recompute)"
                 if setup.keep_every > 1 else "") if setup.fused else "untiled layers")
    if setup.lora is not None:
        tiling += f", {setup.lora.describe()}"
    return (f"{setup.method}" + (f" (ring_degree {setup.ring_degree})" if setup.ring_degree else "")
            + f", {setup.engine}, offload={setup.offload}, checkpointing={setup.checkpointing}, "
            + tiling)


def setup_checkpointing_costs(shape: ModelShape, seq_len: int, devices: int, setup: Setup,
                              budget: int, dtype: str = "bf16"):
    """plan.recompute's costs of each checkpointing choice for ``setup`` (the rest of it
    unchanged; nested recompute (keep_every > 1) only with full or offloaded checkpoints, and
    its extra recompute is not counted)."""
    kw = {k: v for k, v in setup.kw(dtype).items() if k != "checkpointing"}
    choices = ("none", "attention", "full", "offload")
    if setup.keep_every > 1:
        choices = ("full", "offload")
    return checkpointing_costs(shape, seq_len, devices, setup.method, budget, choices, **kw)


def run_auto(args, shape, budget: int, lora: LoRASpec | None = None) -> int:
    """``plan --auto``'s output for the parsed ``args``; ``lora``: the adapters to plan
    every candidate with (plan.cli.lora_spec; None: full fine-tuning)."""
    n = args.devices
    host = None if args.host_memory is None else int(args.host_memory * GIB)
    head = (f"{shape.name}: {shape.num_params() / 1e9:.2f}B parameters on {n} x "
            f"{args.gpu_memory:g} GiB (planning with {budget / GIB:.1f} GiB each)"
            + (f", {args.host_memory:g} GiB host memory per device" if host else
               ", host memory not limited (--host-memory)"))
    lines, result = [head, shape.describe_paths()], {
        "model": shape.name, "devices": n, "budget_gib": budget / GIB,
        "host_gib": args.host_memory, "maxlen_paths": [p for _, p in shape.maxlen_paths()]}
    plans = []
    bases = [replace(b, deterministic=bool(getattr(args, "deterministic", False)))
             for b in _bases(shape, n, lora=lora)]
    if args.seq_len:
        plans.append(("for", plan_for_length(shape, args.seq_len, n, budget, host, args.dtype,
                                             bases=bases)))
    if args.max_seq_len or not args.seq_len:
        plans.append(("longest", plan_longest(shape, n, budget, host, args.dtype,
                                              args.granularity, bases=bases)))
    for kind, plan in plans:
        if plan.setup is None:
            lines.append(f"{'setup for ' + format(plan.seq_len, ',') + ' tokens' if kind == 'for' else 'longest'}: "
                         f"{plan.reason}")
            result[kind] = None
            if kind == "longest":
                lines.append("longest sequence that fits: 0 tokens (not even one step fits)")
            continue
        s, est = plan.setup, plan.estimate
        what = f"setup for {plan.seq_len:,} tokens" if kind == "for" else "longest-context setup"
        costs = setup_checkpointing_costs(shape, plan.seq_len, n, s, budget, args.dtype)
        lines += [f"{what}: {_describe(s)} ({plan.reason})", est.table(),
                  f"  host memory per device   {est.host_bytes / GIB:10.2f} GiB",
                  *describe(costs),
                  "train with: easy-context train --model ... --dataset ... "
                  + s.train_flags(plan.seq_len, n, args.dtype)]
        if kind == "longest":
            lines.append(f"longest sequence that fits: {plan.seq_len:,} tokens with {s.method}")
        result[kind] = {"seq_len": plan.seq_len, "setup": asdict(s),
                        "train_flags": s.train_flags(plan.seq_len, n, args.dtype),
                        "estimate": est.to_dict(), "reason": plan.reason,
                        "checkpointing_costs": [c.to_dict() for c in costs]}
    if any(k == "longest" for k, _ in plans):
        result["max_seq_len"] = (result.get("longest") or {}).get("seq_len", 0)
    print(json.dumps(result, indent=1) if args.json else "\n".join(lines))
    return 0
