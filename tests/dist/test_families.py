"""A sample of benchmarks/families.py's sweep in CI: each family's classification at 2 ranks
(zigzag and Ulysses, fp32, 1e-5 relative against one process), and refusals that are
ValueErrors with a reason rather than raw errors.

The whole sweep (every registered causal-LM family): ``python benchmarks/families.py``;
its table: docs/guides/families.md.
"""

import pytest

from benchmarks.families import check_family

from .hf_cases import nan_gradient_error, refusal_at_two_ranks

TOL = 1e-5
# family -> (sequence-parallel status, a phrase of the reason, generation status)
# (no Llama: its exactness is test_hf_models.py's, every method at 2 and 4 ranks; the exact
# classification here: HyperCLOVA X and ModernBERT-decoder)
SAMPLE = {
    "bart": ("refused", "takes no position_ids", "refused"),
    # PhiMoE samples its experts in training: refused there; eval-mode generation is exact
    "phimoe": ("refused", "samples its experts at random in training", "exact"),
    "rwkv": ("refused", "found no attention layers", "refused"),
    "hyperclovax": ("exact", None, "exact"),          # logits_scaling 2.5: a multiplier
    # its head is dense + norm + projection: the chunked loss and generate refuse that head
    "modernbert-decoder": ("exact", None, "refused"),
}


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_family_classification(dist2, family):
    status, phrase, generation = SAMPLE[family]
    rows = dist2.run(check_family, family)
    for rank, row in enumerate(rows):
        assert row["status"] == status, (rank, row)
        if phrase:
            assert phrase in row["reason"], (rank, row)
        for mode in ("maxlen", "generate"):
            if mode in row:
                assert row[mode]["status"] not in ("DIFFERS", "error"), (rank, mode, row[mode])
        if status == "exact":
            for case, r in row["sp"].items():
                assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (rank, case, r)
        if status == "exact" or family == "phimoe":
            assert row["generate"]["status"] == generation, (rank, row["generate"])


def test_recurrent_model_refused_not_raw_error(dist2):
    """RWKV (config defaults: no num_attention_heads) at 2 ranks: a refusal, not the
    AttributeError of reading a head count it does not have."""
    for said in dist2.run(refusal_at_two_ranks, "rwkv",
                          dict(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                               attention_hidden_size=32, intermediate_size=64)):
        assert said.startswith("ValueError: found no attention layers"), said


def test_nan_gradient_is_not_within_tolerance(dist2):
    """The family tests' gradient comparison keeps a NaN (a Python max over it would drop it)."""
    for err in dist2.run(nan_gradient_error):
        assert not (err <= TOL), err
