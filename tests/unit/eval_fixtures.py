"""A tiny Llama that learns needle retrieval in seconds, shared by the eval tests.

Byte-level tokenizer with no merges (a character-level vocabulary of 259), 2 layers, width
64, trained with plain AdamW on prompts built by the needle eval itself (other numbers than
the eval's), so the test checks that the eval measures retrieval, not that a big model can
retrieve. The folder is built once per test session under pytest's base temp directory.
"""

from __future__ import annotations

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
CONTEXTS = (128, 192)


def eval_config(**kw) -> NeedleConfig:
    base = dict(min_context_length=CONTEXTS[0], max_context_length=CONTEXTS[1],
                context_interval=CONTEXTS[1] - CONTEXTS[0], depth_interval=0.25, num_samples=2,
                rnd_number_digits=DIGITS, template=TEMPLATE)
    return NeedleConfig(**{**base, **kw})


def _llama_config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=1024, attention_dropout=0.0,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)


def train_needle_model(folder: Path, steps: int = 300, batch: int = 8, seed: int = 0,
                       lr: float = 3e-3) -> Path:
    """Train the tiny model (about 20-40 s on 2 cores) and save model + tokenizer to ``folder``."""
    from transformers import LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    t0 = time.time()
    tok = train_bpe_tokenizer(generate_texts(4, 500), vocab_size=259)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(len(tok)))
    # Seeds far from the eval's (seed 0, samples 0..n): training never sees the eval numbers.
    cfg = NeedleConfig(CONTEXTS[0], CONTEXTS[1], 1, rnd_number_digits=DIGITS, template=TEMPLATE,
                       seed=10_000)
    hay = build_haystack(tok, CONTEXTS[1] + 64, seed=10_000)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    model.train()
    for step in range(steps):
        length = rng.randrange(CONTEXTS[0], CONTEXTS[1] + 1)
        prompts = [build_prompt(hay, tok, cfg, length, rng.random(), rng.randrange(10 ** 9))
                   for _ in range(batch)]
        seqs = [(p.input_ids, p.answer_start) for p in prompts]
        # Copy drills ("=" + string, other text, "=" + the same string) make induction heads
        # form in a few hundred steps; the needle task then only has to point them at "code=".
        for _ in range(batch):
            s = "".join(rng.choice("0123456789abcdefghijklmnopqrstuvwxyz") for _ in range(12))
            gap = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ")
                          for _ in range(rng.randrange(80)))
            ids_ = [tok.bos_token_id] + tok("=" + s + ". " + gap + " =" + s,
                                            add_special_tokens=False)["input_ids"]
            seqs.append((ids_, len(ids_) - len(s)))
        width = max(len(x) for x, _ in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id)
        for i, (x, _) in enumerate(seqs):
            ids[i, :len(x)] = torch.tensor(x)
        targets = ids[:, 1:].clone()
        targets[targets == tok.pad_token_id] = -100
        answer = torch.full_like(targets, -100)
        for i, (x, start) in enumerate(seqs):
            answer[i, start - 1:len(x) - 1] = targets[i, start - 1:len(x) - 1]
        logits = model(input_ids=ids[:, :-1]).logits.flatten(0, 1)
        # All tokens (the repetitive filler rewards induction heads) plus the answer on its own.
        loss = (F.cross_entropy(logits, targets.flatten(), ignore_index=-100)
                + F.cross_entropy(logits, answer.flatten(), ignore_index=-100))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "train_log.txt").write_text(f"steps {steps} loss {loss.item():.4f} "
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
