"""Bad inputs give a ValueError that says what to change, on every rank, and never a hang.

Each rank function catches the error and returns its message (an exception raised on a rank
would fail the pool call): the test then checks every rank failed the same, helpful, way.
Every check fails before any collective, since all ranks see the same shapes.
"""

import pytest
import torch
import torch.distributed as dist

import easy_context as ec


def _message(method, hq, hkv, local_len, ring_degree=None, d=16):
    q = torch.randn(1, local_len, hq, d)
    k, v = torch.randn(1, local_len, hkv, d), torch.randn(1, local_len, hkv, d)
    try:
        ec.sequence_parallel_attention(q, k, v, method=method, ring_degree=ring_degree)
    except ValueError as e:
        return str(e)
    return None


def ulysses_heads_not_divisible():
    world = dist.get_world_size()
    return _message("ulysses_attn", hq=world + 1, hkv=1, local_len=4)


def ulysses_kv_heads_incompatible():
    # 3 KV heads: neither divisible by 2 or 4 ranks nor dividing them
    return _message("ulysses_attn", hq=3 * dist.get_world_size(), hkv=3, local_len=4)


def usp_bad_ring_degree():
    return _message("usp_attn", hq=8, hkv=8, local_len=4, ring_degree=3)


def usp_no_ring_degree():
    return _message("usp_attn", hq=8, hkv=8, local_len=4, ring_degree=None)


def odd_local_length(method):
    return _message(method, hq=4, hkv=2, local_len=3)


def _assert_all(messages, *needles):
    assert len(set(messages)) == 1, messages  # every rank fails, the same way
    msg = messages[0]
    assert msg is not None, "no ValueError was raised"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request, dist2, dist4):
    return dist2 if request.param == 2 else dist4


def test_ulysses_heads_not_divisible(pool):
    world = pool.world_size
    _assert_all(pool.run(ulysses_heads_not_divisible), f"{world + 1} query heads",
                f"{world} ranks", "usp_attn", "ring_degree")


def test_ulysses_kv_heads_incompatible(pool):
    _assert_all(pool.run(ulysses_kv_heads_incompatible), "3 key/value heads", "replicated")


def test_usp_ring_degree_not_dividing(pool):
    divisors = [1, 2] if pool.world_size == 2 else [1, 2, 4]
    _assert_all(pool.run(usp_bad_ring_degree), "ring_degree=3", str(divisors))


def test_usp_without_ring_degree(pool):
    _assert_all(pool.run(usp_no_ring_degree), "needs ring_degree")


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "allgather_attn"])
def test_odd_local_length(pool, method):
    _assert_all(pool.run(odd_local_length, method), "length 3 is odd", "zigzag")


def test_pool_still_works_after_errors(pool):
    # the errors left no rank inside a collective: a real call still completes
    assert pool.run(dist.get_world_size) == [pool.world_size] * pool.world_size


@pytest.mark.parametrize("method,multiple", [("ulysses_attn", 4), ("zigzag_ring_attn", 8),
                                             ("allgather_attn", 8)])
def test_shard_sequence_length_not_divisible(method, multiple):
    x = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError) as err:
        ec.shard_sequence(x, method, rank=0, world_size=4)
    assert f"not divisible by {multiple}" in str(err.value)
    assert f"pad it to {-(-10 // multiple) * multiple}" in str(err.value)


def test_shard_sequence_usp_length_not_divisible():
    # 4 ranks, ring_degree 2: 2*2 zigzag chunks, each ring shard split in 2 -> a multiple of 4
    with pytest.raises(ValueError, match="not divisible by 4"):
        ec.shard_sequence(torch.randn(1, 10, 2, 4), "usp_attn", 0, 4, ring_degree=2)
    with pytest.raises(ValueError, match="needs ring_degree"):
        ec.shard_sequence(torch.randn(1, 8, 2, 4), "usp_attn", 0, 4)


def rescaling_rope_refused(rope_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    scaling = {"rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":
        scaling.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4,
                       original_max_position_embeddings=64)
    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128,
                                  rope_scaling=scaling)
    model = AutoModelForCausalLM.from_config(config)
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")  # training: exact (whole_sequence)
    try:
        ec.generate(model, torch.randint(0, 50, (1, 8)), method="zigzag_ring_attn",
                    max_new_tokens=2)
    except ValueError as e:
        return str(e)
    return None


def rescaling_rope_switched_by_name():
    """A dynamic-RoPE model loaded with a sequence-parallel attn_implementation but never
    passed to apply_sequence_parallel (so no whole-sequence hooks): its forward refuses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=8,
                                  rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="zigzag_ring_attn")
    rank = dist.get_rank()
    try:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long),
              position_ids=torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]]) + 4 * rank)
    except ValueError as e:
        return str(e)
    return None


def test_rescaling_rope_switched_by_name_only_is_refused(dist2):
    _assert_all(dist2.run(rescaling_rope_switched_by_name), "dynamic RoPE scaling",
                "apply_sequence_parallel")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_generation_refuses_rope_scaling_that_rescales_per_forward(dist2, rope_type):
    """transformers rescales dynamic and longrope RoPE from the largest position in one
    forward; training takes it from the whole sequence (tests/dist/test_whole_sequence.py),
    generation on several ranks refuses: its cache keeps keys rotated at earlier lengths."""
    _assert_all(dist2.run(rescaling_rope_refused, rope_type), f"{rope_type} RoPE scaling",
                "generate on one rank")
