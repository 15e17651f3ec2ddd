"""What transformers derives from the length of one forward, taken from the whole sequence
under sequence parallelism (easy_context.integrations.whole_sequence): dynamic and LongRoPE
scaling (Phi-3.5 / Phi-4 long-context configs), Llama 4's attn_temperature_tuning. Against
one process on the whole sequence, fp32: loss within 1e-5 relative and every parameter's
gradient (summed over ranks) within 1e-5 of its max |grad|."""

import pytest

from .whole_sequence_cases import (DYNAMIC, LLAMA4_TUNED, LONGROPE, check_whole_sequence,
                                   generate_tuned)

TOL = 1e-5
METHODS = ["zigzag_ring_attn", "ulysses_attn"]


def _assert(reports, rescaled: bool | None):
    bad = [f"rank {r} {m}: loss {le:.1e}, grads {ge:.1e}" for r, rep in enumerate(reports)
           for m, (le, ge, _) in rep.items() if not (le <= TOL and ge <= TOL)]
    assert not bad, "\n".join(bad)
    if rescaled is not None:  # the test's length is on the side of the threshold it means
        assert all(s == rescaled for rep in reports for (_, _, s) in rep.values())


@pytest.mark.parametrize("name,model_type,overrides,length,rescaled", [
    ("longrope long", "phi3", LONGROPE, 40, True),  # 40 > 24: long factors
    ("longrope short", "phi3", LONGROPE, 16, False),
    ("dynamic", "llama", DYNAMIC, 40, True)])
def test_rescaling_rope_2_ranks(dist2, name, model_type, overrides, length, rescaled):
    """A contiguous first rank sees positions < 24 of 40 (short factors, no NTK rescaling), a
    zigzag rank others: each would rotate with its own frequencies."""
    _assert(dist2.run(check_whole_sequence, model_type, overrides, length, METHODS), rescaled)


def test_longrope_4_ranks(dist4):
    _assert(dist4.run(check_whole_sequence, "phi3", LONGROPE, 48, METHODS + ["usp_attn"]), True)


@pytest.mark.parametrize("world", [2, 4])
def test_llama4_attn_temperature_tuning(dist2, dist4, world):
    pool = dist2 if world == 2 else dist4
    _assert(pool.run(check_whole_sequence, "llama4_text", LLAMA4_TUNED, 2 * world * 6, METHODS,
                     "eager"), None)


def test_llama4_attn_temperature_tuning_generates_as_transformers(dist2):
    """Prefill on shards, then decoding (each new token's scale from its position): the
    tokens of transformers' greedy generate in one process."""
    reports = dist2.run(generate_tuned, ["zigzag_ring_attn", "ulysses_attn", "ring_attn"], 13)
    bad = [f"rank {r} {m}: want {w} got {g}" for r, rep in enumerate(reports)
           for m, (w, g) in rep.items() if w != g]
    assert not bad, "\n".join(bad)
