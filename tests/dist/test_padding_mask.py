"""A padding mask given to a sequence-parallel model raises on every rank instead of being
ignored (transformers hands custom attention functions no mask; ours build their own causal
and packed-document masks). An all-ones mask is fine; a prepared 4-D mask is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.train_fixtures import tiny_model_dir

S = 16


def padding_cases(model_dir: str, method: str) -> dict:
    from transformers import AutoModelForCausalLM

    from easy_context.integrations.hf import apply_sequence_parallel
    from easy_context.sequence_parallel import shard_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_sequence_parallel(model, method)
    ids = torch.arange(S).unsqueeze(0) % 64
    batch = {"input_ids": ids, "position_ids": torch.arange(S).unsqueeze(0)}
    local = shard_batch(batch, method, rank, world)
    ones = torch.ones_like(local["input_ids"])

    def outcome(*args, **kwargs) -> str:
        try:
            return torch.equal(model.model(*args, **kwargs).last_hidden_state, plain)
        except ValueError as e:
            return str(e)

    plain = model.model(**local).last_hidden_state
    padded = ones.clone()
    if rank == world - 1:  # only the last rank's shard holds padding
        padded[0, -3:] = 0
    return {
        "ones": outcome(**local, attention_mask=ones),
        "padded": outcome(**local, attention_mask=padded),
        "padded_by_position": outcome(local["input_ids"], padded,
                                      position_ids=local["position_ids"]),
        "four_d": outcome(**local, attention_mask=torch.ones(1, 1, ones.size(1), ones.size(1))),
        "via_the_lm": outcome_lm(model, local, padded),
    }


def outcome_lm(model, local, mask) -> str:
    try:
        model(**local, attention_mask=mask)
        return "no error"
    except ValueError as e:
        return str(e)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("padding") / "model"))


@pytest.mark.parametrize("pool_name, method", [("dist2", "zigzag_ring_attn"),
                                               ("dist2", "ulysses_attn"),
                                               ("dist1", "local")])
def test_padding_mask_raises_on_every_rank(model_dir, pool_name, method, request):
    for r in request.getfixturevalue(pool_name).run(padding_cases, model_dir, method):
        assert r["ones"] is True, r  # an all-ones mask changes nothing
        for case in ("padded", "padded_by_position", "via_the_lm"):
            assert "attention_mask has zeros" in str(r[case]), (case, r)
        assert "no prepared (4-D) attention mask" in str(r["four_d"]), r
