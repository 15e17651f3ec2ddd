"""``easy-context plan``: memory per device, the method to use, and the longest context that fits.

    easy-context plan --model Llama-2-7B --seq-len 700000 --devices 8 --gpu-memory 80
    easy-context plan --model ./my-model --devices 16 --max-seq-len --offload params
    easy-context plan --report claims --output benchmarks/results/plan_claims.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..utils.paths import check_output_path
from .choose import ORDER, choose_method, max_sequence_length, required_multiple
from .estimate import CHECKPOINTING, DTYPES, ENGINES, GIB, OFFLOADS, estimate_memory
from .shapes import BUILTIN, load_shape, with_overrides


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="Llama-2-7B",
                   help="a local model folder / config.json, or a built-in shape: "
                        + ", ".join(s.name for s in BUILTIN.values()))
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (batch 1); omit with --max-seq-len")
    p.add_argument("--devices", type=int, default=8, help="sequence-parallel devices (N)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per device")
    p.add_argument("--usable", type=float, default=0.95,
                   help="fraction of the device memory the planner may fill (allocator "
                        "fragmentation and caches take the rest)")
    p.add_argument("--engine", choices=ENGINES, default="deepspeed",
                   help="fsdp (FSDP2), deepspeed (ZeRO-3), replicated (no sharding)")
    p.add_argument("--offload", choices=OFFLOADS, default="none")
    p.add_argument("--checkpointing", choices=CHECKPOINTING, default="full")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="bf16: mixed precision with fp32 master weights and AdamW states")
    p.add_argument("--method", choices=ORDER + ("auto",), default="auto",
                   help="sequence-parallel method; auto: the fastest that fits")
    p.add_argument("--ring-degree", type=int, default=None, help="usp_attn's ring degree")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="rows per chunk of the chunked loss (default: what training uses: "
                        "2,048 rows on a GPU, at most 1 GiB of fp32 logits; on a CPU about 64 "
                        "MiB of them); 0: the full-logits loss")
    p.add_argument("--max-seq-len", action="store_true",
                   help="find the longest sequence that fits (binary search)")
    p.add_argument("--granularity", type=int, default=1024,
                   help="report the longest length as a multiple of this")
    p.add_argument("--auto", action="store_true",
                   help="search method, engine, offload, checkpointing, MLP tile, head chunk "
                        "and nested recompute (max-length mode) for the longest context, or the "
                        "fastest setup for --seq-len; prints it as easy-context train flags")
    p.add_argument("--host-memory", type=float, default=None,
                   help="GiB of host RAM per device for offloaded states and checkpoints "
                        "(--auto; default: not limited)")
    p.add_argument("--deterministic", action="store_true",
                   help="plan for train --deterministic (flash-attn's deterministic backward "
                   "keeps its float32 dq accumulator once per split: up to SMs / heads copies)")
    p.add_argument("--kernel", choices=("flash2", "efficient", "flash4"), default=None,
                   help="attention kernel family whose backward workspace is counted "
                   "(default: flash2 for bf16, efficient for fp32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="plan a LoRA run: rank-R adapters on a frozen base (no gradients or "
                        "optimizer states for the base)")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-rank: the adapted modules of each layer (q_proj,v_proj,...), "
                        "or all-linear")
    p.add_argument("--lora-4bit", action="store_true",
                   help="with --lora-rank: a 4-bit NF4 base (QLoRA; --engine fsdp)")
    p.add_argument("--image-tokens", type=int, default=None,
                   help="a vision-language model (--model a local config with a vision_config): "
                        "image and video placeholder tokens in the sequence; counts the vision "
                        "tower's parameters and the activations of encoding them, the worst "
                        "rank holding min(tokens, seq-len / devices) of them")
    p.add_argument("--report", choices=("claims", "table"), default=None,
                   help="write the seed-claims check or the 'How far can I go?' tables of the "
                   "planner guide (docs/guides/planner.md)")
    p.add_argument("--output", default=None, help="file for --report (default: stdout)")


def lora_spec(args: argparse.Namespace):
    """The LoRASpec of ``--lora-rank/--lora-targets/--lora-4bit`` (None: full fine-tuning)."""
    from .lora import LoRASpec, parse_targets

    if not args.lora_rank:
        return None
    return LoRASpec(args.lora_rank, parse_targets(args.lora_targets), args.lora_4bit)


def _kw(args) -> dict:
    lora = lora_spec(args)
    return dict(engine=args.engine, offload=args.offload, checkpointing=args.checkpointing,
                dtype=args.dtype, loss_chunk="auto" if args.loss_chunk is None else (args.loss_chunk or None),
                lora=lora, deterministic=bool(getattr(args, "deterministic", False)),
                kernel=getattr(args, "kernel", None))


def check_plan_args(args: argparse.Namespace) -> None:
    """Reject values the planner cannot use, saying what to change (a zero device count
    would otherwise divide by zero, a zero granularity never end its search)."""
    for flag, value, low in (("--devices", args.devices, 1), ("--seq-len", args.seq_len, 1),
                             ("--granularity", args.granularity, 1),
                             ("--ring-degree", args.ring_degree, 1),
                             ("--loss-chunk", args.loss_chunk, 0),
                             ("--lora-rank", args.lora_rank, 1),
                             ("--image-tokens", getattr(args, "image_tokens", None), 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not args.gpu_memory > 0:
        raise ValueError(f"--gpu-memory is in GiB and must be > 0, got {args.gpu_memory}")
    if not 0 < args.usable <= 1:
        raise ValueError(f"--usable is a fraction of the device memory, in (0, 1]; got {args.usable}")
    if args.ring_degree is not None and args.method != "usp_attn":
        raise ValueError("--ring-degree is usp_attn's; add --method usp_attn or drop it")
    if args.lora_rank is None and (args.lora_4bit or args.lora_targets != "all-linear"):
        raise ValueError("--lora-targets and --lora-4bit describe a LoRA run: add --lora-rank R")
    # --auto picks the engine itself (fsdp only for a 4-bit base: plan.auto._bases)
    if args.lora_4bit and args.engine != "fsdp" and not getattr(args, "auto", False):
        raise ValueError("--lora-4bit (QLoRA) runs on the fsdp engine: add --engine fsdp")
    if args.lora_rank:
        from .lora import LoRASpec, parse_targets

        LoRASpec(args.lora_rank, parse_targets(args.lora_targets))  # names it knows
    if getattr(args, "image_tokens", None) is not None and (args.lora_rank or
                                                            getattr(args, "auto", False)):
        raise ValueError("--image-tokens plans full fine-tuning with a fixed setup: drop "
                         "--lora-rank / --auto, or plan without the vision tower")
    if args.output:
        check_output_path("--output", args.output, folder=False)


def _check_method(shape, method: str, n: int, ring_degree: int | None) -> None:
    """A method asked for by name must be able to run on these heads and devices (the
    method's own check, easy_context/parallel)."""
    from ..parallel import get_method

    if method == "usp_attn" and ring_degree is None:
        return  # planned as a pure ring (plan.choose.required_multiple)
    get_method(method).check(shape.heads, shape.kv_heads, n, ring_degree)


def run_plan(args) -> int:
    check_plan_args(args)
    if args.report:
        from .report import claims_markdown, how_far_markdown, lora_how_far_markdown

        text = (claims_markdown() if args.report == "claims"
                else how_far_markdown() + "\n" + lora_how_far_markdown())
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(text)
            print(f"wrote {args.output}")
        else:
            print(text)
        return 0
    shape = load_shape(args.model)
    if args.method != "auto":
        _check_method(shape, args.method, args.devices, args.ring_degree)
    budget = int(args.gpu_memory * GIB * args.usable)
    if getattr(args, "auto", False):
        from .auto import run_auto

        return run_auto(args, shape, budget, lora_spec(args))
    n, kw = args.devices, _kw(args)
    params = shape.num_params()
    if getattr(args, "image_tokens", None) is not None:
        from .vision import load_vision

        kw.update(vision=load_vision(args.model), image_tokens=args.image_tokens)
        params += kw["vision"].num_params()
    method = None if args.method == "auto" else args.method
    result: dict = {"model": shape.name, "params_b": params / 1e9, "devices": n,
                    "budget_gib": budget / GIB}
    lines = [f"{shape.name}: {params / 1e9:.2f}B parameters"
             + (f" ({kw['vision'].num_params() / 1e9:.2f}B in the vision tower)"
                if "vision" in kw else "")
             + f", {shape.layers} layers, "
             f"{shape.heads} heads / {shape.kv_heads} KV heads; {n} x {args.gpu_memory:g} GiB "
             f"(planning with {budget / GIB:.1f} GiB each)", shape.describe_paths()]
    result["maxlen_paths"] = [p for _, p in shape.maxlen_paths()]
    if args.seq_len:
        if method is None:
            choice = choose_method(shape, args.seq_len, n, budget, **kw)
            est, rd = choice.estimate, choice.ring_degree
            lines.append(f"method: {choice.method or 'none fits'} -- {choice.reason}")
            result.update(method=choice.method, ring_degree=rd, reason=choice.reason,
                          rejected=choice.rejected)
        else:
            rd = args.ring_degree if method == "usp_attn" else None
            mult = required_multiple(method, n, rd)
            length = -(-args.seq_len // mult) * mult
            est = estimate_memory(shape, length, n, method, ring_degree=rd, **kw)
            fits = est.total <= budget
            lines.append(f"method: {method} -- {'fits' if fits else 'does NOT fit'}")
            result.update(method=method, fits=fits)
        if est is not None:
            lines.append(est.table())
            result["estimate"] = est.to_dict()
            from .recompute import checkpointing_costs, describe

            ckpt_kw = {k: v for k, v in kw.items() if k != "checkpointing"}
            costs = checkpointing_costs(shape, est.seq_len, n, est.method, budget,
                                        ring_degree=rd, **ckpt_kw)
            lines += describe(costs)
            result["checkpointing_costs"] = [c.to_dict() for c in costs]
    if args.max_seq_len or not args.seq_len:
        rd = args.ring_degree if method == "usp_attn" else None
        longest, m = max_sequence_length(shape, n, budget, method, rd,
                                         granularity=args.granularity, **kw)
        lines.append(f"longest sequence that fits: {longest:,} tokens"
                     + (f" with {m}" if m else " (not even one step fits)"))
        result.update(max_seq_len=longest, max_seq_len_method=m)
    print(json.dumps(result, indent=1) if args.json else "\n".join(lines))
    return 0


def build_args(**kw) -> argparse.Namespace:
    """Defaults of ``easy-context plan`` with some values changed (for scripts and tests)."""
    p = argparse.ArgumentParser()
    add_plan_args(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


__all__ = ["add_plan_args", "run_plan", "build_args", "with_overrides"]
