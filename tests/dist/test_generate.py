"""easy_context.generate: token for token what transformers' greedy generate gives in one
process, for every method at 1, 2 and 4 gloo ranks, on tiny models of each family (sliding
windows, soft-capping, sinks, chunks, MLA included), with left-padded prompts whose lengths
do not divide the ranks, and 23 new tokens (they go to the ranks in turn, so every rank's
cache grows). fp32; a random tiny model's top two logits are rarely within rounding of each
other, and the comparison is exact (the same ids)."""

from __future__ import annotations

import pytest

import easy_context as ec

from .generate_cases import (NEW_TOKENS, cache_shares, compare_adapted, compare_methods,
                             data_parallel_groups_fsdp, fresh_seeds, mismatched_flags,
                             mismatched_prompts, sampled, stops)
from .hf_cases import FAMILIES, VARIANT_FAMILIES

METHODS = sorted(ec.METHODS)


def _assert_equal(reports):
    bad = [f"rank {r} {method}:\n  want {want}\n  got  {got}"
           for r, rep in enumerate(reports) for method, (want, got) in rep.items() if want != got]
    assert not bad, "\n".join(bad)


def test_every_method_one_rank(dist1):
    _assert_equal(dist1.run(compare_methods, "llama", METHODS, (13, 9)))


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(VARIANT_FAMILIES))
def test_every_family_and_method_two_ranks(dist2, family):
    _assert_equal(dist2.run(compare_methods, family, METHODS, (13, 9), 2))


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "deepseek_v3"])
def test_every_method_four_ranks(dist4, family):
    """Plain attention, sinks with windows, and MLA at 4 ranks (soft-capping and chunks: at 2
    ranks above; the masks come from positions, whatever the rank count)."""
    _assert_equal(dist4.run(compare_methods, family, METHODS, (13, 7, 10), 2))


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_share_of_the_cache(dist1, dist2, dist4, world):
    """At 64 prompt tokens and 24 new ones, a rank's cache holds 64/N + 24/N slots (the
    buffers are sized for exactly that), against one process's 64 + 24; the tokens agree."""
    one = dist1.run(cache_shares, "zigzag_ring_attn", 64, 24)[0]
    many = (dist2 if world == 2 else dist4).run(cache_shares, "zigzag_ring_attn", 64, 24)
    for rank in many:
        assert rank["tokens"] == one["tokens"]
        assert rank["bytes"] * world == one["bytes"], (rank["bytes"], one["bytes"])


def test_sampling_is_the_same_on_any_number_of_ranks(dist1, dist2, dist4):
    """The same seed gives the same tokens at 1, 2 and 4 ranks; another seed other tokens;
    top_p small enough to keep only the top token is greedy."""
    kw = dict(temperature=0.8, top_p=0.95, top_k=40)
    one = dist1.run(sampled, "zigzag_ring_attn", 3, (13, 9), **kw)[0]
    for pool, method in ((dist2, "ring_attn"), (dist4, "ulysses_attn")):
        assert all(r == one for r in pool.run(sampled, method, 3, (13, 9), **kw))
    assert dist1.run(sampled, "zigzag_ring_attn", 4, (13, 9), **kw)[0] != one
    greedy = dist2.run(compare_methods, "llama", ["zigzag_ring_attn"], (13, 9))[0]
    top = dist2.run(sampled, "zigzag_ring_attn", 3, (13, 9), top_p=1e-6)[0]
    assert top == greedy["zigzag_ring_attn"][1]


def test_eos_ends_a_row_and_pads_it(dist2):
    for rep in dist2.run(stops, "zigzag_ring_attn"):
        free, ended, eos = rep["free"], rep["ended"], rep["eos"]
        first = free[0].index(eos)  # row 0 stops at its first EOS, which it keeps
        assert ended[0][:first + 1] == free[0][:first + 1]
        assert ended[0][first + 1:] == [1] * (len(ended[0]) - first - 1)
        if eos in free[1]:
            second = free[1].index(eos)
            assert ended[1][:second + 1] == free[1][:second + 1]
        else:  # row 1 never meets it: the whole generation is there
            assert ended[1] == free[1] and len(ended[1]) == NEW_TOKENS


