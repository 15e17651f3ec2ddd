"""A tiny Llama that learns needle retrieval in about a minute, shared by the eval tests.

Byte-level tokenizer with no merges (a character-level vocabulary of 259), 2 layers, width
128, trained with plain AdamW in two phases: the demo's copy curriculum (short period
documents and copy drills, easy_context.demo.build, which grow the induction circuit), then
prompts built by the needle eval itself (other numbers than the eval's). So the test checks
that the eval measures retrieval, not that a big model can retrieve. The folder is built
once per test session under pytest's base temp directory.

The curriculum's strings and the answers are digits with no digit repeated, and the model
has 8 heads of 16 dimensions. With 4 heads of 32 the copy circuit had not formed after
800 steps in 2 of 5 seeds (answer digits right: 10-12%), and the earlier fixture (36
symbols, 4 heads) scored 23% on another CPU against the test's floor of 30%: the outcome
depended on the seed and the CPU. Its margin over seeds, thread counts and
instruction sets: ``python benchmarks/needle_test_margin.py`` (results/needle_test_margin.json;
``python -m tests.unit.eval_fixtures --seeds ...`` is one run of it).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from easy_context.data.synthetic import generate_texts
from easy_context.data.tokenizer import train_bpe_tokenizer
from easy_context.eval.needle import NeedleConfig, NeedleTemplate, build_haystack, build_prompt

# "code=" occurs only in the needle and the question, and the haystack has no digits, so a
# 2-layer induction circuit (find the earlier "=", copy what followed) solves the task.
TEMPLATE = NeedleTemplate(prefix="", needle="The {key} code={value}.",
                          question=" Recall the {key} code=",
                          question_multi_value=" Recall all {key} codes=", answer_prefix="")
DIGITS = 3
CODE_DIGITS = 5  # the copy drills' codes
CONTEXTS = (128, 192)


def eval_config(**kw) -> NeedleConfig:
    base = dict(min_context_length=CONTEXTS[0], max_context_length=CONTEXTS[1],
                context_interval=CONTEXTS[1] - CONTEXTS[0], depth_interval=0.25, num_samples=2,
                rnd_number_digits=DIGITS, template=TEMPLATE, distinct_digits=True)
    return NeedleConfig(**{**base, **kw})


def _llama_config(vocab: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, max_position_embeddings=1024, attention_dropout=0.0,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)


def _batch(seqs: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """Padded input ids, next-token targets, and targets of the answer span only (from each
    sequence's answer start; the whole sequence for start 0)."""
    width = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), width), pad)
    for i, (x, _) in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
    targets = ids[:, 1:].clone()
    targets[targets == pad] = -100
    answer = torch.full_like(targets, -100)
    for i, (x, start) in enumerate(seqs):
        answer[i, max(start - 1, 0):len(x) - 1] = targets[i, max(start - 1, 0):len(x) - 1]
    return ids, targets, answer


