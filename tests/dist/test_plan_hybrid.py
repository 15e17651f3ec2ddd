"""The planner's state exchange per step (easy_context.plan.estimate: the recurrent layers'
(A, B) all-gather, its reduce-scatter and the conv halo, through recurrent.mixer's
comm_bytes) equals what a tiny hybrid's recurrent layers send in one real step at 2 ranks:
gated DeltaNet (Qwen3-Next) and Mamba-2 (Granite 4), zigzag (two pieces per rank) and
Ulysses (one)."""

import pytest
from transformers import AutoConfig

from easy_context.plan import estimate_memory
from easy_context.plan.shapes import shape_from_config

from .plan_hybrid_cases import measured_state_bytes


@pytest.mark.parametrize("family", ["qwen3_next", "granite_hybrid"])
@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_state_exchange_matches_measured(dist2, family, method):
    length = 32
    ranks = dist2.run(measured_state_bytes, family, method, length)
    r = ranks[0]
    config = AutoConfig.for_model(r["model_type"], **{
        k: v for k, v in r["config"].items() if k not in ("model_type", "transformers_version")})
    shape = shape_from_config(config, family)
    est = estimate_memory(shape, length, 2, method, engine="replicated", dtype="fp32",
                          checkpointing="none", device="cpu")
    planned = est.recurrent_layers * est.state_communication_per_layer  # per sequence
    assert r["calls"] > 0 and all(x["sent"] == r["sent"] for x in ranks), ranks
    assert planned * r["rows"] == r["sent"], (
        f"planned {planned} B per sequence x {r['rows']} rows, measured {r['sent']} B")
