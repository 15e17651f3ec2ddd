"""Tiny models and datasets on disk, for trainer, recipe and eval tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False)


def tiny_model_dir(folder: Path, family: str = "llama", seed: int = 0,
                   dtype: torch.dtype | None = None, **overrides) -> Path:
    """A randomly initialised model saved with save_pretrained (stored in ``dtype`` if given,
    as hub checkpoints are usually bf16)."""
    config = AutoConfig.for_model(family, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def tiny_hybrid_dir(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny hybrid (tests/dist/hf_recurrent_cases.py HYBRIDS: recurrent and attention layers,
    mild decays) with TINY's vocabulary, saved with save_pretrained."""
    from tests.dist.hf_recurrent_cases import tiny_hybrid

    model = tiny_hybrid(family, seed, vocab_size=TINY["vocab_size"], tie_word_embeddings=False,
                        **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def tiny_model_with_tokenizer(folder: Path, seed: int = 0) -> Path:
    """A small Llama (2 layers, hidden 64, GQA 4/2, RoPE up to 8K positions) saved with a
    512-token byte-level BPE trained on synthetic text and the special tokens' ids in its
    config: a model folder as a user would have one, minutes of CPU for the README's examples."""
    from easy_context.data.synthetic import generate_texts
    from easy_context.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(generate_texts(100, 3000, seed=seed + 11), vocab_size=512)
    tiny_model_dir(folder, seed=seed, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                   head_dim=16, max_position_embeddings=8192, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save_pretrained(str(folder))
    return Path(folder)


def tiny_dataset_dir(folder: Path, seq_length: int, rows: int = 16, vocab: int = 64,
                     packed: bool = False, seed: int = 0) -> Path:
    """``rows`` sequences of seq_length+1 tokens of a learnable pattern (a repeating ramp with
    a per-row offset), optionally packed from several documents (restarting position_ids)."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    window = seq_length + 1
    offsets = torch.randint(0, vocab, (rows, 1), generator=gen)
    ids = (offsets + torch.arange(window)) % vocab
    columns = {"input_ids": ids.tolist()}
    if packed:
        positions = []
        for r in range(rows):
            cuts = sorted(torch.randint(1, window, (2,), generator=gen).tolist())
            pos = torch.cat([torch.arange(b - a) for a, b in zip([0] + cuts, cuts + [window])])
            positions.append(pos.tolist())
        columns["position_ids"] = positions
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return Path(folder)


def kill_and_resume(args: list[str], out: Path, extra_steps: int = 2) -> tuple[list[float], int]:
    """Start ``easy-context train`` (``args``, its output folder ``out``, a checkpoint every
    step) for many steps, SIGKILL it once step 2 is checkpointed, resume it for
    ``extra_steps`` more: (the loss of every step in metrics.jsonl, the total steps)."""
    import json
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(args + ["--max-train-steps", "1000"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() >= "step_0000002"):
        assert proc.poll() is None, "the run ended before its checkpoints"
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    total = int(latest.read_text().strip().removeprefix("step_")) + extra_steps
    subprocess.run(args + ["--max-train-steps", str(total), "--resume"], check=True,
                   capture_output=True, timeout=300)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()], total