def test_command_line_on_two_ranks_equals_transformers(tmp_path, trained_needle_model):
    """``easy-context generate`` with two prompts of different lengths on 2 spawned ranks:
    the completions transformers' greedy generate gives in this process, stopped after the
    stop string, which is kept. The model is the trained needle fixture, which copies the
    code its prompt's needle holds (far back, on the other rank's shard), so its completions
    depend on the context: an attention or cache bug changes them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = trained_needle_model
    filler = " The grass is green. The sky is blue." * 3
    prompts = [f"The red code=472.{filler}{filler} Recall the red code=",
               f"The blue code=815.{filler} Recall the blue code="]
    out = tmp_path / "out.jsonl"
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "easy_context.cli", "generate", "--model", str(folder),
         "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "12",
         "--nproc-per-node", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    batch = tok(prompts, return_tensors="pt", padding=True)
    want = model.generate(**batch, max_new_tokens=12, do_sample=False,
                          pad_token_id=tok.pad_token_id)[:, batch["input_ids"].size(1):]
    for row, ids in zip(rows, want.tolist()):
        eos = model.generation_config.eos_token_id
        ids = ids[:ids.index(eos) + 1] if eos in ids else ids
        assert row["completion"] == tok.decode(ids, skip_special_tokens=True)
        assert row["ranks"] == 2 and row["new_tokens"] == len(ids)
    assert rows[0]["prompt_tokens"] == len(tok(prompts[0])["input_ids"])
    # the completions depend on the context: another code in the needle, another answer
    other = tok([prompts[0].replace("472", "906")], return_tensors="pt")
    moved = model.generate(**other, max_new_tokens=12, do_sample=False,
                           pad_token_id=tok.pad_token_id)[0, other["input_ids"].size(1):]
    assert tok.decode(moved, skip_special_tokens=True) != rows[0]["completion"]
    # a stop string: the first completion cut after its first occurrence, which stays
    text = rows[0]["completion"]
    assert len(text) >= 6, text
    stop = text[3:5]
    run = subprocess.run(
        [sys.executable, "-m", "easy_context.cli", "generate", "--model", str(folder),
         "--prompt", prompts[0], "--max-new-tokens", "12", "--stop", stop],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 0, run.stderr
    assert run.stdout == text[:text.index(stop) + len(stop)] + "\n"


@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "lora-nf4-base"])
def test_lora_adapters_and_a_4bit_base(dist2, four_bit):
    """A peft PeftModel (adapters on every linear layer), on a full-precision or an NF4 base
    (bitsandbytes, as --lora-4bit quantizes it): what transformers' generate gives with the
    same model in one process."""
    pytest.importorskip("peft")
    if four_bit:
        pytest.importorskip("bitsandbytes")
    _assert_equal(dist2.run(compare_adapted, four_bit, ["zigzag_ring_attn", "ulysses_attn"]))


def test_data_parallel_groups_on_an_fsdp2_model_stop_at_different_steps(dist4):
    """2 data-parallel groups x 2 sequence-parallel ranks on a model FSDP2 shards over all 4
    (as the Trainer and accelerate shard it): group 0's row stops (EOS) at its third token,
    group 1's runs all 10. The parameter all-gathers pair up across the groups only if the
    finished group keeps running forwards (transformers' synced_gpus); without that the
    second group waits forever. Each group's tokens: transformers' greedy generate's."""
    reports = dist4.run(data_parallel_groups_fsdp, 2)
    assert [r["group"] for r in reports] == [0, 0, 1, 1]
    for r in reports:
        assert r["got"] == r["want"], r
    assert len(reports[0]["got"]) == 3 and reports[0]["got"][-1] == reports[0]["eos"]
    assert len(reports[2]["got"]) == 10


@pytest.mark.parametrize("case", ["prompts", "flags"])
def test_ranks_given_different_prompts_or_flags_are_refused_before_prefill(dist2, case):
    """One rank with another prompt token (or another max_new_tokens): every rank raises the
    same ValueError, before the prefill, instead of generating from mixed shards."""
    errors = dist2.run(mismatched_prompts if case == "prompts" else mismatched_flags)
    assert errors[0] == errors[1] and "different prompts or generation settings" in errors[0]
    assert "group ranks [1]" in errors[0]


def test_no_seed_draws_a_fresh_one_per_call_shared_by_the_group(dist2):
    first, second = dist2.run(fresh_seeds, "zigzag_ring_attn")
    assert first == second  # both ranks: the same tokens (group rank 0's seed)
    assert first[0] != first[1]  # two calls, two seeds


def test_a_zero3_training_step_after_generate(dist2):
    """generate on a DeepSpeed ZeRO-3 model, each rank its own prompt (rank 0's stops at its
    third token, rank 1's runs 6: the done rank keeps running forwards for the other's
    parameter all-gathers), then a training step on it: no parameter holds
    an inference tensor afterwards (with torch.inference_mode around generate, 21 of the 21
    did: the placeholders ZeRO-3 leaves when it frees a gathered parameter), the step runs
    and lowers the loss; the tokens are transformers' greedy ones."""
    pytest.importorskip("deepspeed")
    from .generate_cases import zero3_step_after_generate

    reports = dist2.run(zero3_step_after_generate)
    assert [len(r["got"]) for r in reports] == [3, 6], reports
    for r in reports:
        assert r["got"] == r["want"], r
        assert r["inference"] == 0, r
        assert r["after"] < r["before"], r


def test_a_model_whose_head_an_outer_fsdp_unit_shards_is_refused(dist1):
    from .generate_cases import sharded_by_an_outer_unit

    (error,) = dist1.run(sharded_by_an_outer_unit)
    assert "sharded (FSDP2) by a unit outside the model" in error, error
