"""``easy-context generate``: one prompt (or a file of them) through easy_context.generate,

    easy-context generate --model DIR --prompt "..." --nproc-per-node 2 --max-new-tokens 64
    easy-context generate --model DIR --prompt-file long.txt --stop "\\n\\n" --do-sample

in one process, under torchrun, or on ``--nproc-per-node`` ranks spawned here
(easy_context.launch); every rank loads the model and keeps its shard of the KV cache.
Rank 0 prints each completion (or writes them as JSON lines with ``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from ..launch import device as rank_device
from ..launch import launch
from ..parallel import SEQUENCE_PARALLEL, get_method


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (save_pretrained)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append",
                        help="prompt text; repeat for a batch (left-padded, exact)")
    source.add_argument("--prompt-file", action="append",
                        help="a text file whose whole content is one prompt; repeat for a batch")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user turn in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    # sampling flags left out come from the model's generation_config.json, then from
    # transformers' defaults (as transformers' generate takes them)
    parser.add_argument("--do-sample", action="store_true", default=None,
                        help="sample instead of greedy (default: the model's generation config)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--min-new-tokens", type=int, default=None,
                        help="no EOS before this many new tokens")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed: the same tokens on any number of ranks "
                             "(default: a fresh one each run)")
    parser.add_argument("--stop", action="append", default=None,
                        help="stop a completion after this string; repeat for several")
    parser.add_argument("--output", default=None,
                        help="write completions as JSON lines here instead of printing them")
    add_model_run_flags(parser)


def add_model_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every command that loads a model folder and runs it on N ranks shares
    (generate here; eval-needle, eval-ppl and eval-ruler mount them too)."""
    parser.add_argument("--parallel-mode", default="zigzag_ring_attn",
                        help="sequence-parallel method: " + ", ".join(SEQUENCE_PARALLEL)
                             + " (the original's names work too); data_parallel: one process")
    parser.add_argument("--ring-degree", type=int, default=None, help="usp_attn only")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks to spawn (ignored under torchrun, which sets them)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--rope-theta", type=float, default=None,
                        help="override the RoPE base (config.rope_parameters['rope_theta'])")
    parser.add_argument("--rope-scaling", default=None,
                        help="override RoPE scaling: JSON ('{\"rope_type\": \"yarn\", "
                             "\"factor\": 4}') or TYPE:FACTOR ('linear:4')")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (off by default)")


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    texts = []
    for name in args.prompt_file:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {name} does not exist")
        texts.append(path.read_text(encoding="utf-8"))
    return texts


def _check(args: argparse.Namespace) -> None:
    from ..models import check_model_path, has_tokenizer, model_heads, parse_rope_scaling
    from .sampling import SamplingConfig

    method = get_method(args.parallel_mode)
    args.method = method.name
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.method == "local" and args.nproc_per_node > 1:
        raise ValueError("--parallel-mode data_parallel generates in one process; use a "
                         "sequence-parallel method with --nproc-per-node > 1")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingConfig(bool(args.do_sample), 1.0 if args.temperature is None else args.temperature,
                   args.top_k, 1.0 if args.top_p is None else args.top_p, 0, args.min_p)
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.min_new_tokens is not None and args.min_new_tokens < 0:
        raise ValueError(f"--min-new-tokens must be >= 0, got {args.min_new_tokens}")
    parse_rope_scaling(args.rope_scaling)
    if any(not s for s in args.stop or []):
        raise ValueError("--stop must not be empty")
    method.check(None, None, args.nproc_per_node, args.ring_degree)
    check_model_path(args.model, weights=True)
    if has_tokenizer(args.model) is False:
        raise FileNotFoundError(f"model folder {args.model} has no tokenizer (tokenizer.json): "
                                "save the model's tokenizer there (tokenizer.save_pretrained)")
    method.check(*model_heads(args.model), args.nproc_per_node, args.ring_degree)
    prompts = _prompts(args)
    if any(not p for p in prompts):
        raise ValueError("a prompt is empty")
    # the prompts' lengths against the model's RoPE range, before any rank loads the weights
    from transformers import AutoTokenizer

    from ..models import check_model_path as local_path, load_config
    from ..utils.decoder import text_config
    from .generate import check_rope_range

    config = load_config(local_path(args.model), args.rope_theta, args.rope_scaling,
                         args.trust_remote_code)
    tok = AutoTokenizer.from_pretrained(local_path(args.model),
                                        trust_remote_code=args.trust_remote_code)
    tok.model_max_length = 1 << 40
    ids, _ = encode(tok, prompts, args.chat)
    check_rope_range(text_config(config), ids.size(1) + args.max_new_tokens)


def encode(tokenizer, prompts: list[str], chat: bool):
    """(input_ids, attention_mask), left-padded: what easy_context.generate takes."""
    import torch

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat: the tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template'); drop --chat for a plain prompt")
        rows = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True, tokenize=True)
                for p in prompts]
        rows = [r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r for r in rows]
    else:
        rows = [tokenizer(p)["input_ids"] for p in prompts]
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, longest - len(r):] = 1
    return ids, mask


def _generate_rank(args: argparse.Namespace) -> list[dict]:
    from ..integrations.hf import apply_sequence_parallel
    from ..mesh import build_mesh
    from ..models import load_model_and_tokenizer
    from .generate import generate

    dev = rank_device()
    model, tok = load_model_and_tokenizer(args.model, device=dev, dtype=args.dtype,
                                          rope_theta=args.rope_theta,
                                          rope_scaling=args.rope_scaling,
                                          trust_remote_code=args.trust_remote_code)
    tok.model_max_length = 1 << 40  # long prompts are the point
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = build_mesh(world, args.ring_degree, dev.type).sp
    apply_sequence_parallel(model, args.method, group=group, ring_degree=args.ring_degree)
    ids, mask = encode(tok, _prompts(args), args.chat)
    result = generate(model, ids.to(dev), attention_mask=mask.to(dev),
                      max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      seed=args.seed, min_p=args.min_p,
                      repetition_penalty=args.repetition_penalty,
                      min_new_tokens=args.min_new_tokens, stop_strings=args.stop, tokenizer=tok,
                      pad_token_id=tok.pad_token_id, return_stats=True)
    rows = []
    for i in range(ids.size(0)):
        new = result.sequences[i, ids.size(1):ids.size(1) + result.lengths[i]].tolist()
        rows.append({"prompt_tokens": int(mask[i].sum()), "new_tokens": len(new),
                     "completion": tok.decode(new, skip_special_tokens=True),
                     "prefill_s": round(result.prefill_seconds, 3),
                     "decode_s": round(result.decode_seconds, 3), "ranks": world})
    return rows


def run_generate(args: argparse.Namespace) -> int:
    _check(args)
    if args.output:
        from ..utils.paths import check_output_path

        check_output_path("--output", Path(args.output), folder=False)
    rows = launch(_generate_rank, args.nproc_per_node, args)
    # under torchrun the group is gone once launch returns; RANK still says who we are
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} completions to {args.output}")
        return 0
    for row in rows:
        print(row["completion"])
    return 0
