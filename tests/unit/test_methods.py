"""Each method's description: names, layouts, rules and costs, asked in one place."""

import pytest

import easy_context as ec
from easy_context import layouts
from easy_context.parallel import ALIASES, SEQUENCE_PARALLEL, AttentionDims, get_method

DIMS = AttentionDims(heads=32, kv_heads=8, head_dim=128)


@pytest.mark.parametrize("name", sorted(ec.METHODS))
def test_description_is_complete_and_consistent(name):
    m = ec.METHODS[name]
    assert m.name == name and callable(m.attention) and m.layout in layouts.LAYOUTS
    assert m.summary and m.use_when and m.short
    for world in (1, 2, 4, 8):
        rd = 2 if m.needs_ring_degree and world > 2 else (world if m.needs_ring_degree else None)
        want = 1 if world == 1 else layouts.required_multiple(m.layout, world, rd)
        assert m.required_multiple(world, rd) == want
        for cost in (m.buffers, m.comm_bytes):
            value = cost(DIMS, 4096, 2, world, rd)
            assert isinstance(value, int) and value >= 0
        assert m.saved_per_token(DIMS, 2, world, rd) > 0


def test_local_moves_nothing_and_the_others_do():
    assert ec.METHODS["local"].comm_bytes(DIMS, 4096, 2, 8, None) == 0
    for name in SEQUENCE_PARALLEL:
        m = ec.METHODS[name]
        rd = 2 if m.needs_ring_degree else None
        assert m.comm_bytes(DIMS, 4096, 2, 8, rd) > 0, name
        # more ranks: more ring steps or smaller all-to-all shares, never free
        assert m.comm_bytes(DIMS, 4096, 2, 2, 1 if rd else None) > 0, name


def test_the_planner_order_is_the_speed_rank():
    ranks = [ec.METHODS[n].speed_rank for n in SEQUENCE_PARALLEL]
    assert ranks == sorted(ranks) and "local" not in SEQUENCE_PARALLEL


@pytest.mark.parametrize("alias,name", [("data_parallel", "local"), ("dist_flash", "dist_flash_attn"),
                                        ("zigzag", "zigzag_ring_attn"), ("usp", "usp_attn")])
def test_aliases(alias, name):
    assert get_method(alias).name == name and ALIASES[alias] == name


def test_unknown_method_lists_the_choices():
    with pytest.raises(ValueError, match="unknown sequence-parallel method 'ringg'.*zigzag_ring_attn"):
        get_method("ringg")


@pytest.mark.parametrize("name,heads,kv,world,rd,message", [
    ("ulysses_attn", 12, 4, 8, None, "12 query heads cannot be split over 8 ranks"),
    ("ulysses_attn", 12, 3, 4, None, "3 key/value heads"),
    ("usp_attn", 8, 8, 4, None, "needs ring_degree"),
    ("usp_attn", 8, 8, 4, 3, r"ring_degree=3 does not divide the 4 ranks; pick one of \[1, 2, 4\]"),
    ("usp_attn", 6, 6, 8, 2, "ulysses_degree = 8 // ring_degree 2 = 4"),
    ("zigzag_ring_attn", 8, 8, 4, 2, "ring_degree applies to usp_attn only"),
    ("ring_attn", 8, 3, 2, None, "multiple of key/value heads"),
])
def test_check_says_what_to_change(name, heads, kv, world, rd, message):
    with pytest.raises(ValueError, match=message):
        get_method(name).check(heads, kv, world, rd)


def test_check_passes_what_runs():
    get_method("ulysses_attn").check(32, 8, 8)
    get_method("ulysses_attn").check(32, 2, 8)  # KV heads replicated 4 times
    get_method("usp_attn").check(8, 8, 16, 2)
    get_method("zigzag_ring_attn").check(7, 1, 5)


def test_usp_ring_degrees_best_first():
    usp = ec.METHODS["usp_attn"]
    assert usp.ring_degrees(32, 8, 64) == [2, 4, 8, 16, 32]  # Ulysses 32 first
    assert usp.ring_degrees(6, 6, 4) == [2]
    assert usp.unsuitable(5, 5, 4) is not None


def test_hf_names_avoid_the_word_flash():
    assert ec.hf_attention_name("dist_flash_attn") == "dist_attn"
    assert ec.hf_attention_name("dist_flash") == "dist_attn"
    assert ec.hf_attention_name("zigzag_ring_attn") == "zigzag_ring_attn"
