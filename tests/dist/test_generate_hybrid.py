"""easy_context.generate on hybrid models (recurrent or convolution layers beside attention):
token for token what transformers' greedy generate gives in one process, every method, at 1,
2 and 4 gloo ranks, for a gated DeltaNet + conv (Qwen3-Next), a Mamba-2 (Granite 4 hybrid)
and a gated short convolution (LFM2) model (and at 2 and 4 for Kimi Linear's KDA and Jamba's
Mamba-1), with left-padded prompts (lengths 13, 5 and 2:
zigzag chunks and prompts shorter than the conv kernel of 4, ends that fall mid-shard, pads
after each prompt that the state must pass unchanged). Each step's logits are within
LOGITS_TOL (relative, fp32) of transformers' too.

The prompt's recurrent state comes from the sequence-parallel prefill (the scan's final state,
the conv's last inputs gathered across ranks), then every rank decodes with the layers' own
single-step paths on it: a zero or wrong state changes the logits far beyond LOGITS_TOL
(checked by zeroing the kept state: every family here fails)."""

from __future__ import annotations

import pytest

import easy_context as ec

from .generate_cases import compare_hybrid
from .test_generate import _assert_equal

METHODS = sorted(ec.METHODS)
CORE = ["qwen3_next", "granite_hybrid", "lfm2"]
# the other routed families: the same three mechanisms under other layers
OTHERS = ["qwen3_5", "qwen3_5_moe", "olmo_hybrid", "bamba", "falcon_h1", "zamba2",
          "nemotron_h", "lfm2_moe", "lfm3"]
# Kimi Linear's KDA (the delta rule with a per-channel gate; q, k, v through one conv) and
# Jamba's Mamba-1 (the selective scan, its caller passing the mixer none of its kwargs)
LATER = ["kimi_linear", "jamba"]


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_one_rank(dist1, family):
    _assert_equal(dist1.run(compare_hybrid, family, METHODS, (13, 5, 2)))


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_hybrid, family, METHODS, (13, 5, 2), 2))


@pytest.mark.parametrize("family", CORE)
def test_hybrid_every_method_four_ranks(dist4, family):
    _assert_equal(dist4.run(compare_hybrid, family, METHODS, (13, 5, 2), 2))


@pytest.mark.parametrize("family", OTHERS)
def test_other_hybrid_families_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_hybrid, family, ["zigzag_ring_attn", "ulysses_attn"],
                            (11, 3)))


@pytest.mark.parametrize("family", LATER)
def test_kda_and_mamba1_every_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_hybrid, family, METHODS, (13, 5, 2), 2))


@pytest.mark.parametrize("family", LATER)
def test_kda_and_mamba1_four_ranks(dist4, family):
    _assert_equal(dist4.run(compare_hybrid, family, ["zigzag_ring_attn", "usp_attn"],
                            (13, 5, 2), 2))


@pytest.mark.slow
def test_command_line_on_two_ranks_hybrid(tmp_path):
    """``easy-context generate`` on 2 spawned ranks with a tiny Qwen3-Next (gated DeltaNet +
    conv beside attention) and a BPE tokenizer, two prompts of different lengths: the
    completions transformers' greedy generate gives in this process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from easy_context.data.synthetic import generate_texts
    from easy_context.data.tokenizer import train_bpe_tokenizer

    from .hf_cases import COMMON
    from .hf_recurrent_cases import QWEN3_NEXT

    tok = train_bpe_tokenizer(generate_texts(40, 2000, seed=3), vocab_size=300)
    config = AutoConfig.for_model("qwen3_next", **{**COMMON, **QWEN3_NEXT,
                                                    "vocab_size": len(tok),
                                                    "eos_token_id": tok.eos_token_id,
                                                    "pad_token_id": tok.pad_token_id})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(str(tmp_path / "model"))
    prompts = ["The grass is green. The sky is blue. The sea is", "A red"]
    out = tmp_path / "out.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "easy_context.cli", "generate", "--model",
         str(tmp_path / "model"), "--prompt", prompts[0], "--prompt", prompts[1],
         "--max-new-tokens", "8", "--nproc-per-node", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tmp_path / "model", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    batch = tok(prompts, return_tensors="pt", padding=True)
    want = model.generate(**batch, max_new_tokens=8, do_sample=False,
                          pad_token_id=tok.pad_token_id)[:, batch["input_ids"].size(1):]
    for row, ids in zip(rows, want.tolist()):
        eos = model.generation_config.eos_token_id
        ids = ids[:ids.index(eos) + 1] if eos in ids else ids
        assert row["ranks"] == 2 and row["new_tokens"] == len(ids)
        assert row["completion"] == tok.decode(ids, skip_special_tokens=True)