def train_needle_model(folder: Path, copy_steps: int = 600, steps: int = 200, seed: int = 0,
                       lr: float = 3e-3) -> Path:
    """Train the tiny model (about a minute on 2 idle cores) and save model + tokenizer to
    ``folder``: ``copy_steps`` steps of 32 copy-curriculum documents of 64 tokens, then
    ``steps`` steps of 8 needle prompts and 8 copy drills."""
    from transformers import LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    t0 = time.time()
    tok = train_bpe_tokenizer(generate_texts(4, 500), vocab_size=259)
    torch.manual_seed(seed)
    # 8 heads of 16 (not 4 of 32): with more heads to grow it in, the copy circuit formed by
    # step 400-600 in seeds where 4 heads left it unformed after 1400 steps
    model = LlamaForCausalLM(_llama_config(len(tok), hidden=128, heads=8, kv_heads=8))
    # Seeds far from the eval's (seed 0, samples 0..n): training never sees the eval numbers.
    cfg = NeedleConfig(CONTEXTS[0], CONTEXTS[1], 1, rnd_number_digits=DIGITS, template=TEMPLATE,
                       seed=10_000, distinct_digits=True)
    hay = build_haystack(tok, CONTEXTS[1] + 64, seed=10_000)
    rng = random.Random(seed)
    symbols = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    filler = tok(" ".join(["The grass is green. The sky is blue."] * 4),
                 add_special_tokens=False)["input_ids"]
    code_eq = tok(" code=", add_special_tokens=False)["input_ids"]

    def curriculum(n: int = 64) -> tuple[list[int], int]:
        """The demo's copy curriculum at token level (easy_context.demo.build): one in five a
        period document (units of 2-4 distinct digits repeated), else copy drills (codes of
        ``CODE_DIGITS`` distinct digits, up to 16 filler tokens, the same code), half of
        them after the needle's "code=" (a circuit grown on bare codes did not copy there)."""
        out = [tok.bos_token_id]
        periodic = rng.random() < 0.2
        while len(out) < n:
            if periodic:
                out += rng.sample(symbols, rng.randint(2, 4)) * rng.randint(3, 8)
            else:
                code = (code_eq if rng.random() < 0.5 else []) + rng.sample(symbols, CODE_DIGITS)
                start = rng.randrange(len(filler) - 16)
                out += code + filler[start:start + rng.randint(0, 16)] + code
        return out[:n], 0

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = copy_steps + steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * (1.0 if i < copy_steps else
                                                  0.5 * (1 + math.cos(math.pi * (i - copy_steps) / steps))))
    model.train()
    for step in range(total):
        if step < copy_steps:
            seqs = [curriculum() for _ in range(32)]
        else:
            length = rng.randrange(CONTEXTS[0], CONTEXTS[1] + 1)
            seqs = [(p.input_ids, p.answer_start) for p in (
                build_prompt(hay, tok, cfg, length, rng.random(), rng.randrange(10 ** 9))
                for _ in range(8))]
            seqs += [curriculum() for _ in range(8)]
        ids, targets, answer = _batch(seqs, tok.pad_token_id)
        logits = model(input_ids=ids[:, :-1]).logits.flatten(0, 1)
        loss = F.cross_entropy(logits, targets.flatten(), ignore_index=-100)
        if step >= copy_steps:
            # Copying counts twice: a second loss over the needle answers and the drills
            # (whose whole sequence is their "answer span", start 0).
            loss = loss + F.cross_entropy(logits, answer.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "train_log.txt").write_text(f"steps {copy_steps} + {steps} loss {loss.item():.4f} "
                                          f"seconds {time.time() - t0:.1f}\n")
    return folder


def char_tokenizer():
    """Byte-level BPE with no merges: one token per ASCII character, BOS/EOS/PAD = 0/1/2."""
    return train_bpe_tokenizer(generate_texts(2, 200), vocab_size=259)


def random_model_dir(folder: Path, seed: int = 0) -> Path:
    """An untrained tiny Llama + character tokenizer saved to ``folder`` (for ppl and loading)."""
    from transformers import LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    tok = char_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(len(tok)))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def trained_model_scores(folder: Path) -> dict:
    """The needle eval of the trained tiny model as the trained test runs it (2 lengths x
    5 depths x 3 samples, teacher-forced): answer-digit accuracy, exact match, chance."""
    from easy_context.models import load_model_and_tokenizer
    from easy_context.eval.needle import evaluate_needle

    model, tk = load_model_and_tokenizer(str(folder))
    results = evaluate_needle(model, tk, build_haystack(tk, 300), eval_config(num_samples=3),
                              "zigzag_ring_attn", progress=False)
    return {"token_accuracy": results["average_token_accuracy"],
            "exact": results["average_score"], "chance_exact": results["chance"]}


def _measure_margin() -> None:
    """``python -m tests.unit.eval_fixtures --seeds 0 1 2 3 4``: train the tiny model per seed
    and print the trained test's figures, one JSON line each. Set ATEN_CPU_CAPABILITY and
    OMP_NUM_THREADS in the environment to see another CPU's kernels and reduction orders."""
    import argparse
    import json
    import os
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--train-into", default=None,
                    help="only train seed 0's model into this folder (the suite's background job)")
    args = ap.parse_args()
    if args.train_into:
        torch.set_num_threads(1)  # one core: the suite goes on with the other
        train_needle_model(Path(args.train_into))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            t0 = time.process_time()
            folder = train_needle_model(Path(tmp) / f"seed{seed}", seed=seed)
            row = {"seed": seed, **trained_model_scores(folder),
                   "cpu_s": round(time.process_time() - t0, 1),
                   "capability": torch.backends.cpu.get_cpu_capability(),
                   "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
                   "threads": torch.get_num_threads()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _measure_margin()
